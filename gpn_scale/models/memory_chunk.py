"""The memory's chunk form in the fused core: M read once per step from the chunk's start, written
once per chunk (kernels/memory_chunk).

Forward: within a chunk of L steps every step reads M_c, the memory at the chunk's start, and
corrects the read with the chunk's keys and deltas kept so far (`chunk.step` for layer 0, which
also forms the write's error, `chunk.read` for the later layers); the chunk's last step writes
M once. With `memory_reads: compute` the per-step products read a copy of M_c in the compute
dtype, made once per chunk. Every step's reads, errors and deltas are kept (T rows), and M at
every chunk's start (with `memory_reads: compute` only its copy, which is all the backward reads
of it).

Backward: per chunk, the L x L algebra of its keys is formed once from the forward's deltas,
errors and reads, with dL/dM at the chunk's end reduced to the products the sweep reads
(`chunk.algebra`); each step's backward then needs no M but M_c, and dL/dM leaves the chunk
once, at its start (`chunk.finish`, `chunk.carry_back`), cut at truncated-BPTT boundaries
(which are chunk boundaries in this form: core_structures.bounds).

The core (core.py) drives a form through the same few calls as memory_step.py's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gpn_scale.models.core_structures import ChunkLayer, ChunkShared, CoreSpec, Span, read_outputs, step_views
from kernels.memory_chunk import algebra

KEEPS_READS = True  # the forward keeps every step's reads, write errors and deltas: the backward takes them as they were
GATE_GRAD_IS_GAMMA = True  # the write's backward gives dL/dgamma


def gate_rows(T: int, chunks: dict, save: bool) -> int:
    """Rows of the write's gates the forward keeps: every step's when saved, else a chunk's (its
    steps read the chunk's decays)."""
    return T if save else max(c1 - c0 for c0, c1 in chunks.items())


class Forward:
    """One window's forward: the chunk's keys and deltas kept as it goes, M written at each chunk's
    last step into the next of two work buffers (its own when saved and the backward reads it: M_c
    without low reads, the window's last M always)."""

    def __init__(self, spec: CoreSpec, S, M: torch.Tensor, save: bool, chunks: dict, key: torch.Tensor):
        self.spec, self.S, self.save, self.M, self.key = spec, S, save, M, key
        self.ring = step_views(M.new_empty((2,) + M.shape))
        self.ends = {c1 - 1 for c1 in chunks.values()}
        self.write_err = step_views(S.write_err)
        self.ops, L = spec.backend.chunk, max(c1 - c0 for c0, c1 in chunks.items())
        B = M.shape[0]
        self.keys = M.new_empty((L, B, spec.n_heads, spec.d_key))
        self.work_deltas = None if save else M.new_empty((L, B, spec.n_heads, spec.d_val))  # saved: the chunk's rows of S.delta
        self.ci = self.t = self.gs = -1
        # With low reads each chunk's last step also writes the next chunk's copy of M (a buffer of its
        # own when saved, else one of two in turn); the window's first chunk casts its M_c.
        low_ring = spec.low_reads and not save
        self.read_ring = step_views(M.new_empty((2,) + M.shape, dtype=spec.compute_dtype)) if low_ring else None
        self.last_end, self.next_read = max(self.ends), None

    def begin_chunk(self, t: int, c1: int) -> None:
        S, M = self.S, self.M
        self.c0, self.M_c, self.ci = t, M, self.ci + 1
        if self.spec.low_reads:
            self.M_read = M.to(self.spec.compute_dtype) if self.next_read is None else self.next_read
        else:
            self.M_read = None
        if self.save:  # what the backward's products read: with low reads the copy alone, half M's bytes
            S.M.append(M if self.M_read is None else self.M_read)
        self.decays = S.decay[t:c1] if self.save else S.decay[: c1 - t]
        self.deltas = S.delta[t:c1] if self.save else self.work_deltas

    def begin_step(self, t: int, s: int) -> int:
        """Step t begins (s: its saved slot). Returns the row of its write gates: its saved slot, or
        its row in the chunk."""
        self.t = t
        self.gs = s if self.save else t - self.c0
        return self.gs

    def write(self, v, w: int, s: int, y: int) -> None:
        """The step's write from the carried key (its delta kept; M written at the chunk's last step
        only, into a buffer other than M_c) and layer 0's read (v: its `LayerSteps`; y: the
        projection's slot); the next step's key carried."""
        t, out_M, out_read = self.t, None, None
        if t in self.ends:  # an M the backward reads is its own buffer, else one of the ring's in turn
            kept = self.save and (not self.spec.low_reads or t == self.last_end)
            out_M = self.M.new_empty(self.M.shape) if kept else self.ring[self.ci % 2]
            if self.spec.low_reads and t != self.last_end:
                out_read = self.M_read.new_empty(self.M.shape) if self.save else self.read_ring[self.ci % 2]
        self.ops.step(self.M_c, self.keys, self.deltas, self.decays, t - self.c0, self.key, v.v[y], v.beta[self.gs], v.q[w],
                      v.gate[y], out_e=self.write_err[s], out_o=v.reads[s], out_y=v.read_out[w], out_M=out_M,
                      M_read=self.M_read, out_M_read=out_read)
        self.M = self.M if out_M is None else out_M
        self.next_read = out_read
        self.key = v.next_key[w]

    def read(self, v, w: int, s: int, y: int) -> None:
        """A later layer's read at the step."""
        self.ops.read(self.M_c, self.keys, self.deltas, self.decays, self.t - self.c0, v.q[w], v.gate[y], out_o=v.reads[s],
                      out_y=v.read_out[w], M_read=self.M_read)

    def finish(self) -> torch.Tensor:
        if self.save:
            self.S.M_end = self.M
        return self.M


