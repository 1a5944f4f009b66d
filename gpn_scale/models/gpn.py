"""GPN and GPN+M, exactly as docs/model.md defines them.

Parameters keep the paper's names, shapes and `in x out` layout (`y = x @ W`), so reference
checkpoints map one to one: top-level names are the reference's, per-layer names live under
`layers.{i}.` where the reference writes `L{i}_` (GPN+M) or nothing (one-layer GPN).

Shape of the computation: the loop cannot run in parallel, so what does not feed back into it
leaves it (docs/core.md, "Where the time goes", point 1). The input projection
`u_t = rms(emb[x_t]) @ fuse_proj_k` runs for all t before the time loop, the decoder and the
cross-entropy for all t after it (chunked, see `ops.linear_cross_entropy`); only the recurrent
core stays in the loop.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import ClassVar, Literal, NamedTuple, get_args

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from gpn_scale.models.core import fuse_weights, fused_recurrence
from gpn_scale.models.ops import at_least_f32, l2_normalize, lecun_normal_, linear_cross_entropy, rms_norm, rms_norm_rows
from gpn_scale.models.resets import check as resets_check, pieces, where_rows
from gpn_scale.models.model_spec import ModelSpec, matrices_decay
import kernels
from kernels import KERNELS, Backend, Kernel
from kernels.step.reference import OPS as ce_twin

# The enumerated keys of GPNConfig: a config's value is checked against these, and its refusal lists them.
Family = Literal["gpn", "gpn_m"]
Core = Literal["fused", "naive"]
MemoryForm = Literal["auto", "step", "chunk"]
MemoryReads = Literal["state", "compute"]
Projections = Literal["recompute", "keep"]
FAMILIES, CORES, MEMORY_FORMS = get_args(Family), get_args(Core), get_args(MemoryForm)
MEMORY_READS, PROJECTIONS = get_args(MemoryReads), get_args(Projections)


@dataclass
class GPNConfig:
    family: Family = "gpn_m"  # "gpn" (no memory) or "gpn_m" (one shared matrix memory)
    vocab_size: int = 32000  # the embedding's and the decoder's rows: at least the tokenizer's vocabulary
    d_state: int = 2496  # the state's width d (docs/model.md)
    d_emb: int = 768  # the token embedding's width E
    d_ffn: int = 6656  # the SwiGLU FFN's width F in each predict layer
    n_layers: int = 1  # predict layers N
    n_heads: int = 15  # memory heads H: the memory M has shape (H, d_key, d_val); ignored by "gpn"
    d_key: int = 128  # the memory's key width per head
    d_val: int = 256  # the memory's value width per head
    use_decoder_bias: bool = False  # the decoder's bias (decode_bias, E zeros at start)
    # Execution only: none of these change the math.
    core: Core = "fused"  # the time loop: "fused" (custom backward, see core.py) or "naive" (autograd)
    core_chunk: int = 32  # fused core: M is kept every this many steps and rebuilt in between
    # fused core's memory: "step" (M read and written every step), "chunk" (M read once per step and written once
    # per chunk: docs/core.md), or "auto" (chunk on CUDA, where M's traffic sets the speed; step elsewhere)
    memory_form: MemoryForm = "auto"
    # chunk form under autocast: its per-step products read M_c in the state's dtype (float32), or in the compute
    # dtype (bf16; a copy made once per chunk: half the traffic of the step's largest read). M itself stays float32.
    memory_reads: MemoryReads = "state"
    # fused core's backward: each layer's fused projection "recompute"d per chunk (one GEMM, nothing kept), or
    # "keep": the forward keeps every step's (its width per token, in the GEMM's dtype) and the backward reads it
    core_projections: Projections = "recompute"
    recompute_every: int = 0  # naive core: recompute activations in time segments of this length (0: off)
    bptt: int = 0  # truncate backprop through time every this many steps (0: full window)
    ce_chunk: int = 8192  # rows of the decoder + cross-entropy computed at once
    kernel: Kernel = "auto"  # fused core's memory step, step groups and the decoder's cross-entropy: "triton", "cpp" (CPU), "torch", or "auto" (triton on CUDA, cpp on CPU)
    cuda_graphs: bool = True  # fused core on CUDA: capture its time loops once per shape, then replay
    # May change when a run resumes: how the same math is executed (bptt is not: it cuts gradients).
    EXECUTION_KEYS: ClassVar[tuple[str, ...]] = ("core", "core_chunk", "memory_form", "recompute_every", "ce_chunk", "kernel",
                                                 "cuda_graphs", "core_projections")
    # Keys renamed (old -> new): a config given with the old name is refused in one line naming the new one;
    # a saved config written before the rename (a checkpoint's, a native model.yaml) is read under the new name.
    RENAMED: ClassVar[dict[str, str]] = {"checkpoint_every": "recompute_every"}

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family: expected one of {FAMILIES}, got {self.family!r}")
        if self.core not in CORES:
            raise ValueError(f"core: expected one of {CORES}, got {self.core!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel: expected one of {KERNELS}, got {self.kernel!r}")
        if self.memory_form not in MEMORY_FORMS:
            raise ValueError(f"memory_form: expected one of {MEMORY_FORMS}, got {self.memory_form!r}")
        if self.memory_reads not in MEMORY_READS:
            raise ValueError(f"memory_reads: expected one of {MEMORY_READS}, got {self.memory_reads!r}")
        if self.core_projections not in PROJECTIONS:
            raise ValueError(f"core_projections: expected one of {PROJECTIONS}, got {self.core_projections!r}")
        positive = ["vocab_size", "d_state", "d_emb", "d_ffn", "n_layers", "ce_chunk", "core_chunk"]
        if self.memory:
            positive += ["n_heads", "d_key", "d_val"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        for name in ("recompute_every", "bptt"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0 (0 disables it), got {getattr(self, name)}")

    @property
    def memory(self) -> bool:
        return self.family == "gpn_m"

    def memory_form_on(self, device_type: str) -> str:
        """The memory form the fused core runs on a device type: "step" or "chunk"."""
        if self.memory_form != "auto":
            return self.memory_form
        return "chunk" if device_type == "cuda" else "step"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


class GPNState(NamedTuple):
    """What is carried from one token to the next: enough to continue the stream.

    s: the grounded state for the next token, s^g_{t+1} (B, d), float32.
    prev_s: the grounded state before it, s^g_t (B, d), float32; the memory's next key comes from it.
    M: the matrix memory (B, H, d_key, d_val), float32; None for GPN.
    """

    s: torch.Tensor
    prev_s: torch.Tensor
    M: torch.Tensor | None

    def detach(self) -> "GPNState":
        return GPNState(self.s.detach(), self.prev_s.detach(), None if self.M is None else self.M.detach())


class ModelOutput(NamedTuple):
    """A NamedTuple, not a dataclass: DeepSpeed ZeRO-3 hooks the tensors of tuple outputs to gather
    the parameters again for the backward."""

    loss: torch.Tensor  # mean CE over all B*T positions (float32)
    token_losses: torch.Tensor  # (B, T) float32
    state: GPNState
    logits: torch.Tensor | None = None  # (B, T, V), only when asked for


class StepHooks:
    """Observation and intervention points inside the time loop, for analyses and ablations.

    Only the naive core calls them (a model run with hooks uses it whatever `core` says); the
    defaults change nothing, so a subclass overrides just the points it needs.
    """

    def decay(self, gamma: torch.Tensor) -> None:
        """This step's memory write decays: gamma (B, H), the write keeps exp(gamma) of M."""

    def read(self, o: torch.Tensor) -> torch.Tensor:
        """A predict layer's normalised memory read, per head (B, H, d_val); returns the one used."""
        return o

    def prediction(self, c: torch.Tensor) -> torch.Tensor:
        """The predicted state s^p_t (B, d); returns the one decoded and grounded."""
        return c


