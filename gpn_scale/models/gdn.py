"""Gated DeltaNet (Yang, Kautz and Hatamizadeh, 2024): the paper's linear-recurrent baseline.

Pre-norm blocks, each a gated delta rule mixer and a SwiGLU MLP. Per layer and head:

    q, k, v  = silu(causal depthwise conv(x W_q | x W_k | x W_v))       kernel `conv_size`
    q, k     = l2norm(q) / sqrt(d_key), l2norm(k)
    beta_t   = sigmoid(x W_b)                                            write strength
    g_t      = -exp(A_log) * softplus(x W_a + dt_bias)                   log decay (Mamba2's gate)
    S_t      = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T    S: d_key x d_val
    o_t      = S_t^T q_t
    out      = (rms(o_t) * silu(x W_g)) W_o                              per-head norm, output gate

The delta rule runs in float32 whatever autocast says (like GPN's memory). Two pure-torch forms
compute it: `recurrent` (token by token, the definition) and `chunk` (the WY/UT form: within a
chunk of `chunk_size` tokens the updates are one triangular solve and a few matmuls, between
chunks S is carried), tested equal. With `kernel: auto` on CUDA, flash-linear-attention's
`chunk_gated_delta_rule` replaces the torch chunk form when the `fla` package is importable.

Token alignment and the loss are GPN's (see `blocks.py`). A state is the window's last token and
every layer's conv buffer (the last conv_size - 1 pre-conv inputs) and S: passing it back
continues the stream exactly.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, fields
from typing import ClassVar, Literal, NamedTuple, get_args

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpn_scale.models.blocks import (Block, RMSNorm, check_tokens, compile_blocks, init_weights, shifted_inputs,
                                     tied_lm_loss)
from gpn_scale.models.gpn import ModelOutput
from gpn_scale.models.ops import at_least_f32, l2_normalize, rms_norm
from gpn_scale.models.resets import check as check_resets, pieces, where_rows
from gpn_scale.models.model_spec import ModelSpec, matrices_decay, no_external_params

# The enumerated keys of GDNConfig: a config's value is checked against these, and its refusal lists them.
Core = Literal["chunk", "recurrent"]
Kernel = Literal["auto", "torch"]
CORES, KERNELS = get_args(Core), get_args(Kernel)


@dataclass
class GDNConfig:
    family: Literal["gdn"] = "gdn"  # Gated DeltaNet: delta-rule linear attention and SwiGLU, pre-norm
    vocab_size: int = 32000  # the tied embedding's rows: at least the tokenizer's vocabulary
    d_model: int = 768  # the residual stream's width
    n_layers: int = 10  # blocks of gated delta-rule mixing and SwiGLU
    n_heads: int = 6  # delta-rule heads, each with a d_key x d_val state
    d_key: int = 160  # per head; 6 x 160 puts 10 x 768 at GPN+M 1L's parameter count
    d_val: int = 320  # per head (2 x d_key, the published expansion)
    d_ffn: int = 2048  # SwiGLU width (8/3 x d_model)
    conv_size: int = 4  # the causal depthwise convolution's width over q, k and v
    # Execution only: none of these change the math.
    core: Core = "chunk"  # the torch delta-rule form: "chunk" or "recurrent"
    chunk_size: int = 64  # chunk core: tokens per chunk, whose updates are one triangular solve
    kernel: Kernel = "auto"  # "auto": flash-linear-attention's chunk kernel on CUDA when installed; "torch"
    ce_chunk: int = 8192  # rows of the decoder + cross-entropy computed at once
    compile: bool = False  # `gpn-scale train` runs each block through torch.compile (docs/baselines.md)
    recompute: bool = False  # each block's activations are recomputed in the backward instead of kept
    EXECUTION_KEYS: ClassVar[tuple[str, ...]] = ("core", "chunk_size", "kernel", "ce_chunk", "compile",
                                                 "recompute")  # may change when a run resumes

    def __post_init__(self):
        if self.family != "gdn":
            raise ValueError(f"family: expected 'gdn', got {self.family!r}")
        if self.core not in CORES:
            raise ValueError(f"core: expected one of {CORES}, got {self.core!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel: expected one of {KERNELS}, got {self.kernel!r}")
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "d_key", "d_val", "d_ffn", "conv_size",
                    "chunk_size", "ce_chunk")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


class GDNState(NamedTuple):
    """last_token: (B,) the token the next window reads at its position 0 (-1: none, the empty
    context's `start`, as after a reset).
    layers: per layer (conv buffer (B, channels, conv_size - 1), S (B, n_heads, d_key, d_val)), both
    float32 whatever autocast computes in (float64 in a float64 model)."""

    last_token: torch.Tensor
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    def detach(self) -> "GDNState":
        return GDNState(self.last_token, tuple((c.detach(), S.detach()) for c, S in self.layers))


# ---- the gated delta rule: q, k (B, T, H, K), v (B, T, H, V), g, beta (B, T, H), S (B, H, K, V) -----------


def recurrent_gated_delta_rule(q, k, v, g, beta, S):
    """The definition, one token at a time. Returns o (B, T, H, V) and the final S."""
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1), S


def chunk_gated_delta_rule(q, k, v, g, beta, S, chunk: int):
    """The same recurrence in chunks of `chunk` tokens (the WY/UT form).

    Inside a chunk with cumulative log decay G_i, the values actually written are
    u_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_{j<i} exp(G_i - G_j) (k_i . k_j) u_j), i.e.
    (I + A) U = beta V - (beta K exp(G)) S0 with A strictly lower triangular: one unit-triangular
    solve gives both right-hand sides. Then o_i = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i - G_j)
    (q_i . k_j) u_j and S_C = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T. Only exp of
    non-positive numbers is taken, so nothing overflows. A ragged tail is padded with k = v = 0,
    beta = g = 0, which leaves S unchanged.
    """
    B, T, H, K = q.shape
    pad = (-T) % chunk
    if pad:
        q, k, v, g, beta = (F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) for x in (q, k, v, g, beta))
    n = (T + pad) // chunk

    def blocks(x):  # (B, n*C, H, ...) -> (B, H, n, C, ...)
        x = x.reshape(B, n, chunk, H, *x.shape[3:])
        return x.permute(0, 3, 1, 2, *range(4, x.dim()))

    q, k, v, g, beta = map(blocks, (q, k, v, g, beta))
    G = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, -math.inf).exp()  # exp(G_i - G_j), j <= i
    kb = k * beta[..., None]
    A = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    rhs = torch.cat([v * beta[..., None], kb * G.exp()[..., None]], -1)
    u, w = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True).split([v.shape[-1], K], -1)
    qk = (q @ k.transpose(-1, -2)) * decay
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    outs = []
    for c in range(n):
        U = u[:, :, c] - w[:, :, c] @ S
        outs.append((q[:, :, c] * G[:, :, c, :, None].exp()) @ S + qk[:, :, c] @ U)
        S = S * G[:, :, c, -1, None, None].exp() + k_to_end[:, :, c].transpose(-1, -2) @ U
    o = torch.stack(outs, 2).permute(0, 2, 3, 1, 4).reshape(B, n * chunk, H, -1)
    return o[:, :T], S


@functools.lru_cache(maxsize=1)
def _fla_chunk_kernel():
    """flash-linear-attention's chunk kernel, or None where the package is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as kernel
    except ImportError:
        return None
    return kernel