class ChunkSweep(NamedTuple):
    """One chunk of the reverse sweep: M_c (in the compute dtype with `low_reads`), the chunk's keys
    (L, B, H, dk) and queries (layers, L, B, H, dk), its forward values and L x L algebra
    (`algebra.Rebuilt`), and dL/dM's products at the chunk's end (`Coefficients`)."""

    M_c: torch.Tensor
    keys: torch.Tensor
    queries: torch.Tensor
    r: algebra.Rebuilt
    co: algebra.Coefficients


class Backward:
    """The reverse sweep's memory: per chunk its algebra, dL/dM carried from chunk to chunk. It
    fills the read gradients (layers, >= L, B, H, dv) and phi = <dL/dM, M> (B, H) as it goes."""

    def __init__(self, spec: CoreSpec, S, dM: torch.Tensor, T: int, no_dM: bool):
        self.spec, self.S, self.ops = spec, S, spec.backend.chunk
        self.beta = step_views(S.beta)
        self.ring = step_views(dM.new_empty((2,) + dM.shape))  # dL/dM at chunk starts, written into these in turn
        B = S.preds.shape[1]
        self.read_grads = dM.new_empty((len(S.x_hat), min(spec.chunk, T), B, spec.n_heads, spec.d_val))
        self.phi = S.preds.new_zeros((B, spec.n_heads)) if no_dM else torch.linalg.vecdot(dM.flatten(2), S.M_end.flatten(2))

    def chunk(self, span: Span, C: list[ChunkLayer], G: ChunkShared, dM) -> ChunkSweep:
        """The once-per-chunk work before the sweep: the L x L algebra of the chunk's keys (its
        deltas, errors and reads are the forward's), the read outputs and factors, and the products
        of dM (dL/dM at the chunk's end) the sweep reads."""
        spec, S, sl = self.spec, self.S, span.rows
        keys = torch.stack(C[0].keys)
        queries = torch.stack([c.q_full for c in C])
        r, co = self.ops.algebra(dM, keys, S.beta[sl], S.decay[sl], S.delta[sl], G.write_err_full, [c.reads_full for c in C],
                                 queries)
        G.delta = step_views(r.delta)
        read_outputs(spec, C, C)
        # M_c as the step's products read it (`low_reads`: a copy)
        return ChunkSweep(M_c=S.M[span.index], keys=keys, queries=queries, r=r, co=co)

    def write(self, j: int, t: int, c: ChunkLayer, G: ChunkShared, Ms: ChunkSweep, dM, out_dk):
        """Back through step t's write and layer 0's read (row j of the chunk); dL/dM is not carried
        step by step. Returns (dL/d(normalised [next key | query]), dM unchanged)."""
        self.ops.step_backward(
            Ms.M_c, Ms.keys, Ms.r.delta, Ms.r, Ms.co, j, self.beta[t], G.write_err[j], c.v[j], Ms.queries, c.reads[j],
            c.read_factors[j], c.d_read_out[j], self.read_grads, self.phi, out_dk=out_dk, out_dq=G.d_q[j], out_dbeta=G.d_beta[j],
            out_dgamma=G.d_decay[j], out_dgate=c.d_gate[j], out_dv=G.d_v[j], gate_fac=G.gate_fac[j], out_dgates=G.d_beta_a[j])
        return G.d_heads_hat[j], dM

    def read(self, i: int, j: int, c: ChunkLayer, Ms: ChunkSweep, dM):
        """Back through layer i's read at row j. Returns (dL/d(normalised query) (B, 1, H, dk), dM)."""
        dq, _ = self.ops.read_backward(Ms.M_c, Ms.keys, Ms.r.delta, Ms.r, j, c.reads[j], c.read_factors[j],
                                       c.d_read_out[j], self.read_grads[i], self.phi, out_dgate=c.d_gate[j])
        return dq.unsqueeze(1), dM

    def cut(self, dM):
        """At a truncated-BPTT cut dL/dM stops where its chunk starts (`end_chunk`)."""
        return dM

    def end_chunk(self, span: Span, Ms: ChunkSweep, dM):
        """dL/dM as the chunk before receives it: leaving the chunk at its start, in one step (none
        across a truncated-BPTT cut); never into the buffer dM is in."""
        spec, c0, c1 = self.spec, span.c0, span.c1
        terms = self.ops.finish(Ms.keys, Ms.r, Ms.co, self.S.beta[span.rows], Ms.queries, self.read_grads[:, : c1 - c0])
        dM = self.ops.carry_back(dM, terms, out=self.ring[span.index % 2])
        if spec.bptt and c0 % spec.bptt == 0 and c0 > 0:
            dM.zero_()
            self.phi.zero_()
        return dM
