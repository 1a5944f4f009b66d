"""GPN and GPN+M for Hugging Face transformers: configuration, base model, causal LM, generation.

Written by `gpn-scale export --to hf` beside `config.json` and `model.safetensors`; loaded with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` in float32, bfloat16 or
float16. Self-contained: plain PyTorch and transformers, nothing of gpn-scale.

Per token x_t the model predicts the next state from the grounded one, then grounds the prediction
with the token it sees:

    M_t      = exp(gamma) M_{t-1} + beta k (v - M_{t-1}^T k)^T   (GPN+M: key from g_{t-1}, value from g_t)
    c_t      = Predict(g_t, M_t)                                  (gated residual + SwiGLU MLP + memory read)
    p(x_t)   = softmax(lm_head(decoder(c_t)))                     (lm_head tied to the input embedding)
    g_{t+1}  = sigmoid(ground_gate(c_t)) * c_t + input_proj(embed_tokens[x_t])

transformers' logits at position t are the distribution of the token after x_t, so the module
carries the step shifted by half: its state after x_t is (c_{t+1}, g_{t+1}, M_{t+1}), the
prediction for the next token already made. Each token costs exactly one step, and `generate()`
feeds one new token per decoding step with that fixed-size state as its cache (the `state` of
RWKV-style models): time and memory per token are constant.

Start of text. The model starts from its initial state: the empty state (`start_state: empty`),
or, when every training document began with BOS, the state after BOS (`start_state: bos`). The
BOS token stands for that start wherever it appears: the state after it is the initial state, so
a text scores and generates the same with or without a leading BOS, and the tokenizer adds none.

Parameters are nn.Embedding / nn.Linear modules (`y = x W^T + b`), so adapters (PEFT LoRA) and
other tools that look for them find them. The time loop multiplies by fused matrices built from
them (all projections of a layer's input in one GEMM, the norm weights folded in); a projection
that is not a plain nn.Linear (a LoRA wrapper, a quantised layer) is called as the module it is.
The state and the memory are float32 whatever the parameters' dtype; the GEMMs run in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

RMS_EPS = 1e-6
L2_EPS = 1e-12
START_STATES = ("empty", "bos")


class GPNConfig(PretrainedConfig):
    """start_state: "empty" (the model starts from the empty state) or "bos" (from the state after
    BOS: the training data began every document with it). checkpoint_segment: the time steps
    recomputed together under gradient checkpointing."""

    model_type = "gpn"
    attribute_map = {"hidden_size": "d_state", "num_hidden_layers": "n_layers"}

    def __init__(self, family="gpn_m", vocab_size=32000, d_state=2496, d_emb=768, d_ffn=6656, n_layers=1,
                 n_heads=15, d_key=128, d_val=256, use_decoder_bias=False, start_state="empty",
                 checkpoint_segment=64, tie_word_embeddings=True, **kwargs):
        if family not in ("gpn", "gpn_m"):
            raise ValueError(f"family: expected 'gpn' or 'gpn_m', got {family!r}")
        if start_state not in START_STATES:
            raise ValueError(f"start_state: expected one of {START_STATES}, got {start_state!r}")
        self.family, self.vocab_size, self.d_state, self.d_emb, self.d_ffn = family, vocab_size, d_state, d_emb, d_ffn
        self.n_layers, self.n_heads, self.d_key, self.d_val = n_layers, n_heads, d_key, d_val
        self.use_decoder_bias, self.start_state, self.checkpoint_segment = use_decoder_bias, start_state, checkpoint_segment
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        if start_state == "bos" and self.bos_token_id is None:
            raise ValueError("start_state 'bos' needs bos_token_id")

    @property
    def memory(self) -> bool:
        return self.family == "gpn_m"


# ---- modules: the parameters ----------------------------------------------------------------


class GPNRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + 1e-6) * weight, computed in float32, returned in x's dtype."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        return (F.rms_norm(xf, (xf.shape[-1],), eps=RMS_EPS) * self.weight.to(xf.dtype)).to(x.dtype)


class GPNMemoryWrite(nn.Module):
    """The gated delta rule's write, once per token: the key from the previous grounded state, the
    value, the write strength beta and the decay exp(-exp(A_log) softplus(decay_proj(.))) from the current one."""

    def __init__(self, cfg: GPNConfig):
        super().__init__()
        d, H = cfg.d_state, cfg.n_heads
        self.norm = GPNRMSNorm(d)
        self.key_proj = nn.Linear(d, H * cfg.d_key)
        self.value_proj = nn.Linear(d, H * cfg.d_val, bias=False)
        self.beta_proj = nn.Linear(d, H, bias=False)
        self.decay_proj = nn.Linear(d, H)  # its bias is the decay's dt bias
        self.A_log = nn.Parameter(torch.zeros(H))


class GPNMemoryRead(nn.Module):
    """One layer's read of the memory: a query per head, the read normalised and gated."""

    def __init__(self, cfg: GPNConfig):
        super().__init__()
        d, hk, hv = cfg.d_state, cfg.n_heads * cfg.d_key, cfg.n_heads * cfg.d_val
        self.norm = GPNRMSNorm(d)
        self.query_proj = nn.Linear(d, hk)
        self.out_gate_proj = nn.Linear(d, hv, bias=False)
        self.out_norm = GPNRMSNorm(hv)
        self.out_proj = nn.Linear(hv, d, bias=False)


class GPNMLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, cfg: GPNConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_state, cfg.d_ffn, bias=False)
        self.up_proj = nn.Linear(cfg.d_state, cfg.d_ffn, bias=False)
        self.down_proj = nn.Linear(cfg.d_ffn, cfg.d_state, bias=False)


class GPNPredictLayer(nn.Module):
    """c <- sigmoid(residual_gate(c)) * c + mlp(c) [+ memory_read(c)], each with its own norm."""

    def __init__(self, cfg: GPNConfig):
        super().__init__()
        self.residual_norm = GPNRMSNorm(cfg.d_state)
        self.residual_gate = nn.Linear(cfg.d_state, cfg.d_state)
        self.mlp_norm = GPNRMSNorm(cfg.d_state)
        self.mlp = GPNMLP(cfg)
        self.memory_read = GPNMemoryRead(cfg) if cfg.memory else None


# ---- the maps the time loop multiplies by ----------------------------------------------------


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _weight_dtype(module: nn.Module) -> torch.dtype:
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.dtype
    return next(p.dtype for p in module.parameters() if p.is_floating_point())


class Linears:
    """Several linear modules as one map of a float32 input x (rows), with a float32 result.

    blocks: (norm weight or None, module, width of its input). fan_out: every block reads all of
    x (times its norm weight) and the outputs lie side by side; else each reads its slice of x
    (times its norm weight) and the outputs are summed. Plain nn.Linear blocks make one GEMM in
    their dtype, `x @ W + b`, the norm weights folded into W (rms(x; w) @ A = x_hat @ (diag(w) A));
    any other module is called on its own scaled input.
    """

    def __init__(self, blocks: list, fan_out: bool):
        self.blocks, self.fan_out = blocks, fan_out
        self.W = self.b = None
        if all(type(m) is nn.Linear for _, m, _ in blocks):
            # folded in float32 (at least), then rounded once to the weights' dtype
            mats = [m.weight.t() if w is None else (_f32(w)[:, None] * _f32(m.weight.t())).to(m.weight.dtype)
                    for w, m, _ in blocks]
            self.W = torch.cat(mats, 1 if fan_out else 0)
            biases = [m.bias for _, m, _ in blocks]
            if fan_out and any(b is not None for b in biases):
                self.b = torch.cat([m.weight.new_zeros(m.out_features) if b is None else b
                                    for b, (_, m, _) in zip(biases, blocks)])
            elif not fan_out and any(b is not None for b in biases):
                self.b = sum(b for b in biases if b is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.W is not None:
            xc = x if x.dtype == self.W.dtype else x.to(self.W.dtype)
            y = torch.mm(xc, self.W) if self.b is None else torch.addmm(self.b, xc, self.W)
            return y if y.dtype == x.dtype else y.to(x.dtype)
        outs, start = [], 0
        for w, m, n in self.blocks:
            xi = x if self.fan_out else x[:, start : start + n]
            start += n
            xi = xi if w is None else xi * w.to(x.dtype)
            outs.append(m(xi.to(_weight_dtype(m))).to(x.dtype))
        return torch.cat(outs, -1) if self.fan_out else sum(outs)


class LayerMaps(NamedTuple):
    project: Linears  # the normalised layer input -> its projections, in the column blocks of `widths`
    output: Linears  # [silu(h1) h2 | silu(out gate) * read] -> the layer's update
    widths: list  # the projection's column blocks (`_layer_blocks`), for one split


class LoopMaps(NamedTuple):
    layers: list  # LayerMaps per predict layer
    ground: Linears  # the normalised prediction -> the ground gate's pre-activation
    key: Linears | None  # a normalised grounded state -> the key of the next memory write (GPN+M)
    A: torch.Tensor | None  # -exp(A_log), float32 (GPN+M)


def _layer_blocks(cfg: GPNConfig, layer: GPNPredictLayer, write: GPNMemoryWrite | None) -> list:
    """The column blocks of a layer's projection, [(width, [(norm weight, module), ...])]: the heads
    (layer 0 of GPN+M: the next write's key beside the query, so both are l2-normalised as one
    block), the read's output gate, layer 0's write value, beta and decay, the MLP's gate and up
    branches, the residual gate."""
    hk, hv, H, d = cfg.n_heads * cfg.d_key, cfg.n_heads * cfg.d_val, cfg.n_heads, cfg.d_state
    blocks = []
    read = layer.memory_read
    if read is not None:
        heads = [(read.norm.weight, read.query_proj)]
        if write is not None:
            heads.insert(0, (write.norm.weight, write.key_proj))
        blocks += [(hk * len(heads), heads), (hv, [(read.norm.weight, read.out_gate_proj)])]
    if write is not None:
        blocks += [(hv, [(write.norm.weight, write.value_proj)]), (H, [(write.norm.weight, write.beta_proj)]),
                   (H, [(write.norm.weight, write.decay_proj)])]
    return blocks + [(cfg.d_ffn, [(layer.mlp_norm.weight, layer.mlp.gate_proj)]),
                     (cfg.d_ffn, [(layer.mlp_norm.weight, layer.mlp.up_proj)]),
                     (d, [(layer.residual_norm.weight, layer.residual_gate)])]


_SCALARS: dict = {}


def _scalars(like: torch.Tensor, *values: float) -> tuple:
    """0-dim tensors of `values` in like's dtype and device, made once: an op with a Python
    scalar costs a hidden tensor per call, and the time loop's ops are tiny."""
    key = (like.dtype, like.device, values)
    if key not in _SCALARS:
        _SCALARS[key] = tuple(torch.tensor(v, dtype=like.dtype, device=like.device) for v in values)
    return _SCALARS[key]


def _rms_hat(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean(x^2) + 1e-6), as x / hypot(|x| / sqrt(n), sqrt(1e-6))."""
    inv_sqrt_n, sqrt_eps = _scalars(x, x.shape[-1] ** -0.5, RMS_EPS ** 0.5)
    return x / torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True) * inv_sqrt_n, sqrt_eps)


def _l2n_relu(z: torch.Tensor) -> torch.Tensor:
    """relu(z) / sqrt(|relu(z)|^2 + 1e-12)."""
    z = torch.relu(z)
    (sqrt_eps,) = _scalars(z, L2_EPS ** 0.5)
    return z / torch.hypot(torch.linalg.vector_norm(z, dim=-1, keepdim=True), sqrt_eps)


# ---- the model --------------------------------------------------------------------------------


class GPNPreTrainedModel(PreTrainedModel):
    config_class = GPNConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _is_stateful = True  # the cache is the recurrent state, passed as `state`: no KV cache to prepare
    _no_split_modules = ["GPNModel"]  # the layers run inside one time loop: never split across devices
    _supports_sdpa = False

    def _init_weights(self, module):
        """Modules transformers creates or grows (resize_token_embeddings, a model from a config): normal(0, 0.02)
        matrices, zero biases, unit norms, the memory decay as the paper initialises it; exported weights load over them."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.02)
            if getattr(module, "bias", None) is not None:
                module.bias.data.zero_()
        elif isinstance(module, GPNRMSNorm):
            module.weight.data.fill_(1.0)
        if isinstance(module, GPNMemoryWrite):
            H = module.A_log.shape[0]
            module.A_log.data.copy_(torch.empty(H).uniform_(1e-8, 16.0).log())
            dt = torch.empty(H).uniform_(math.log(1e-3), math.log(1e-1)).exp()  # log-uniform in [1e-3, 1e-1]
            module.decay_proj.bias.data.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus


@dataclass
class GPNModelOutput(ModelOutput):
    """last_hidden_state (B, T, d): the predicted state after each input (float32). state: the cache."""

    last_hidden_state: torch.FloatTensor | None = None
    state: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class GPNCausalLMOutput(ModelOutput):
    """logits (B, T, V), float32: position t scores the token after input t. state: the cache, (c, g, M)
    for GPN+M or (c, g) for GPN, float32: the prediction for the next token, the grounded state, the memory."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    state: tuple[torch.FloatTensor, ...] | None = None


class GPNModel(GPNPreTrainedModel):
    """The recurrence: input ids -> the predicted state after each (B, T, d_state), and the state."""

    gradient_checkpointing = False

    def __init__(self, config: GPNConfig):
        super().__init__(config)
        d = config.d_state
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_emb)
        self.input_norm = GPNRMSNorm(config.d_emb)
        self.input_proj = nn.Linear(config.d_emb, d, bias=False)
        self.memory_write = GPNMemoryWrite(config) if config.memory else None
        self.layers = nn.ModuleList(GPNPredictLayer(config) for _ in range(config.n_layers))
        self.ground_norm = GPNRMSNorm(d)
        self.ground_gate = nn.Linear(d, d)
        self._maps_cache = None
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    # ---- the maps, built once per forward (or once while the weights do not change) ----------

    def _loop_modules(self) -> list[nn.Module]:
        mods = [self.ground_norm, self.ground_gate]
        if self.memory_write is not None:
            mods.append(self.memory_write)
        return mods + list(self.layers)

    def loop_maps(self) -> LoopMaps:
        """The time loop's fused maps. Rebuilt on every call while gradients flow to the weights;
        otherwise kept until a weight changes (its version counter, storage or module)."""
        params = [p for m in self._loop_modules() for p in m.parameters()]
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            return self._build_maps()
        key = (torch.is_inference_mode_enabled(), tuple(id(m) for m in self.modules()),
               tuple((p.data_ptr(), p._version, p.dtype) for p in params))
        if self._maps_cache is None or self._maps_cache[0] != key:
            with torch.no_grad():
                self._maps_cache = (key, self._build_maps())
        return self._maps_cache[1]

    def _build_maps(self) -> LoopMaps:
        cfg, mw = self.config, self.memory_write
        layers = []
        for i, layer in enumerate(self.layers):
            blocks = _layer_blocks(cfg, layer, mw if i == 0 else None)
            project = Linears([(w, m, cfg.d_state) for _, mods in blocks for w, m in mods], fan_out=True)
            outs = [(None, layer.mlp.down_proj, cfg.d_ffn)]
            if layer.memory_read is not None:
                outs.append((layer.memory_read.out_norm.weight, layer.memory_read.out_proj, cfg.n_heads * cfg.d_val))
            layers.append(LayerMaps(project, Linears(outs, fan_out=False), [width for width, _ in blocks]))
        ground = Linears([(self.ground_norm.weight, self.ground_gate, cfg.d_state)], fan_out=True)
        if mw is None:
            return LoopMaps(layers, ground, None, None)
        key = Linears([(mw.norm.weight, mw.key_proj, cfg.d_state)], fan_out=True)
        return LoopMaps(layers, ground, key, -torch.exp(mw.A_log.float()))

    # ---- one step --------------------------------------------------------------------------

    def _predict(self, maps: LoopMaps, g, k, M):
        """Half a step from the grounded state g: the memory write (its key k from the previous
        grounded state), then the predict layers. Returns (c, the next write's key, M)."""
        cfg = self.config
        B, H = g.shape[0], cfg.n_heads
        c = g
        for i, L in enumerate(maps.layers):
            parts = L.project(_rms_hat(c)).split(L.widths, -1)
            h1, h2, residual = parts[-3:]
            update = F.silu(h1) * h2
            if M is not None:
                heads = _l2n_relu(parts[0].view(B, -1, H, cfg.d_key))
                if i == 0:  # the write: M <- exp(gamma) M + beta k (v - M^T k)^T, per head
                    value, beta, decay = parts[2:5]
                    delta = torch.sigmoid(beta)[..., None] * (value.view(B, H, cfg.d_val) - (k.unsqueeze(-2) @ M).squeeze(-2))
                    M = torch.addcmul(torch.exp(maps.A * F.softplus(decay))[..., None, None] * M, k[..., :, None],
                                      delta[..., None, :])
                    k = heads[:, 0]
                read = (heads[:, -1].unsqueeze(-2) @ M).reshape(B, -1)
                update = torch.cat([update, F.silu(parts[1]) * _rms_hat(read)], -1)
            c = torch.addcmul(L.output(update), torch.sigmoid(residual), c)
        return c, k, M

    def _step(self, maps: LoopMaps, c, g, k, M, u):
        """One token: ground the prediction c with its input projection u, then predict the next."""
        g = torch.addcmul(u, torch.sigmoid(maps.ground(_rms_hat(c))), c)
        c, k, M = self._predict(maps, g, k, M)
        return c, g, k, M

    def _run(self, maps: LoopMaps, u, state, keep, reset, start):
        """The steps over u (T, B, d), time-major, from state (c, g, k, M). keep (T, B): the rows a
        step advances (left padding does not); reset (T, B): the rows whose state after the step is
        `start` (the input was BOS). Returns the predictions (T, B, d) and the state."""
        skips = [False] * u.shape[0] if keep is None else (~keep).any(1).tolist()
        resets = [False] * u.shape[0] if reset is None else reset.any(1).tolist()
        predictions = []
        for t, u_t in enumerate(u.unbind(0)):
            new = self._step(maps, *state, u_t)
            if skips[t]:
                new = _where(keep[t], new, state)
            if resets[t]:
                new = _where(reset[t], start, new)
            state = new
            predictions.append(state[0])
        return torch.stack(predictions), state

    # ---- states ----------------------------------------------------------------------------

    def _input_projection(self, embeds: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x = self.input_norm(embeds)
        return self.input_proj(x.to(_weight_dtype(self.input_proj))).to(dtype)

    def _start(self, maps: LoopMaps, dtype, device):
        """The initial state (c, g, k, M), one row: the prediction from the empty state made, and
        with start_state "bos" one step of BOS taken."""
        cfg = self.config
        g = torch.zeros(1, cfg.d_state, dtype=dtype, device=device)
        M = k = None
        if cfg.memory:
            M = torch.zeros(1, cfg.n_heads, cfg.d_key, cfg.d_val, dtype=dtype, device=device)
            k = self._key_of(maps, g)  # the key from the empty previous state
        c, k, M = self._predict(maps, g, k, M)
        state = (c, g, k, M)
        if cfg.start_state == "bos":
            bos = torch.tensor([cfg.bos_token_id], device=device)
            state = self._step(maps, *state, self._input_projection(self.embed_tokens(bos), dtype))
        return state

    def _key_of(self, maps: LoopMaps, g):
        return _l2n_relu(maps.key(_rms_hat(g)).view(g.shape[0], self.config.n_heads, self.config.d_key))

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                state: tuple[torch.Tensor, ...] | None = None, inputs_embeds: torch.Tensor | None = None,
                use_cache: bool | None = None, **kwargs) -> GPNModelOutput:
        """The predicted state after each input (B, T, d) and the state after the last, continuing from
        `state` when given. Positions whose `attention_mask` is 0 (left padding) leave a row's state
        untouched, so a padded row equals its unpadded self; the state after BOS is the initial state."""
        cfg = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = embeds.shape[:2]
        dtype = torch.promote_types(embeds.dtype, torch.float32)  # the state is never low precision
        u = self._input_projection(embeds, dtype).transpose(0, 1)  # (T, B, d): all inputs at once
        keep = reset = None
        if attention_mask is not None and not bool(attention_mask[:, -T:].all()):
            keep = attention_mask[:, -T:].bool().t()
        if input_ids is not None and cfg.bos_token_id is not None:
            reset = (input_ids == cfg.bos_token_id).t()
            reset = (reset if keep is None else reset & keep) if bool(reset.any()) else None
        maps = self.loop_maps()
        start = self._start(maps, dtype, embeds.device) if state is None or reset is not None else None
        if state is None:
            state = tuple(None if s is None else s.expand(B, *s.shape[1:]) for s in start)
        else:
            c, g, *M = state
            M = M[0] if M else None
            state = (c, g, None if M is None else self._key_of(maps, g), M)
        seg = cfg.checkpoint_segment
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled() and seg and T > seg:
            # Time-segment recomputation: only each segment's incoming state is kept; torch's
            # non-reentrant checkpoint, which needs no input that requires grad (frozen embeddings, adapters).
            parts = []
            for t0 in range(0, T, seg):
                sl = slice(t0, t0 + seg)
                P, state = checkpoint(self._run, maps, u[sl], state, None if keep is None else keep[sl],
                                      None if reset is None else reset[sl], start, use_reentrant=False)
                parts.append(P)
            predictions = torch.cat(parts)
        else:
            predictions, state = self._run(maps, u, state, keep, reset, start)
        c, g, _, M = state
        cache = None if use_cache is False else ((c, g) if M is None else (c, g, M))
        return GPNModelOutput(last_hidden_state=predictions.transpose(0, 1), state=cache)


def _where(rows: torch.Tensor, a: tuple, b: tuple) -> tuple:
    """Per batch row: a's state where rows is true, else b's (None parts stay None)."""
    return tuple(None if x is None else torch.where(rows.view(-1, *([1] * (y.dim() - 1))), x, y) for x, y in zip(a, b))


class GPNForCausalLM(GPNPreTrainedModel, GenerationMixin):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config: GPNConfig):
        super().__init__(config)
        self.model = GPNModel(config)
        self.decoder_norm = GPNRMSNorm(config.d_state)
        self.decoder_proj = nn.Linear(config.d_state, config.d_emb, bias=config.use_decoder_bias)
        self.lm_head = nn.Linear(config.d_emb, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def decode(self, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted states (.., d) -> logits (.., V), float32."""
        h = self.decoder_norm(hidden)
        h = self.decoder_proj(h.to(_weight_dtype(self.decoder_proj)))
        return self.lm_head(h.to(_weight_dtype(self.lm_head))).float()

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                state: tuple[torch.Tensor, ...] | None = None, labels: torch.LongTensor | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                return_dict: bool | None = None, logits_to_keep: int = 0, **kwargs) -> GPNCausalLMOutput:
        """Scores and state after `input_ids` (B, T). labels: the inputs (ignore_index -100); position t
        is scored against token t + 1, as transformers' causal LMs do. logits_to_keep: decode only the
        last n positions (0: all)."""
        out = self.model(input_ids, attention_mask=attention_mask, state=state, inputs_embeds=inputs_embeds,
                         use_cache=use_cache)
        hidden = out.last_hidden_state
        logits = self.decode(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return GPNCausalLMOutput(loss=loss, logits=logits, state=out.state)

    def generate(self, *args, **kwargs):
        config = kwargs.get("generation_config") or self.generation_config
        if (kwargs.get("num_beams") or config.num_beams or 1) > 1:
            # transformers' beam search reorders `past_key_values` only: this model's cache would not follow
            raise ValueError("beam search is not supported: the cache is the recurrent `state`, which beam search "
                             "does not reorder; use greedy decoding or sampling")
        return super().generate(*args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, state=None, attention_mask=None, use_cache=None,
                                      logits_to_keep=None, **kwargs):
        # With a state, everything before the newest token is already in it: feed that token alone.
        if state is not None:
            input_ids = input_ids[:, -1:]
        inputs = {"input_ids": input_ids, "state": state, "attention_mask": attention_mask, "use_cache": use_cache}
        if logits_to_keep is not None:
            inputs["logits_to_keep"] = logits_to_keep
        return inputs