def _zeros_param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape))


def _ones_param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.ones(*shape))


def _gate(x, norm_w, kernel, bias):
    return torch.sigmoid(rms_norm(x, norm_w) @ kernel + bias)


class PredictLayer(nn.Module):
    """One layer of Predict: `c <- Gate(c) * c + FFN(c) [+ memory read]`."""

    def __init__(self, cfg: GPNConfig):
        super().__init__()
        d, f = cfg.d_state, cfg.d_ffn
        self.ffn_norm_w = _ones_param(d)
        self.ffn_w1_k = _zeros_param(d, 2 * f)
        self.ffn_w2_k = _zeros_param(f, d)
        self.pg_norm_w = _ones_param(d)
        self.pg_gate_k = _zeros_param(d, d)
        self.pg_gate_b = _zeros_param(d)
        self.memory = cfg.memory
        if self.memory:
            hk, hv = cfg.n_heads * cfg.d_key, cfg.n_heads * cfg.d_val
            self.n_heads = cfg.n_heads
            self.read_norm_w = _ones_param(d)
            self.read_W_q_k = _zeros_param(d, hk)
            self.read_W_q_b = _zeros_param(hk)
            self.read_W_gate_k = _zeros_param(d, hv)
            self.read_out_norm_w = _ones_param(hv)
            self.read_W_o_k = _zeros_param(hv, d)

    @torch.no_grad()
    def reset_parameters(self):
        for p, init in self._inits():
            init(p)

    def _inits(self):
        ones, zeros = nn.init.ones_, nn.init.zeros_
        yield from [(self.ffn_norm_w, ones), (self.ffn_w1_k, lecun_normal_), (self.ffn_w2_k, zeros)]
        yield from [(self.pg_norm_w, ones), (self.pg_gate_k, zeros), (self.pg_gate_b, zeros)]
        if self.memory:
            yield from [(self.read_norm_w, ones), (self.read_W_q_k, lecun_normal_), (self.read_W_q_b, zeros)]
            yield from [(self.read_W_gate_k, lecun_normal_), (self.read_out_norm_w, ones)]
            yield self.read_W_o_k, lambda w: nn.init.normal_(w, 0.0, 0.02)

    def forward(self, c: torch.Tensor, M: torch.Tensor | None, hooks: StepHooks | None = None) -> torch.Tensor:
        g, u = (rms_norm(c, self.ffn_norm_w) @ self.ffn_w1_k).chunk(2, dim=-1)
        update = (nn.functional.silu(g) * u) @ self.ffn_w2_k
        if self.memory:
            r = rms_norm(c, self.read_norm_w)
            B = c.shape[0]
            q = l2_normalize(torch.relu(r @ self.read_W_q_k + self.read_W_q_b).view(B, self.n_heads, -1))
            o = rms_norm(read_memory(M, q).reshape(B, -1), self.read_out_norm_w)
            if hooks is not None:
                o = hooks.read(o.view(B, self.n_heads, -1)).reshape(B, -1)
            gate = nn.functional.silu(r @ self.read_W_gate_k)
            update = update + (gate * o.to(gate.dtype)) @ self.read_W_o_k
        return _gate(c, self.pg_norm_w, self.pg_gate_k, self.pg_gate_b) * c + update


