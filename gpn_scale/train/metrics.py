"""Where a run's numbers go: `metrics.jsonl`, wandb, and a progress bar or progress lines (all on rank 0)."""

from __future__ import annotations

import secrets
import sys
import time
from pathlib import Path

import torch

from gpn_scale.jsonl import JsonLines, truncate_jsonl

# Off a terminal (a SLURM log, nohup) a redrawn bar is unreadable: a plain line this often instead.
LINE_EVERY_S = 30.0

# Dense bf16 peak per device, for MFU when `logging.peak_tflops` is not set.
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def peak_flops(configured_tflops: float | None) -> float | None:
    if configured_tflops:
        return configured_tflops * 1e12
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, tflops in _PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return None  # unknown (e.g. CPU): MFU is not reported


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token of windows of `seq_len`: 6 per parameter (the tied embedding counts
    once, as the decoder's matmul), plus what no parameter accounts for, x3 for the backward:
    GPN+M's matrix memory (a write and a read per layer, about 2 FLOPs per cell each way), GDN's
    per-layer delta rule on S (the same write and one read), and the Transformer's attention
    (q.k and the weighted sum of v, 2 FLOPs each per key, over (seq_len + 1) / 2 keys on average)."""
    n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 keeps only a shard
    cfg = model.config
    if cfg.family == "gpn_m":
        extra = (4 + 2 * cfg.n_layers) * cfg.n_heads * cfg.d_key * cfg.d_val
    elif cfg.family == "gdn":
        extra = cfg.n_layers * (4 + 2) * cfg.n_heads * cfg.d_key * cfg.d_val
    elif cfg.family == "transformer":
        extra = cfg.n_layers * 4 * cfg.d_model * (seq_len + 1) / 2
    else:
        extra = 0
    return 6.0 * n + 3 * extra


class MetricsLog:
    def __init__(self, run_dir: Path, config: dict, wandb_mode: str, project: str, name: str,
                 start_step: int, total_steps: int, enabled: bool):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.wandb = None
        self.bar = None
        self.total_steps = total_steps
        self.last_line = time.monotonic()
        if not enabled:
            return
        kept = truncate_jsonl(self.path, start_step)
        if kept is not None:
            print(f"{self.path}: records after step {start_step} (or torn) dropped; the previous file is kept as {kept}",
                  file=sys.stderr, flush=True)
        self.file = JsonLines(self.path)
        if wandb_mode != "disabled":
            import wandb

            id_file = run_dir / "wandb_id"
            run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(6)
            id_file.write_text(run_id)
            self.wandb = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(run_dir),
                                    mode=wandb_mode, config=config)
        if not sys.stderr.isatty():
            return
        from tqdm import tqdm

        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, mininterval=1.0)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(record)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])

    def progress(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.refresh()
        elif self.enabled and (time.monotonic() - self.last_line >= LINE_EVERY_S or step == self.total_steps):
            self.last_line = time.monotonic()
            print(f"step {step}/{self.total_steps} | loss {loss:.4f} | {tokens_per_s:,.0f} tok/s", flush=True)

    def write(self, message: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(message)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
