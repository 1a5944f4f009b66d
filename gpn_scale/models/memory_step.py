"""The memory's step form in the fused core: M read and written at every step.

Forward: at each step, layer 0's `memory_step` (kernels/memory) writes M into the next of two work
buffers, written in turn, and makes layer 0's read of the new M; each later layer's
`memory_read` reads it. M is saved at the start of every chunk (and the window's last M gets a
buffer of its own, which the caller keeps).

Backward: per chunk, M after each of its steps is rebuilt from the chunk's saved start into one
buffer every chunk reuses, by replaying the write (which makes layer 0's reads and the write's
errors again); the later layers' reads are one batched product over the rebuilt M's. The sweep
then carries dL/dM step by step back through each layer's read and the write, in two buffers
written in turn.

The core (core.py) drives a form through the same few calls, `Forward` at each step and
`Backward` at each chunk and step of the reverse sweep; memory_chunk.py is the other form.
"""

from __future__ import annotations

import torch

from gpn_scale.models.core_structures import ChunkLayer, ChunkShared, Span, Spec, read_outputs, step_views

KEEPS_READS = False  # the forward keeps the current step's reads and write errors only (a work ring)
GATE_GRAD_IS_GAMMA = False  # the write's backward gives dL/d(decay), decay = exp(gamma)


def gate_rows(T: int, chunks: dict, save: bool) -> int:
    """Rows of the write's gates (BETA, GAMMA, DECAY) the forward keeps: every step's when saved."""
    return T if save else 2


class Forward:
    """One window's forward: M in two work buffers written in turn; the one that ends a chunk gets
    its own when saved (the backward reads it as the next chunk's start)."""

    def __init__(self, spec: Spec, S, M: torch.Tensor, save: bool, chunks: dict):
        self.S, self.save, self.M = S, save, M
        self.mem = spec.backend.memory
        self.ring = step_views(M.new_empty((2,) + M.shape))
        self.ends = {c1 - 1 for c1 in chunks.values()}
        self.E, self.BETA, self.DECAY = step_views(S.E), step_views(S.BETA), step_views(S.DECAY)

    def begin_chunk(self, t: int, c1: int) -> None:
        if self.save:
            self.S.M.append(self.M)

    def gate_slot(self, t: int, s: int) -> int:
        """The row of step t's write gates (s: the step's saved slot)."""
        return s

    def write(self, t: int, w: int, s: int, y: int, v, k) -> None:
        """Step t's write, from key k and layer 0's projection (v: its `LayerSteps`; y: the
        projection's slot), and layer 0's read."""
        M, gs = self.M, self.gate_slot(t, s)
        out_M = M.new_empty(M.shape) if self.save and t in self.ends else self.ring[w]
        self.M, *_ = self.mem.memory_step(M, k, v.v[y], self.BETA[gs], self.DECAY[gs], v.q[w], v.gate[y], out_e=self.E[w],
                                          out_o=v.o[w], out_y=v.z_read[w], out_M=out_M)

    def read(self, t: int, w: int, s: int, y: int, v) -> None:
        """A later layer's read at step t."""
        self.mem.memory_read(self.M, v.q[w], v.gate[y], out_o=v.o[w], out_y=v.z_read[w])

    def finish(self) -> torch.Tensor:
        return self.M


class Backward:
    """The reverse sweep's memory: M rebuilt per chunk, dL/dM carried step by step."""

    def __init__(self, spec: Spec, S, dM: torch.Tensor, T: int, no_dM: bool):
        self.spec, self.S = spec, S
        self.mem = spec.backend.memory
        self.BETA, self.DECAY = step_views(S.BETA), step_views(S.DECAY)
        self.ring = step_views(dM.new_empty((2,) + dM.shape))  # dL/dM, written into these in turn
        self.Mbuf = dM.new_empty((min(spec.chunk, T),) + dM.shape)  # M after each step of a chunk

    def chunk(self, span: Span, C: list[ChunkLayer], G: ChunkShared, dM) -> list:
        """M after each step of the chunk, rebuilt from its saved start into Mbuf by replaying the
        write (with layer 0's reads and the write's errors), then the later layers' reads, the read
        factors and the deltas. Returns Ms: Ms[j] is M before step c0 + j."""
        spec, S = self.spec, self.S
        ci, c0, c1 = span
        Ms, c = [S.M[ci]] + list(step_views(self.Mbuf[: c1 - c0])), C[0]
        for j, t in enumerate(range(c0, c1)):
            self.mem.memory_step(Ms[j], c.keys[j], c.v[j], self.BETA[t], self.DECAY[t], c.q[j], c.gate[j], out_e=G.e[j],
                                 out_o=c.o[j], out_y=c.z_read[j], out_M=Ms[j + 1])
        L, B = c1 - c0, S.P.shape[1]
        for c in C[1:]:  # the later layers' reads: one batched product each over the rebuilt M's
            torch.matmul(torch.stack(c.q).unsqueeze(-2), self.Mbuf[:L], out=c.O_full.view(L, B, spec.H, 1, spec.dv))
        read_outputs(spec, C[1:], C)
        G.delta = step_views(S.BETA[c0:c1].unsqueeze(-1) * G.E_full)
        return Ms

    def _other(self, dM):
        return self.ring[1] if dM is self.ring[0] else self.ring[0]

    def write(self, j: int, t: int, c: ChunkLayer, G: ChunkShared, Ms, dM, out_dk):
        """Back through step t's write and layer 0's read (j: its row in the chunk): dv and the
        gates' pre-activation gradients go straight into the projection's gradient row, which the
        GEMM after reads. Returns (dL/d(normalised [next key | query]), dL/dM before the step)."""
        dM, *_ = self.mem.memory_step_backward(
            Ms[j], Ms[j + 1], c.keys[j], self.BETA[t], self.DECAY[t], G.e[j], G.delta[j], c.q[j], c.rf[j], dM,
            c.dz_read[j], out_dk=out_dk, out_dq=G.dq_out[j], out_dbeta=G.dbeta[j], out_ddecay=G.ddecay[j],
            out_dgate=c.dgate[j], out_dM=self._other(dM), out_dv=G.dv[j], gate_fac=G.gate_fac[j], out_dgates=G.dgates[j])
        return G.dKQ[j], dM

    def read(self, i: int, j: int, c: ChunkLayer, Ms, dM):
        """Back through layer i's read at row j. Returns (dL/d(normalised query) (B, 1, H, dk), dL/dM)."""
        dq, _, dM = self.mem.memory_read_backward(Ms[j + 1], c.q[j], c.rf[j], c.dz_read[j], dM, out_dgate=c.dgate[j],
                                                  out_dM=self._other(dM))
        return dq.unsqueeze(1), dM

    def cut(self, dM):
        """dL/dM at a truncated-BPTT cut: none flows on."""
        return torch.zeros_like(dM)

    def end_chunk(self, span: Span, Ms, dM):
        """dL/dM as the chunk before receives it: the step carried it already."""
        return dM