def read_memory(M: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """o[b, h, j] = sum_i M[b, h, i, j] q[b, h, i], in float32 whatever autocast says."""
    with torch.autocast(M.device.type, enabled=False):
        return torch.einsum("bhkv,bhk->bhv", M, q.to(M.dtype))


def write_memory(M, k, v, beta, gamma):
    """Gated delta rule, per head: M <- exp(gamma) M + beta k (v - M^T k)^T, in float32."""
    with torch.autocast(M.device.type, enabled=False):
        k, v = k.to(M.dtype), v.to(M.dtype)
        pred_v = torch.einsum("bhkv,bhk->bhv", M, k)
        delta = beta.to(M.dtype)[..., None] * (v - pred_v)
        return torch.exp(gamma)[..., None, None] * M + k[..., :, None] * delta[..., None, :]


class GPN(nn.Module):
    """GPN (family "gpn") and GPN+M (family "gpn_m") with any number of predict layers."""

    def __init__(self, cfg: GPNConfig, initialise: bool = True):
        """initialise=False leaves the parameters as allocated (zeros and ones; nothing on the meta
        device), for counting them or loading them."""
        super().__init__()
        self.config = cfg
        d, E, V = cfg.d_state, cfg.d_emb, cfg.vocab_size
        self.embedding = _zeros_param(V, E)
        self.decode_norm_w = _ones_param(d)
        self.decode_proj_k = _zeros_param(d, E)
        self.decode_bias = _zeros_param(E) if cfg.use_decoder_bias else None
        self.fuse_norm_w = _ones_param(E)
        self.fuse_proj_k = _zeros_param(E, d)
        self.fg_norm_w = _ones_param(d)
        self.fg_gate_k = _zeros_param(d, d)
        self.fg_gate_b = _zeros_param(d)
        if cfg.memory:
            H, hk, hv = cfg.n_heads, cfg.n_heads * cfg.d_key, cfg.n_heads * cfg.d_val
            self.write_norm_w = _ones_param(d)
            self.write_W_k_k = _zeros_param(d, hk)
            self.write_W_k_b = _zeros_param(hk)
            self.write_W_v_k = _zeros_param(d, hv)
            self.write_W_beta_k = _zeros_param(d, H)
            self.write_W_a_k = _zeros_param(d, H)
            self.write_A_log = _zeros_param(H)
            self.write_dt_bias = _zeros_param(H)
        self.layers = nn.ModuleList(PredictLayer(cfg) for _ in range(cfg.n_layers))
        self._backends: dict[tuple, Backend] = {}
        if initialise:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """The paper's initialisers (docs/model.md, "Initialisers"), drawn from torch's global RNG."""
        nn.init.normal_(self.embedding, 0.0, 0.02)
        nn.init.ones_(self.decode_norm_w)
        lecun_normal_(self.decode_proj_k)
        if self.decode_bias is not None:
            nn.init.zeros_(self.decode_bias)
        nn.init.ones_(self.fuse_norm_w)
        lecun_normal_(self.fuse_proj_k)
        nn.init.ones_(self.fg_norm_w)
        nn.init.zeros_(self.fg_gate_k)
        nn.init.zeros_(self.fg_gate_b)
        if self.config.memory:
            nn.init.ones_(self.write_norm_w)
            for w in (self.write_W_k_k, self.write_W_v_k, self.write_W_beta_k, self.write_W_a_k):
                lecun_normal_(w)
            nn.init.zeros_(self.write_W_k_b)
            a = torch.empty_like(self.write_A_log).uniform_(0.0, 16.0)
            self.write_A_log.copy_(torch.log(a.clamp_min(1e-8)))
            u = torch.empty_like(self.write_dt_bias).uniform_(math.log(1e-3), math.log(1e-1))
            dt = torch.exp(u).clamp_min(1e-4)
            self.write_dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        for layer in self.layers:
            layer.reset_parameters()

    # ---- the recurrent core ------------------------------------------------------------------

    def backend(self, device_type: str) -> Backend:
        """The fused core's kernels on a device type, chosen once per device the model runs on
        (it is built on CPU and moved) and per `kernel` / `cuda_graphs` setting."""
        key = (device_type, self.config.kernel, self.config.cuda_graphs)
        chosen = self._backends.get(key)
        if chosen is None:
            chosen = self._backends[key] = kernels.backend(self.config.kernel, device_type, self.config.cuda_graphs)
        return chosen

    def initial_state(self, batch: int, device=None) -> GPNState:
        cfg = self.config
        device = device or self.embedding.device
        dtype = torch.promote_types(self.embedding.dtype, torch.float32)  # the state is never low precision
        zeros = torch.zeros(batch, cfg.d_state, device=device, dtype=dtype)
        M = torch.zeros(batch, cfg.n_heads, cfg.d_key, cfg.d_val, device=device, dtype=dtype) if cfg.memory else None
        return GPNState(zeros, zeros.clone(), M)

    def _write(self, g_prev: torch.Tensor, g: torch.Tensor, M: torch.Tensor, hooks: StepHooks | None = None):
        """One memory write: the key from the previous grounded state, the value from the current."""
        B, H = g.shape[0], self.config.n_heads
        a_prev, a = rms_norm(g_prev, self.write_norm_w), rms_norm(g, self.write_norm_w)
        k = l2_normalize(torch.relu(a_prev @ self.write_W_k_k + self.write_W_k_b).view(B, H, -1))
        v = (a @ self.write_W_v_k).view(B, H, -1)
        beta = torch.sigmoid(a @ self.write_W_beta_k)
        dt = nn.functional.softplus(at_least_f32(a @ self.write_W_a_k) + at_least_f32(self.write_dt_bias))
        gamma = -torch.exp(at_least_f32(self.write_A_log)) * dt
        if hooks is not None:
            hooks.decay(gamma)
        return write_memory(M, k, v, beta, gamma)

    def _run_steps(self, u: torch.Tensor, state: GPNState, t0: int, hooks: StepHooks | None = None):
        """Steps t0 .. t0+len(u)-1 of the loop. u: (B, T, d) input projections. Returns s^p (B, T, d)."""
        g, g_prev, M = state
        bptt = self.config.bptt
        predictions = []
        for i in range(u.shape[1]):
            if bptt and i + t0 > 0 and (i + t0) % bptt == 0:
                g, g_prev, M = GPNState(g, g_prev, M).detach()
            if M is not None:
                M = self._write(g_prev, g, M, hooks)
            c = g
            for layer in self.layers:
                c = layer(c, M, hooks)
            if hooks is not None:
                c = hooks.prediction(c)
            predictions.append(c)
            g_prev, g = g, _gate(c, self.fg_norm_w, self.fg_gate_k, self.fg_gate_b) * c + u[:, i].to(g.dtype)
        return torch.stack(predictions, 1), GPNState(g, g_prev, M)

    def _recurrence(self, u, state: GPNState, core: str, hooks: StepHooks | None, graphs: bool = True,
                    fused=None) -> tuple[torch.Tensor, GPNState]:
        if hooks is not None:  # hooks must see every step exactly once: no fused core, no recomputation
            return self._run_steps(u, state, 0, hooks)
        if core == "fused":
            predictions, state = fused_recurrence(self, u, state, graphs, fused)
            return predictions, GPNState(*state)
        seg = self.config.recompute_every
        if not seg or not torch.is_grad_enabled():
            return self._run_steps(u, state, 0)
        outs = []
        for t0 in range(0, u.shape[1], seg):
            out, state = checkpoint(self._run_steps, u[:, t0 : t0 + seg], state, t0, use_reentrant=False)
            outs.append(out)
        return torch.cat(outs, 1), GPNState(*state)

    def _resetting_recurrence(self, u, state: GPNState, core: str, hooks, resets: torch.Tensor):
        if not resets.any():  # nothing to reset: the whole window in one run of the loop, graphs included
            return self._recurrence(u, state, core, hooks)
        empty, outs = self.initial_state(u.shape[0], u.device), []
        cut = pieces(resets, self.config.bptt)
        # Each piece's backward reads what its forward saved; a captured graph keeps that in its own
        # memory, which the next piece of the same length would overwrite: several pieces run eagerly,
        # from fused weights made once, not per piece.
        graphs, fused = len(cut) == 1, None
        if core == "fused" and hooks is None and not graphs:
            with torch.autocast(u.device.type, enabled=False):
                fused = fuse_weights(self)
        for piece in cut:
            out, state = self._recurrence(u[:, piece.start : piece.stop], state, core, hooks, graphs, fused)
            outs.append(out)
            if piece.cut:
                state = state.detach()
            if piece.reset is not None:
                state = where_rows(piece.reset, empty, state)
        return torch.cat(outs, 1), state

    # ---- the whole model ---------------------------------------------------------------------

    def decode_hidden(self, predictions: torch.Tensor) -> torch.Tensor:
        """rms(s^p) @ decode_proj_k [+ decode_bias]: the E-dim vector whose dot with emb gives logits."""
        h = rms_norm_rows(predictions, self.decode_norm_w) @ self.decode_proj_k
        return h if self.decode_bias is None else h + self.decode_bias

    def forward(
        self,
        tokens: torch.Tensor,
        state: GPNState | None = None,
        return_logits: bool = False,
        core: str | None = None,
        hooks: StepHooks | None = None,
        resets: torch.Tensor | None = None,
    ) -> ModelOutput:
        """Loss (and state, logits) of a window. `core` overrides `config.core` for this call;
        `hooks` observe or change the loop's steps (and imply the naive core); `resets` (B, T) bool:
        the state after these positions is the empty one (documents' ends: models/resets.py)."""
        core = core or self.config.core
        if core not in CORES:
            raise ValueError(f"core: expected one of {CORES}, got {core!r}")
        if tokens.dim() != 2:
            raise ValueError(f"tokens: expected a (batch, time) tensor, got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        state = self.initial_state(B, tokens.device) if state is None else GPNState(*state)
        u = rms_norm_rows(self.embedding[tokens], self.fuse_norm_w) @ self.fuse_proj_k
        if resets is None:
            predictions, state = self._recurrence(u, state, core, hooks)
        else:
            resets_check(resets, tokens)
            predictions, state = self._resetting_recurrence(u, state, core, hooks, resets)
        h = self.decode_hidden(predictions).reshape(B * T, -1)
        # the fused core's kernels compute the cross-entropy too; the naive core, the reference, the twin's
        ce_ops = self.backend(h.device.type).step if core == "fused" else ce_twin
        token_losses = linear_cross_entropy(h, self.embedding, tokens.reshape(-1), self.config.ce_chunk, ce_ops)
        logits = at_least_f32(h @ self.embedding.T).view(B, T, -1) if return_logits else None
        token_losses = token_losses.view(B, T)
        return ModelOutput(token_losses.mean(), token_losses, state, logits)


def _zero3_external_params(model: GPN) -> list[nn.Parameter]:
    """Every layer's: the fused recurrent core reads them inside the model's own forward, not
    through the layers' forward."""
    return [p for module in model.modules() if module is not model for p in module.parameters(recurse=False)]


SPEC = ModelSpec(GPNConfig, GPN, _zero3_external_params, matrices_decay)
