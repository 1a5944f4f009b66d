"""The state reset at document boundaries (`train.reset_on_eos`): the token after an EOS is read from
the empty state, as if its document started a window, while the rows around it go on.

A row's reset cannot stop the batch's loop, so the recurrent families cut the window in time where
any row has an EOS, run their loop over each piece from the state the last one ended with, and
between pieces put the empty state into the rows whose piece ended with EOS (`torch.where`: the
gradient into the replaced rows' old state is zero, the other rows' flows on). The loop's math is
unchanged, only the number of calls grows with the distinct EOS positions in the micro-batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Piece(NamedTuple):
    """Positions [start, stop) of the window; `reset`: the rows (B,) bool whose state is the empty
    one after this piece (None: no row); `cut`: gradients stop after it (truncated BPTT)."""

    start: int
    stop: int
    reset: torch.Tensor | None
    cut: bool


def check(resets: torch.Tensor, tokens: torch.Tensor) -> None:
    if resets.dtype != torch.bool or resets.shape != tokens.shape:
        raise ValueError(f"resets: expected a bool tensor shaped like the tokens {tuple(tokens.shape)}, got "
                         f"{resets.dtype} {tuple(resets.shape)}")


def pieces(resets: torch.Tensor, bptt: int = 0) -> list[Piece]:
    """The window (B, T) cut after every position where some row resets, and at the multiples of
    `bptt` (where the loop detaches the state on its own: inside a piece it would count from the
    piece's start)."""
    T = resets.shape[1]
    anywhere = resets.any(0).tolist()  # one read of the device, not one per piece
    stops = {t + 1 for t, yes in enumerate(anywhere) if yes} | {T}
    if bptt:
        stops |= set(range(bptt, T, bptt))
    out, start = [], 0
    for stop in sorted(stops):
        # the window's end is no cut: the state it returns is the caller's to detach, as without resets
        out.append(Piece(start, stop, resets[:, stop - 1] if anywhere[stop - 1] else None,
                         bool(bptt) and stop < T and stop % bptt == 0))
        start = stop
    return out


def where_rows(rows: torch.Tensor, fresh, carried):
    """The nest of state tensors `carried` with the rows in `rows` taken from `fresh` (same nest,
    None where the state has none), in the carried tensors' dtypes."""
    if carried is None:
        return None
    if isinstance(carried, torch.Tensor):
        mask = rows.view(-1, *([1] * (carried.dim() - 1)))
        return torch.where(mask, fresh.to(carried.dtype), carried)
    return type(carried)(*(where_rows(rows, f, c) for f, c in zip(fresh, carried))) if hasattr(carried, "_fields") \
        else type(carried)(where_rows(rows, f, c) for f, c in zip(fresh, carried))
