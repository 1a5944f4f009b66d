"""The HF export's forward against gpn-scale's fused core, on the same CPU, in one process.

    PYTHONPATH=. python bench/hf_forward.py                       # the demo GPN+M, 1024 tokens, batch 1 and 8
    PYTHONPATH=. python bench/hf_forward.py --config gpn_m_130m_1l --batch 1 --seq-len 1024
    PYTHONPATH=. python bench/hf_forward.py --threads 1 --dtype bf16

One forward over `--seq-len` tokens, no gradients, each way:
- native: `GPN(tokens, return_logits=True)` with the fused core and the torch kernels
  (`GPNConfig.kernel="torch"`), the baseline; and with the default kernels (`kernel="auto"`: C++ on
  CPU), for reference;
- hf: `GPNForCausalLM(input_ids).logits` of the exported modeling file (`gpn_scale/export/modeling_gpn.py`),
  its weights mapped from the same native model (`gpn_scale.export.hf.hf_weights`); with `--dtype bf16`
  loaded in bfloat16 (against the native core under bf16 autocast).

Rounds alternate the contenders so a slow spell of a shared machine hits all; each time is the
fastest of `--rounds`. Printed: ms per forward and the ratio hf / native (torch kernels) per batch size.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
import time
from pathlib import Path

import torch

from gpn_scale.config import model_config
from gpn_scale.export.hf import _FIELDS, hf_weights
from gpn_scale.models import GPN

ROOT = Path(__file__).resolve().parents[1]


def load_modeling():
    """The exported modeling file as the module transformers would load (standalone: torch and transformers)."""
    path = ROOT / "gpn_scale" / "export" / "modeling_gpn.py"
    spec = importlib.util.spec_from_file_location("modeling_gpn", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["modeling_gpn"] = module
    spec.loader.exec_module(module)
    return module


def hf_model(native: GPN, dtype: torch.dtype):
    mg = load_modeling()
    cfg = mg.GPNConfig(**{k: getattr(native.config, k) for k in _FIELDS}, bos_token_id=0, eos_token_id=0)
    model = mg.GPNForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(hf_weights(native), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected, (missing, unexpected)  # lm_head is tied
    model.tie_weights()
    return model.to(dtype).eval()


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="gpn_m_demo", help="a configs/models name or YAML (default: gpn_m_demo)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    native = GPN(model_config(args.config, {"kernel": "torch"})).eval()
    auto = GPN(model_config(args.config, {"kernel": "auto"}), initialise=False).eval()
    auto.load_state_dict(native.state_dict())
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    hf = hf_model(native, dtype)

    def run_native(model, tokens):
        with torch.autocast("cpu", dtype=torch.bfloat16) if args.dtype == "bf16" else contextlib.nullcontext():
            return model(tokens, return_logits=True)

    cfg = native.config
    print(f"{args.config}: {cfg.family}, d {cfg.d_state}, {cfg.n_layers} layer(s), V {cfg.vocab_size}; "
          f"{args.seq_len} tokens, {args.dtype}, {torch.get_num_threads()} thread(s)")
    print(f"{'batch':>5} {'native torch ms':>15} {'native auto ms':>15} {'hf ms':>10} {'hf / native torch':>18}")
    for batch in args.batch:
        tokens = torch.randint(0, cfg.vocab_size, (batch, args.seq_len))
        ways = {"native": lambda: run_native(native, tokens), "auto": lambda: run_native(auto, tokens),
                "hf": lambda: hf(tokens)}
        best = dict.fromkeys(ways, float("inf"))
        with torch.no_grad():
            for fn in ways.values():  # warm-up: kernels built, the HF maps made
                fn()
            for _ in range(args.rounds):
                for name, fn in ways.items():
                    best[name] = min(best[name], timed(fn))
        print(f"{batch:>5} {best['native'] * 1e3:>15.1f} {best['auto'] * 1e3:>15.1f} {best['hf'] * 1e3:>10.1f} "
              f"{best['hf'] / best['native']:>17.2f}x")


if __name__ == "__main__":
    main()
