"""How the launchers hand tensors to kernels: rows of contiguous elements, given by a pointer and
a row stride, so that views into wider buffers (a row's column slice, one step of a time-major
buffer) are read and written in place, and anything else is copied."""

from __future__ import annotations

import torch
import triton

# Column blocks per row the per-row kernels aim for: 2 x 132 programs (two per SM of a 132-SM
# H100/H200) at batch 32, rather than one program per sequence. Chosen from the row's width
# alone, not the batch, so that a launch's grid grows linearly with the batch (as
# bench/step_cost.py assumes when it counts at two small batches and extrapolates).
BLOCKS_PER_ROW = triton.cdiv(2 * 132, 32)


def split(n: int, most: int, least: int = 32) -> int:
    """Columns per program when rows of n are split into column blocks: the largest power of two
    that makes BLOCKS_PER_ROW blocks or more (a row of 2496 is 10 blocks of 256, of 6656 13 of
    512), but at least `least` (smaller rows: fewer blocks; under Triton's interpreter each
    program is a Python call, and each sums its whole row) and at most `most` or the row."""
    block = 1 << max(0, (n // BLOCKS_PER_ROW).bit_length() - 1)
    return min(most, triton.next_power_of_2(n), max(least, block))


def warps(elements: int) -> int:
    """Warps for a program holding `elements` values of each tensor it works on."""
    return 4 if elements < 2048 else 8


def empty(like: torch.Tensor, shape) -> torch.Tensor:
    """Every buffer a launcher allocates comes from here (the tests poison them with NaN)."""
    return like.new_empty(shape)


def row_stride(x: torch.Tensor, n: int):
    """The row stride of x if it is B rows of n contiguous elements ((B, n) or (B, H, n/H) with
    packed heads, as a row of a wider buffer is), else None."""
    if x.dim() == 2:
        ok = x.shape[1] == n and (n == 1 or x.stride(1) == 1)
    else:
        ok = (x.dim() == 3 and x.shape[1] * x.shape[2] == n and (x.shape[2] == 1 or x.stride(2) == 1)
              and (x.shape[1] == 1 or x.stride(1) == x.shape[2]))
    return x.stride(0) if ok else None


def rows(x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """An input as B rows of n contiguous elements, copied only when its layout is not that already."""
    stride = row_stride(x, n)
    if stride is None:
        x = x.reshape(x.shape[0], n).contiguous()
        stride = n
    return x, stride


def out(buf, n: int, like: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(what the kernel writes, what is returned, the row stride): `buf` itself when its layout
    allows, a fresh buffer when `buf` is None."""
    if buf is None:
        buf = empty(like, shape)
    stride = row_stride(buf, n)
    if stride is None:
        return empty(like, (buf.shape[0], n)), buf, n
    return buf, buf, stride


def finish(written: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """`buf`, holding what the kernel wrote (copied in if it could not write there itself)."""
    if written is not buf:
        buf.copy_(written.view(buf.shape))
    return buf


def head_strides(x: torch.Tensor):
    """(batch, block) strides of a (B, n_blocks, H, d) view whose heads are packed within a block
    (strides (any, any, d, 1)), else None. The fused core keeps [key | query] heads this way."""
    B, nb, H, d = x.shape
    if (d == 1 or x.stride(3) == 1) and (H == 1 or x.stride(2) == d):
        return x.stride(0), (x.stride(1) if nb > 1 else 0)
    return None


def heads_in(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    s = head_strides(x)
    if s is None:
        x = x.contiguous()
        s = head_strides(x)
    return (x, *s)


def heads_out(buf: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(what the kernel writes, batch stride, block stride); `finish` copies it into buf if needed."""
    s = head_strides(buf)
    if s is None:
        written = empty(buf, buf.shape)
        return (written, *head_strides(written))
    return (buf, *s)
