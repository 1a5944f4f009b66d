"""What `train.reset_on_eos` costs: a training step (forward + backward) of a window whose rows hold
documents' ends, with the state reset at each (`resets`), against the same window without.

    PYTHONPATH=. python bench/resets.py                                   # the demo's GPN+M, CPU
    PYTHONPATH=. python bench/resets.py --config gpn_m_130m_1l --batch 8 --seq-len 2048 --doc-len 1000
    PYTHONPATH=. python bench/resets.py --config gdn_demo --doc-len 64       # any family that carries state

Documents' lengths are drawn from an exponential distribution of mean `--doc-len` (seeded), so a
window of B rows holds about B * T / doc_len ends at scattered positions: the window is cut into a
piece per distinct position (gpn_scale/models/resets.py). The two steps take turns, one timed step
of each per round, so a slow spell of a shared machine slows both alike; the fastest of each is
reported, with the ratio and the number of pieces.

Imports torch, the model package and the config system (for configs/models/*.yaml).
"""

from __future__ import annotations

import argparse
import time

import torch

from gpn_scale.models import build_model
from gpn_scale.models.resets import pieces


def document_ends(batch: int, seq_len: int, doc_len: float, seed: int = 0) -> torch.Tensor:
    """(batch, seq_len) bool: True where a document ends, lengths exponential of mean doc_len."""
    gen = torch.Generator().manual_seed(seed)
    ends = torch.zeros(batch, seq_len, dtype=torch.bool)
    for row in range(batch):
        t = 0
        while True:
            t += 1 + int(torch.empty(1).exponential_(1 / doc_len, generator=gen).item())
            if t > seq_len:
                break
            ends[row, t - 1] = True
    return ends


def main() -> None:
    from gpn_scale.config import model_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="gpn_m_demo", help="a configs/models/*.yaml name")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--doc-len", type=float, default=866.0, help="mean document length in tokens (the demo corpus's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(model_config(args.config)).to(args.device)
    vocab = model.config.vocab_size
    tokens = torch.randint(1, vocab, (args.batch, args.seq_len), device=args.device)
    ends = document_ends(args.batch, args.seq_len, args.doc_len).to(args.device)
    tokens[ends] = 0  # the EOS id of this benchmark

    def step(resets):
        model.zero_grad(set_to_none=True)
        out = model(tokens, **({} if resets is None else {"resets": resets}))
        out.loss.backward()
        if args.device == "cuda":
            torch.cuda.synchronize()

    cases = {"whole windows": None, "reset at each EOS": tokens == 0}
    best = dict.fromkeys(cases, float("inf"))
    for name, resets in cases.items():  # untimed: kernels loaded, buffers made
        step(resets)
    for _ in range(args.rounds):
        for name, resets in cases.items():
            began = time.perf_counter()
            step(resets)
            best[name] = min(best[name], time.perf_counter() - began)
    n = len(pieces(tokens == 0, getattr(model.config, "bptt", 0)))
    print(f"{args.config}: batch {args.batch} x {args.seq_len} tokens, {int(ends.sum())} documents' ends at "
          f"{int(ends.any(0).sum())} distinct positions: {n} pieces, bptt cuts included ({args.device})")
    for name, s in best.items():
        print(f"  {name:>18}: {s * 1e3:8.1f} ms per step, {args.batch * args.seq_len / s:10,.0f} tok/s")
    print(f"  reset / whole: {best['reset at each EOS'] / best['whole windows']:.2f}x the time")


if __name__ == "__main__":
    main()
