"""GPN and GPN+M for Hugging Face transformers: configuration, causal LM and generation.

Written by `gpn-scale export --to hf` beside `config.json` and `model.safetensors`; loaded with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`. Self-contained: plain PyTorch
and transformers, nothing of gpn-scale. Parameter names, shapes and the `in x out` layout
(`y = x @ W`) are gpn-scale's native ones.

Per token x_t the model predicts the next state from the grounded one, then grounds the prediction
with the token it sees:

    M_t      = exp(gamma) M_{t-1} + beta k (v - M_{t-1}^T k)^T   (GPN+M: key from g_{t-1}, value from g_t)
    c_t      = Predict(g_t, M_t)                                  (gated residual + SwiGLU FFN + memory read)
    p(x_t)   = softmax(emb @ Decode(c_t))                          (tied embedding)
    g_{t+1}  = sigmoid(rms(c_t) @ fg_gate_k + fg_gate_b) * c_t + rms(emb[x_t]) @ fuse_proj_k

transformers' logits at position t are the distribution of the token after x_t, so this module
carries the step shifted by half: its state after x_t is (c_{t+1}, g_{t+1}, M_{t+1}), the
prediction for the next token already made. Each token then costs exactly one step, and
`generate()` feeds one new token per decoding step with that fixed-size state as its cache (the
`state` of RWKV-style models): memory per token is constant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

RMS_EPS = 1e-6
L2_EPS = 1e-12


class GPNConfig(PretrainedConfig):
    model_type = "gpn"

    def __init__(self, family="gpn_m", vocab_size=32000, d_state=2496, d_emb=768, d_ffn=6656, n_layers=1,
                 n_heads=15, d_key=128, d_val=256, use_decoder_bias=False, **kwargs):
        if family not in ("gpn", "gpn_m"):
            raise ValueError(f"family: expected 'gpn' or 'gpn_m', got {family!r}")
        self.family, self.vocab_size, self.d_state, self.d_emb, self.d_ffn = family, vocab_size, d_state, d_emb, d_ffn
        self.n_layers, self.n_heads, self.d_key, self.d_val = n_layers, n_heads, d_key, d_val
        self.use_decoder_bias = use_decoder_bias
        kwargs.setdefault("tie_word_embeddings", False)  # the decoder reads `embedding` itself: nothing to tie
        super().__init__(**kwargs)

    @property
    def memory(self) -> bool:
        return self.family == "gpn_m"

    @property
    def hidden_size(self) -> int:
        return self.d_state


def at_least_f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean(x^2) + 1e-6) * w, computed in float32 and cast back to x's dtype."""
    xf = at_least_f32(x)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS) * weight.to(xf.dtype)).to(x.dtype)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    xf = at_least_f32(x)
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + L2_EPS)


def gate(x, norm_w, kernel, bias):
    return torch.sigmoid(rms_norm(x, norm_w) @ kernel + bias)


def _param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape))


class PredictLayer(nn.Module):
    """c <- Gate(c) * c + FFN(c) [+ gated read of the memory]."""

    def __init__(self, cfg: GPNConfig):
        super().__init__()
        d, f = cfg.d_state, cfg.d_ffn
        self.ffn_norm_w, self.ffn_w1_k, self.ffn_w2_k = _param(d), _param(d, 2 * f), _param(f, d)
        self.pg_norm_w, self.pg_gate_k, self.pg_gate_b = _param(d), _param(d, d), _param(d)
        self.memory, self.n_heads = cfg.memory, cfg.n_heads
        if cfg.memory:
            hk, hv = cfg.n_heads * cfg.d_key, cfg.n_heads * cfg.d_val
            self.read_norm_w, self.read_W_q_k, self.read_W_q_b = _param(d), _param(d, hk), _param(hk)
            self.read_W_gate_k, self.read_out_norm_w, self.read_W_o_k = _param(d, hv), _param(hv), _param(hv, d)

    def forward(self, c: torch.Tensor, M: torch.Tensor | None) -> torch.Tensor:
        g, u = (rms_norm(c, self.ffn_norm_w) @ self.ffn_w1_k).chunk(2, dim=-1)
        update = (F.silu(g) * u) @ self.ffn_w2_k
        if self.memory:
            B = c.shape[0]
            r = rms_norm(c, self.read_norm_w)
            q = l2_normalize(torch.relu(r @ self.read_W_q_k + self.read_W_q_b).view(B, self.n_heads, -1))
            o = rms_norm(torch.einsum("bhkv,bhk->bhv", M, q.to(M.dtype)).reshape(B, -1), self.read_out_norm_w)
            update = update + (F.silu(r @ self.read_W_gate_k) * o.to(c.dtype)) @ self.read_W_o_k
        return gate(c, self.pg_norm_w, self.pg_gate_k, self.pg_gate_b) * c + update


@dataclass
class GPNCausalLMOutput(ModelOutput):
    """logits (B, T, V): position t scores the token after input t. state: the cache, (c, g, M) for
    GPN+M or (c, g) for GPN, float32: the prediction for the next token, the grounded state, the memory."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    state: tuple[torch.FloatTensor, ...] | None = None


class GPNPreTrainedModel(PreTrainedModel):
    config_class = GPNConfig
    base_model_prefix = "gpn"
    _is_stateful = True  # the cache is the recurrent state, passed as `state`: no KV cache to prepare
    _no_split_modules = ["PredictLayer"]

    def _init_weights(self, module):
        """Weights come from the exported checkpoint; training from scratch is gpn-scale's job."""


