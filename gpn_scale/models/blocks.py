"""Pieces the layered baselines (Transformer++, Gated DeltaNet) share: RMSNorm, the SwiGLU MLP,
the pre-norm residual block, the empty-context input shift and the tied-embedding loss.

Token alignment is GPN's: a window of T tokens gives T predictions, position t predicting token t
from the tokens before it, the first one from an empty context. A layered model reads its inputs
shifted right by one: position 0 reads a learned `start` vector (the empty context; it is not a
token and never appears in a window), position t > 0 reads the embedding of token t-1. A state
carried to the next window holds the window's last token, which the next window reads at its
position 0 instead of `start` (or `start` again, where a reset put -1: models/resets.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gpn_scale.models.ops import at_least_f32, linear_cross_entropy, rms_norm

INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, d_model: int, d_ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ffn, bias=False)
        self.up_proj = nn.Linear(d_model, d_ffn, bias=False)
        self.down_proj = nn.Linear(d_ffn, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x)).

    The mixer (attention or the gated delta rule) takes and returns a per-layer cache, or None.
    With `recompute`, a forward that records gradients keeps only the block's input: the backward
    runs the block again for the activations it needs (the config key `recompute`).
    """

    def __init__(self, d_model: int, d_ffn: int, mixer: nn.Module, recompute: bool = False):
        super().__init__()
        self.mixer_norm = RMSNorm(d_model)
        self.mixer = mixer
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, d_ffn)
        self.recompute = recompute

    def forward(self, x: torch.Tensor, cache=None):
        if self.recompute and torch.is_grad_enabled():  # without gradients nothing is kept to save
            # Non-reentrant: the form torch.compile traces (the recomputation becomes part of the
            # compiled backward) and the one that accepts a cache of nested tensors or None.
            return checkpoint(self._residual_branches, x, cache, use_reentrant=False)
        return self._residual_branches(x, cache)

    def _residual_branches(self, x: torch.Tensor, cache):
        h, cache = self.mixer(self.mixer_norm(x), cache)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache


def compile_blocks(model: nn.Module) -> None:
    """torch.compile each of a layered model's blocks, in place (`nn.Module.compile`), as torchtitan
    compiles its TransformerBlocks: the blocks share one code path, so one compiled graph serves
    every layer whatever the depth (a deeper model compiles no longer); a block sees only tensors
    of fixed rank, while the model's own forward (state checks, GDN's document pieces, the chunked
    loss) stays eager; a recomputed block is compiled with its recomputation; and the weights keep
    their names, so a checkpoint of a compiled run loads into an eager model and back."""
    for layer in model.layers:
        layer.compile()


def init_weights(model: nn.Module, n_layers: int, residual_out: tuple[str, ...]) -> None:
    """GPT-2 style: every Linear and the embedding normal(0, 0.02); the projections that write into
    the residual stream (`residual_out` names) normal(0, 0.02 / sqrt(2 n_layers)), so the stream's
    variance stays O(1) over depth; norms are ones. Other parameters are left to their modules."""
    out_std = INIT_STD / math.sqrt(2 * n_layers)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                std = out_std if name.rsplit(".", 1)[-1] in residual_out else INIT_STD
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        nn.init.normal_(model.embedding, 0.0, INIT_STD)
        nn.init.normal_(model.start, 0.0, INIT_STD)


def shifted_inputs(embedding: torch.Tensor, start: torch.Tensor, tokens: torch.Tensor,
                   last_token: torch.Tensor | None) -> torch.Tensor:
    """(B, T, E) inputs for predicting `tokens`: [start or emb[last_token], emb[x_0], ..., emb[x_{T-2}]];
    a row whose last_token is -1 (a reset) reads start."""
    B = tokens.shape[0]
    if last_token is None:
        first = start.expand(B, 1, -1)
    else:
        none = (last_token < 0)[:, None, None]
        first = torch.where(none, start.to(embedding.dtype).expand(B, 1, -1), embedding[last_token.clamp_min(0)][:, None])
    return torch.cat([first, embedding[tokens[:, :-1]]], 1)


def check_tokens(tokens: torch.Tensor) -> tuple[int, int]:
    if tokens.dim() != 2:
        raise ValueError(f"tokens: expected a (batch, time) tensor, got shape {tuple(tokens.shape)}")
    return tokens.shape


def tied_lm_loss(h: torch.Tensor, embedding: torch.Tensor, tokens: torch.Tensor, ce_chunk: int,
                 return_logits: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(mean loss, (B, T) token losses, logits or None) of final hidden states h (B, T, E) against
    `tokens`, through the chunked cross-entropy GPN uses (no B x T x V logits held at once)."""
    B, T = tokens.shape
    flat = h.reshape(B * T, -1)
    token_losses = linear_cross_entropy(flat, embedding, tokens.reshape(-1), ce_chunk).view(B, T)
    logits = at_least_f32(flat @ embedding.T).view(B, T, -1) if return_logits else None
    return token_losses.mean(), token_losses, logits
