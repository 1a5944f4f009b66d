"""Transformer++: the paper's attention baseline.

Pre-norm RMSNorm blocks with rotary position embeddings, SwiGLU MLPs, no biases anywhere, a tied
embedding, and torch's `scaled_dot_product_attention` (flash / memory-efficient kernels where the
device has them). Token alignment and the loss are GPN's (see `blocks.py`): position 0 of a window
reads a learned `start` vector, so its prediction comes from an empty context.

A state is the last token of the window plus every layer's rotated keys and values: passing it
back continues the stream exactly as one longer window would (incremental decoding).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import ClassVar, Literal, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpn_scale.models.blocks import (Block, RMSNorm, check_tokens, compile_blocks, init_weights, shifted_inputs,
                                     tied_lm_loss)
from gpn_scale.models.gpn import ModelOutput
from gpn_scale.models.ops import at_least_f32
from gpn_scale.models.model_spec import ModelSpec, matrices_decay, no_external_params


@dataclass
class TransformerConfig:
    family: Literal["transformer"] = "transformer"  # Transformer++: RoPE attention and SwiGLU, pre-norm
    vocab_size: int = 32000  # the tied embedding's rows: at least the tokenizer's vocabulary
    d_model: int = 768  # the residual stream's width
    n_layers: int = 12  # blocks of attention and SwiGLU
    n_heads: int = 12  # attention heads of d_model / n_heads (an even number) each
    d_ffn: int = 2752  # SwiGLU width; 2752 puts 12 x 768 at GPN+M 1L's parameter count
    rope_theta: float = 10000.0  # the rotary embedding's base
    ce_chunk: int = 8192  # rows of the decoder + cross-entropy computed at once
    # Execution only (docs/baselines.md, "Compiling and recomputing"):
    compile: bool = False  # `gpn-scale train` runs each block through torch.compile
    recompute: bool = False  # each block's activations are recomputed in the backward instead of kept
    EXECUTION_KEYS: ClassVar[tuple[str, ...]] = ("ce_chunk", "compile", "recompute")  # may change when a run resumes

    def __post_init__(self):
        if self.family != "transformer":
            raise ValueError(f"family: expected 'transformer', got {self.family!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ffn", "ce_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"n_heads: d_model ({self.d_model}) / n_heads ({self.n_heads}) must be an even integer "
                             "(the rotary embedding rotates pairs)")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta: expected > 0, got {self.rope_theta}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


class TransformerState(NamedTuple):
    """last_token: (B,) the token the next window reads at its position 0.
    kv: per layer (keys, values), each (B, n_heads, past, head_dim), keys already rotated."""

    last_token: torch.Tensor
    kv: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    def detach(self) -> "TransformerState":
        return TransformerState(self.last_token, tuple((k.detach(), v.detach()) for k, v in self.kv))


def rotary(x: torch.Tensor, offset: int, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of x (B, H, T, D) for absolute positions offset .. offset+T-1, in float32
    (float64 for a float64 x)."""
    T, D = x.shape[-2], x.shape[-1]
    xf = at_least_f32(x)
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, device=x.device, dtype=xf.dtype) / D)
    angles = torch.arange(offset, offset + T, device=x.device, dtype=xf.dtype)[:, None] * inv_freq
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.theta = cfg.n_heads, cfg.rope_theta
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None):
        B, T, d = x.shape
        q, k, v = (p(x).view(B, T, self.n_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        past = 0 if cache is None else cache[0].shape[2]
        q, k = rotary(q, past, self.theta), rotary(k, past, self.theta)
        if cache is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # SDPA's is_causal aligns the mask top-left; with a cache query i sits at key past+i.
            k, v = torch.cat([cache[0].to(k.dtype), k], 2), torch.cat([cache[1].to(v.dtype), v], 2)
            visible = torch.arange(past + T, device=x.device) <= torch.arange(past, past + T, device=x.device)[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, d)), (k, v)


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig, initialise: bool = True):
        super().__init__()
        self.config = cfg
        self.embedding = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        self.start = nn.Parameter(torch.empty(cfg.d_model))  # the empty context, read at position 0
        self.layers = nn.ModuleList(Block(cfg.d_model, cfg.d_ffn, Attention(cfg), cfg.recompute) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        if initialise:
            self.reset_parameters()

    def reset_parameters(self):
        init_weights(self, self.config.n_layers, residual_out=("o_proj", "down_proj"))

    def forward(self, tokens: torch.Tensor, state: TransformerState | None = None,
                return_logits: bool = False) -> ModelOutput:
        B, T = check_tokens(tokens)
        if state is not None:
            state = TransformerState(*state)
            if len(state.kv) != len(self.layers):
                raise ValueError(f"state: expected a cache for {len(self.layers)} layers, got {len(state.kv)}")
        x = shifted_inputs(self.embedding, self.start, tokens, None if state is None else state.last_token)
        caches = []
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, None if state is None else state.kv[i])
            caches.append(cache)
        loss, token_losses, logits = tied_lm_loss(self.norm(x), self.embedding, tokens, self.config.ce_chunk,
                                                  return_logits)
        return ModelOutput(loss, token_losses, TransformerState(tokens[:, -1], tuple(caches)), logits)



SPEC = ModelSpec(TransformerConfig, Transformer, no_external_params, matrices_decay, carries_state=False,
                 compile_forward=compile_blocks)