class GPNForCausalLM(GPNPreTrainedModel, GenerationMixin):
    def __init__(self, config: GPNConfig):
        super().__init__(config)
        d, E, V = config.d_state, config.d_emb, config.vocab_size
        self.embedding = _param(V, E)
        self.decode_norm_w, self.decode_proj_k = _param(d), _param(d, E)
        self.decode_bias = _param(E) if config.use_decoder_bias else None
        self.fuse_norm_w, self.fuse_proj_k = _param(E), _param(E, d)
        self.fg_norm_w, self.fg_gate_k, self.fg_gate_b = _param(d), _param(d, d), _param(d)
        if config.memory:
            H, hk, hv = config.n_heads, config.n_heads * config.d_key, config.n_heads * config.d_val
            self.write_norm_w, self.write_W_k_k, self.write_W_k_b = _param(d), _param(d, hk), _param(hk)
            self.write_W_v_k, self.write_W_beta_k, self.write_W_a_k = _param(d, hv), _param(d, H), _param(d, H)
            self.write_A_log, self.write_dt_bias = _param(H), _param(H)
        self.layers = nn.ModuleList(PredictLayer(config) for _ in range(config.n_layers))
        self.post_init()

    # ---- the recurrence -----------------------------------------------------------------------

    def _write(self, g_prev: torch.Tensor, g: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        """Gated delta rule, per head: M <- exp(gamma) M + beta k (v - M^T k)^T, in float32."""
        B, H = g.shape[0], self.config.n_heads
        a_prev, a = rms_norm(g_prev, self.write_norm_w), rms_norm(g, self.write_norm_w)
        k = l2_normalize(torch.relu(a_prev @ self.write_W_k_k + self.write_W_k_b).view(B, H, -1)).to(M.dtype)
        v = (a @ self.write_W_v_k).view(B, H, -1).to(M.dtype)
        beta = torch.sigmoid(a @ self.write_W_beta_k).to(M.dtype)
        dt = F.softplus(at_least_f32(a @ self.write_W_a_k) + at_least_f32(self.write_dt_bias))
        gamma = -torch.exp(at_least_f32(self.write_A_log)) * dt
        delta = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", M, k))
        return torch.exp(gamma)[..., None, None] * M + k[..., :, None] * delta[..., None, :]

    def _predict(self, g_prev, g, M):
        """Half a step: the memory write for g, then the prediction c from it. Returns (c, M)."""
        if M is not None:
            M = self._write(g_prev, g, M)
        c = g
        for layer in self.layers:
            c = layer(c, M)
        return c, M

    def initial_state(self, batch: int) -> tuple[torch.Tensor, ...]:
        """The state before any token: the prediction from the empty state already made."""
        cfg, p = self.config, self.embedding
        dtype = torch.promote_types(p.dtype, torch.float32)  # the state is never low precision
        zeros = torch.zeros(batch, cfg.d_state, device=p.device, dtype=dtype)
        M = torch.zeros(batch, cfg.n_heads, cfg.d_key, cfg.d_val, device=p.device, dtype=dtype) if cfg.memory else None
        c, M = self._predict(zeros, zeros, M)
        return (c, zeros) if M is None else (c, zeros, M)

    def decode(self, c: torch.Tensor) -> torch.Tensor:
        h = rms_norm(c, self.decode_norm_w) @ self.decode_proj_k
        if self.decode_bias is not None:
            h = h + self.decode_bias
        return at_least_f32(h @ self.embedding.T)

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                state: tuple[torch.Tensor, ...] | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, return_dict: bool | None = None, **kwargs) -> GPNCausalLMOutput:
        """Scores and state after `input_ids` (B, T), continuing from `state` when given. Positions whose
        `attention_mask` is 0 (left padding) leave the state untouched, so a padded row equals its
        unpadded self."""
        B, T = input_ids.shape
        state = self.initial_state(B) if state is None else tuple(state)
        c, g, M = state if len(state) == 3 else (*state, None)
        mask = None
        if attention_mask is not None and not bool(attention_mask[:, -T:].all()):
            mask = attention_mask[:, -T:].bool()
        u = rms_norm(self.embedding[input_ids], self.fuse_norm_w) @ self.fuse_proj_k  # all inputs at once
        predictions = []
        for t in range(T):
            g_next = gate(c, self.fg_norm_w, self.fg_gate_k, self.fg_gate_b) * c + u[:, t].to(g.dtype)
            c_next, M_next = self._predict(g, g_next, M)
            if mask is not None:
                keep = mask[:, t]
                c_next, g_next = torch.where(keep[:, None], c_next, c), torch.where(keep[:, None], g_next, g)
                M_next = None if M is None else torch.where(keep[:, None, None, None], M_next, M)
            c, g, M = c_next, g_next, M_next
            predictions.append(c)
        logits = self.decode(torch.stack(predictions, 1))
        loss = None
        if labels is not None:  # labels are the inputs: position t is scored against token t + 1
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        new_state = (c, g) if M is None else (c, g, M)
        return GPNCausalLMOutput(loss=loss, logits=logits, state=new_state if use_cache is not False else None)

    def generate(self, *args, **kwargs):
        config = kwargs.get("generation_config") or self.generation_config
        if (kwargs.get("num_beams") or config.num_beams or 1) > 1:
            # transformers' beam search reorders `past_key_values` only: this model's cache would not follow
            raise ValueError("beam search is not supported: the cache is the recurrent `state`, which beam search "
                             "does not reorder; use greedy decoding or sampling")
        return super().generate(*args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, state=None, attention_mask=None, use_cache=None, **kwargs):
        # With a state, everything before the newest token is already in it: feed that token alone.
        if state is not None:
            input_ids = input_ids[:, -1:]
        return {"input_ids": input_ids, "state": state, "attention_mask": attention_mask, "use_cache": use_cache}

