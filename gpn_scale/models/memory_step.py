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

from gpn_scale.models.core_structures import ChunkLayer, ChunkShared, CoreSpec, Span, read_outputs, step_views

KEEPS_READS = False  # the forward keeps the current step's reads and write errors only (a work ring)
GATE_GRAD_IS_GAMMA = False  # the write's backward gives dL/d(decay), decay = exp(gamma)


def gate_rows(T: int, chunks: dict, save: bool) -> int:
    """Rows of the write's gates (beta, gamma, decay) the forward keeps: every step's when saved."""
    return T if save else 2


class Forward:
    """One window's forward: M in two work buffers written in turn; the one that ends a chunk gets
    its own when saved (the backward reads it as the next chunk's start). Each write's key is the
    normalised next key of the step before's projection, carried (the window's first: `key`)."""

    def __init__(self, spec: CoreSpec, S, M: torch.Tensor, save: bool, chunks: dict, key: torch.Tensor):
        self.S, self.save, self.M, self.key = S, save, M, key
        self.mem = spec.backend.memory
        self.ring = step_views(M.new_empty((2,) + M.shape))
        self.ends = {c1 - 1 for c1 in chunks.values()}
        self.write_err = step_views(S.write_err)
        self.t = self.gs = 0

    def begin_chunk(self, t: int, c1: int) -> None:
        if self.save:
            self.S.M.append(self.M)

    def begin_step(self, t: int, s: int) -> int:
        """Step t begins (s: its saved slot). Returns the row of its write gates."""
        self.t, self.gs = t, s
        return s

    def write(self, v, w: int, s: int, y: int) -> None:
        """The step's write, from the carried key and layer 0's projection (v: its `LayerSteps`; y:
        the projection's slot), and layer 0's read; the next step's key carried."""
        M, gs = self.M, self.gs
        out_M = M.new_empty(M.shape) if self.save and self.t in self.ends else self.ring[w]
        self.M, *_ = self.mem.memory_step(M, self.key, v.v[y], v.beta[gs], v.decay[gs], v.q[w], v.gate[y],
                                          out_e=self.write_err[w], out_o=v.reads[w], out_y=v.read_out[w], out_M=out_M)
        self.key = v.next_key[w]

    def read(self, v, w: int, s: int, y: int) -> None:
        """A later layer's read at the step."""
        self.mem.memory_read(self.M, v.q[w], v.gate[y], out_o=v.reads[w], out_y=v.read_out[w])

    def finish(self) -> torch.Tensor:
        return self.M


class Backward:
    """The reverse sweep's memory: M rebuilt per chunk, dL/dM carried step by step."""

    def __init__(self, spec: CoreSpec, S, dM: torch.Tensor, T: int, no_dM: bool):
        self.spec, self.S = spec, S
        self.mem = spec.backend.memory
        self.beta, self.decay = step_views(S.beta), step_views(S.decay)
        self.ring = step_views(dM.new_empty((2,) + dM.shape))  # dL/dM, written into these in turn
        self.Mbuf = dM.new_empty((min(spec.chunk, T),) + dM.shape)  # M after each step of a chunk

    def chunk(self, span: Span, C: list[ChunkLayer], G: ChunkShared, dM) -> list:
        """M after each step of the chunk, rebuilt from its saved start into Mbuf by replaying the
        write (with layer 0's reads and the write's errors), then the later layers' reads, the read
        factors and the deltas. Returns Ms: Ms[j] is M before step c0 + j."""
        spec, S = self.spec, self.S
        c0, c1 = span.c0, span.c1
        Ms, c = [S.M[span.index]] + list(step_views(self.Mbuf[: c1 - c0])), C[0]
        for j, t in enumerate(range(c0, c1)):
            self.mem.memory_step(Ms[j], c.keys[j], c.v[j], self.beta[t], self.decay[t], c.q[j], c.gate[j], out_e=G.write_err[j],
                                 out_o=c.reads[j], out_y=c.read_out[j], out_M=Ms[j + 1])
        L, B = c1 - c0, S.preds.shape[1]
        for c in C[1:]:  # the later layers' reads: one batched product each over the rebuilt M's
            torch.matmul(torch.stack(c.q).unsqueeze(-2), self.Mbuf[:L], out=c.reads_full.view(L, B, spec.n_heads, 1, spec.d_val))
        read_outputs(spec, C[1:], C)
        G.delta = step_views(S.beta[c0:c1].unsqueeze(-1) * G.write_err_full)
        return Ms

    def _other(self, dM):
        return self.ring[1] if dM is self.ring[0] else self.ring[0]

    def write(self, j: int, t: int, c: ChunkLayer, G: ChunkShared, Ms, dM, out_dk):
        """Back through step t's write and layer 0's read (j: its row in the chunk): dv and the
        gates' pre-activation gradients go straight into the projection's gradient row, which the
        GEMM after reads. Returns (dL/d(normalised [next key | query]), dL/dM before the step)."""
        dM, *_ = self.mem.memory_step_backward(
            Ms[j], Ms[j + 1], c.keys[j], self.beta[t], self.decay[t], G.write_err[j], G.delta[j], c.q[j], c.read_factors[j],
            dM, c.d_read_out[j], out_dk=out_dk, out_dq=G.d_q[j], out_dbeta=G.d_beta[j], out_ddecay=G.d_decay[j],
            out_dgate=c.d_gate[j], out_dM=self._other(dM), out_dv=G.d_v[j], gate_fac=G.gate_fac[j], out_dgates=G.d_beta_a[j])
        return G.d_heads_hat[j], dM

    def read(self, i: int, j: int, c: ChunkLayer, Ms, dM):
        """Back through layer i's read at row j. Returns (dL/d(normalised query) (B, 1, H, dk), dL/dM)."""
        dq, _, dM = self.mem.memory_read_backward(Ms[j + 1], c.q[j], c.read_factors[j], c.d_read_out[j], dM, out_dgate=c.d_gate[j],
                                                  out_dM=self._other(dM))
        return dq.unsqueeze(1), dM

    def cut(self, dM):
        """dL/dM at a truncated-BPTT cut: none flows on."""
        return torch.zeros_like(dM)

    def end_chunk(self, span: Span, Ms, dM):
        """dL/dM as the chunk before receives it: the step carried it already."""
        return dM