# ---- the model ---------------------------------------------------------------------------------------------


class GatedDeltaMixer(nn.Module):
    def __init__(self, cfg: GDNConfig):
        super().__init__()
        d, H = cfg.d_model, cfg.n_heads
        self.cfg = cfg
        self.key_dim, self.val_dim = H * cfg.d_key, H * cfg.d_val
        self.q_proj = nn.Linear(d, self.key_dim, bias=False)
        self.k_proj = nn.Linear(d, self.key_dim, bias=False)
        self.v_proj = nn.Linear(d, self.val_dim, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)
        self.a_proj = nn.Linear(d, H, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H))
        # One depthwise conv over [q | k | v]: the same as three separate depthwise convs.
        self.conv_weight = nn.Parameter(torch.empty(2 * self.key_dim + self.val_dim, cfg.conv_size))
        self.g_proj = nn.Linear(d, self.val_dim, bias=False)
        self.o_norm_w = nn.Parameter(torch.empty(cfg.d_val))  # shared by the heads
        self.o_proj = nn.Linear(self.val_dim, d, bias=False)

    @torch.no_grad()
    def reset_parameters(self):
        """The published initialisers for what `init_weights` leaves: A uniform in [1, 16]; dt log-uniform
        in [1e-3, 1e-1] stored as its inverse softplus (Mamba2); the conv as torch's Conv1d default."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        bound = 1.0 / math.sqrt(self.cfg.conv_size)  # kaiming_uniform(a=sqrt(5)) of a depthwise Conv1d
        self.conv_weight.uniform_(-bound, bound)
        nn.init.ones_(self.o_norm_w)

    def initial_state(self, batch: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        dtype = torch.promote_types(x.dtype, torch.float32)  # the state is float32 whatever autocast computes in
        conv = torch.zeros(batch, self.conv_weight.shape[0], cfg.conv_size - 1, device=x.device, dtype=dtype)
        S = torch.zeros(batch, cfg.n_heads, cfg.d_key, cfg.d_val, device=x.device, dtype=dtype)
        return conv, S

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None):
        cfg = self.cfg
        B, T, _ = x.shape
        H = cfg.n_heads
        conv_buf, S = self.initial_state(B, x) if cache is None else cache
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1).transpose(1, 2)  # (B, C, T)
        qkv = torch.cat([conv_buf.to(qkv.dtype), qkv], -1)
        # kept in float32 (exactly the values read: under bf16 they are bf16 numbers), like S
        conv_buf = at_least_f32(qkv[..., qkv.shape[-1] - (cfg.conv_size - 1):])
        qkv = F.silu(F.conv1d(qkv, self.conv_weight[:, None, :].to(qkv.dtype), groups=qkv.shape[1]))
        q, k, v = qkv.transpose(1, 2).split([self.key_dim, self.key_dim, self.val_dim], -1)
        q = l2_normalize(q.reshape(B, T, H, -1)) * cfg.d_key**-0.5
        k = l2_normalize(k.reshape(B, T, H, -1))
        v = at_least_f32(v.reshape(B, T, H, -1))
        beta = torch.sigmoid(at_least_f32(self.b_proj(x)))
        g = -self.A_log.exp() * F.softplus(at_least_f32(self.a_proj(x)) + self.dt_bias)
        with torch.autocast(x.device.type, enabled=False):
            o, S = self._delta_rule(q, k, v, g, beta, S)
        gate = F.silu(self.g_proj(x))
        o = rms_norm(o, self.o_norm_w).reshape(B, T, -1).to(gate.dtype) * gate
        return self.o_proj(o), (conv_buf, S)

    def _delta_rule(self, q, k, v, g, beta, S):
        kernel = _fla_chunk_kernel() if self.cfg.kernel == "auto" and q.is_cuda else None
        if kernel is not None:  # q is already scaled; fla wants S as (B, H, K, V) float32, like ours
            return kernel(q, k, v, g, beta, scale=1.0, initial_state=S, output_final_state=True)
        if self.cfg.core == "recurrent" or q.shape[1] == 1:  # one token (decoding): the chunk form would pad it to a chunk
            return recurrent_gated_delta_rule(q, k, v, g, beta, S)
        return chunk_gated_delta_rule(q, k, v, g, beta, S, self.cfg.chunk_size)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: GDNConfig, initialise: bool = True):
        super().__init__()
        self.config = cfg
        self.embedding = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        self.start = nn.Parameter(torch.empty(cfg.d_model))  # the empty context, read at position 0
        self.layers = nn.ModuleList(Block(cfg.d_model, cfg.d_ffn, GatedDeltaMixer(cfg), cfg.recompute) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        if initialise:
            self.reset_parameters()

    def reset_parameters(self):
        init_weights(self, self.config.n_layers, residual_out=("o_proj", "down_proj"))
        for layer in self.layers:
            layer.mixer.reset_parameters()

    def forward(self, tokens: torch.Tensor, state: GDNState | None = None, return_logits: bool = False,
                resets: torch.Tensor | None = None) -> ModelOutput:
        """`resets` (B, T) bool: the state after these positions is the empty one (models/resets.py)."""
        B, T = check_tokens(tokens)
        if state is not None:
            state = GDNState(*state)
            if len(state.layers) != len(self.layers):
                raise ValueError(f"state: expected {len(self.layers)} layers, got {len(state.layers)}")
        if resets is None:
            x, state = self._layers(tokens, state)
        else:  # the layers over each piece between documents' ends (models/resets.py)
            check_resets(resets, tokens)
            empty, xs = self.initial_state(B, tokens.device), []
            state = empty if state is None else state
            for piece in pieces(resets):
                x, state = self._layers(tokens[:, piece.start : piece.stop], state)
                xs.append(x)
                if piece.reset is not None:
                    state = where_rows(piece.reset, empty, state)
            x = torch.cat(xs, 1)
        loss, token_losses, logits = tied_lm_loss(self.norm(x), self.embedding, tokens, self.config.ce_chunk,
                                                  return_logits)
        return ModelOutput(loss, token_losses, state, logits)

    def _layers(self, tokens: torch.Tensor, state: GDNState | None) -> tuple[torch.Tensor, GDNState]:
        x = shifted_inputs(self.embedding, self.start, tokens, None if state is None else state.last_token)
        caches = []
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, None if state is None else state.layers[i])
            caches.append(cache)
        return x, GDNState(tokens[:, -1], tuple(caches))

    def initial_state(self, batch: int, device=None) -> GDNState:
        """The empty state, as a tensor nest: what `state=None` means."""
        like = self.embedding.new_empty(0, device=device)
        return GDNState(torch.full((batch,), -1, dtype=torch.long, device=like.device),
                        tuple(layer.mixer.initial_state(batch, like) for layer in self.layers))


SPEC = ModelSpec(GDNConfig, GatedDeltaNet, no_external_params, matrices_decay, compile_forward=compile_blocks)
