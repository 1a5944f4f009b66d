"""Decoding one token at a time: one call per token on the carried state, for every model family.

A model's forward scores the tokens it is fed (logits[:, t] predict token t), so reading the next
token's distribution from it takes a second call, on a placeholder, per token. A decoder carries
the state one half-step further instead: its state after tokens x_1 .. x_t already holds the
prediction for x_{t+1}, so each new token is exactly one `step`, which returns the distribution of
the token after it.

    dec = decoder(model)                         # weights prepared once, for the whole generation
    logits, ds = dec.prefill(prompt)             # (B, T) tokens: one forward, then the first prediction
    logits, ds = dec.step(ds, next_tokens)       # (B,) tokens -> (B, V) logits of the token after them

GPN / GPN+M (`GPNDecoder`): the fused core's step (gpn_scale/models/core.py) for a batch of rows,
with its fused weights built once per decoder and the step kernels of the model's backend
(`kernels.step`, `kernels.memory`). A step grounds the previous prediction with the token, writes
M and runs the predict layers: per token constant time and memory, whatever came before.

Transformer++ (`TransformerDecoder`): a KV cache allocated ahead for the planned tokens (doubled
if they are exceeded), so a step appends its keys and values in place and attends over the cache
(no copy of the cache per token).

Gated DeltaNet (`LayeredDecoder`): its forward on one token with the state carried; a layered
model's state after a placeholder is the state after the token before it, so the placeholder's
state with the next token put in its place is the next state.

Decode states are NamedTuples of batch-first tensors for GPN and GDN, so rows can be taken out of
a batch (`gpn_scale.eval.harness.take_rows`). A Transformer's cache is updated in place: step each
of its decode states once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from gpn_scale.models.core import fuse_weights, layer_steps, predict_step, window_buffers
from gpn_scale.models.core_structures import CoreSpec, StepLayers, columns, step_views
from gpn_scale.models.gdn import GatedDeltaNet
from gpn_scale.models.gpn import GPN, GPNState
from gpn_scale.models.ops import at_least_f32
from gpn_scale.models.transformer import Transformer, rotary

PLACEHOLDER = 0  # any id: a forward's logits at a position do not depend on the token fed there


def decoder(model, batch: int = 1, new_tokens: int | None = None):
    """The decoder of a model's family, its weights prepared for `batch` rows (a smaller batch, as
    rows finish, works too). `new_tokens`: how many steps are planned, where it matters (a KV cache
    is allocated for them at once; it grows when they are exceeded)."""
    if isinstance(model, GPN):
        return GPNDecoder(model, batch)
    if isinstance(model, Transformer):
        return TransformerDecoder(model, new_tokens)
    if isinstance(model, GatedDeltaNet):
        return LayeredDecoder(model)
    raise TypeError(f"no decoder for {type(model).__name__}")


def _device(model) -> torch.device:
    return next(model.parameters()).device


# ---- GPN and GPN+M -----------------------------------------------------------------------------


class GPNDecodeState(NamedTuple):
    """The model's state after the tokens so far, and the prediction already made from it.

    state: the `GPNState` the forward returns after the same tokens (s = g_{t+1}, prev_s = g_t, M_t).
    c, c_hat: the predicted state s^p_{t+1} (B, d) and c / rms(c), which the logits and the next
      token's grounding read.
    M: the memory that prediction read, M_{t+1}: the state's M after the write of step t+1.
    key: the normalised key of the write after it, from state.s (B, H, d_key).
    M and key are None for GPN.
    """

    state: GPNState
    c: torch.Tensor
    c_hat: torch.Tensor
    M: torch.Tensor | None
    key: torch.Tensor | None


class _Work(NamedTuple):
    """A batch size's buffers, written and read within a step (never carried): the fused core's for
    a one-step window (`core.window_buffers`), whose rows 0 a step uses, made once with the views
    of them the step's kernels take (slicing costs microseconds a view)."""

    layers: StepLayers  # the predict layers' (`core.predict_step`)
    fuse_gate: torch.Tensor  # (B, d): the fuse gate's pre-activation, then the gate
    pred_rms: torch.Tensor  # (B, 1): rms of the prediction
    write_err: torch.Tensor | None  # (B, H, dv): the write's error


class _Memory:
    """M's write and reads for one decode step (`core.predict_step`), from the carried M and key.
    Layer 0's normalised [next key | query] go to a tensor of their own each step, `heads`, put in
    the one slot of its views (a list, `GPNDecoder._buffers`): the next key is carried in the
    decode state."""

    def __init__(self, mem, M, key, work: _Work):
        self.mem, self.M, self.key, self.write_err = mem, M, key, work.write_err
        first = work.layers.views[0]
        self.heads = first.heads_hat[0] = torch.empty_like(first.heads[0])

    def write(self, v, w: int, s: int, y: int) -> None:
        """The write from the carried key, into an M of its own (M_{t+1} is carried), and layer 0's read."""
        self.M, *_ = self.mem.memory_step(self.M, self.key, v.v[y], v.beta[0], v.decay[0], self.heads[:, 1], v.gate[y],
                                          out_e=self.write_err, out_o=v.reads[w], out_y=v.read_out[w],
                                          out_M=torch.empty_like(self.M))

    def read(self, v, w: int, s: int, y: int) -> None:
        """A later layer's read of M_{t+1}."""
        self.mem.memory_read(self.M, v.q[w], v.gate[y], out_o=v.reads[w], out_y=v.read_out[w])


class GPNDecoder:
    """The fused core's step for decoding (module docstring). Weights: `fuse_weights`, in the
    state's dtype, laid out once (`StepOps.pack`) for `batch` rows; the input projection's and the
    decoder's norm weights folded in the same way."""

    def __init__(self, model: GPN, batch: int = 1):
        cfg = model.config
        self.model, self.cfg = model, cfg
        self.device = _device(model)
        self.dtype = torch.promote_types(model.embedding.dtype, torch.float32)  # the state's
        backend = model.backend(self.device.type)
        self.ops, self.mem = backend.step, backend.memory
        self.spec = CoreSpec.from_config(cfg, backend, self.dtype)
        sd, pack = self.dtype, self.ops.pack
        with torch.no_grad():
            layers, fg_W, fg_b = fuse_weights(model)
            layers = [L._replace(W=L.W.to(sd), b=L.b.to(sd), W2o=L.W2o.to(sd)) for L in layers]
            steps = 1 << 20  # a generation's: enough to be worth laying out once
            self.layers = [L._replace(W=pack(L.W, steps, batch), W2o=pack(L.W2o, steps, batch)) for L in layers]
            self.fg_W, self.fg_b = pack(fg_W.to(sd), steps, batch), fg_b.to(sd)
            self.u_W = pack((model.fuse_norm_w[:, None] * model.fuse_proj_k).to(sd), steps, batch)
            self.dec_W = pack((model.decode_norm_w[:, None] * model.decode_proj_k).to(sd), steps, batch)
            self.dec_b = None if model.decode_bias is None else model.decode_bias.to(sd)
            self.emb = model.embedding.to(sd)
            self.emb_T = self.emb.T
            self.A = None
            if cfg.memory:
                k = columns(self.spec, True)["k"]
                self.key_W, self.key_b = layers[0].W[:, k], layers[0].b[k]
                self.A = -torch.exp(model.write_A_log.to(sd))
        self._work: dict[int, _Work] = {}

    def _buffers(self, B: int) -> _Work:
        work = self._work.get(B)
        if work is None:
            spec, n = self.spec, self.cfg.n_layers
            like = torch.empty((), dtype=self.dtype, device=self.device)
            S = window_buffers(spec, n, 1, B, like, gate_rows=1)
            views = [layer_steps(spec, S, i, columns(spec, i == 0)) for i in range(n)]
            if spec.memory:  # layer 0's [next key | query]: a fresh tensor each step (`_Memory`)
                views[0] = views[0]._replace(heads_hat=[None])
            gemm2_out = step_views(like.new_empty((1, B, spec.d_state)))
            layers = StepLayers(ops=self.ops, weights=self.layers, views=views, gemm2_out=gemm2_out, A=self.A)
            work = self._work[B] = _Work(layers=layers, fuse_gate=S.fuse_gate[0], pred_rms=S.pred_rms[0],
                                         write_err=S.write_err[0] if spec.memory else None)
        return work

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, state: GPNState | None = None):
        """The training forward once over tokens (B, T) (none: T = 0), then the first prediction.
        Returns (logits (B, V) of the token after them, decode state)."""
        if tokens.shape[1]:
            state = self.model(tokens.to(self.device), state=state).state
        return self.resume(state, tokens.shape[0])

    @torch.no_grad()
    def resume(self, state: GPNState | None, batch: int = 1):
        """The prediction from a model state (None: the empty one, for `batch` rows)."""
        state = self.model.initial_state(batch, self.device) if state is None else GPNState(*state)
        s = state.s.to(self.dtype)
        B, work = s.shape[0], self._buffers(s.shape[0])
        key, ew = None, self.ops
        if self.cfg.memory:  # the first write's key, from the state's previous grounded state
            x_prev, _ = ew.rms_hat(state.prev_s.to(self.dtype))
            key, _ = ew.l2n_relu(ew.mm(x_prev, self.key_W, bias=self.key_b).view(B, self.cfg.n_heads, -1))
        first = work.layers.views[0]
        ew.rms_hat(s, first.x_hat[0], first.rms[0])
        return self._predict(state, s, key, work)

    @torch.no_grad()
    def step(self, ds: GPNDecodeState, tokens: torch.Tensor):
        """Ground the prediction with tokens (B,), write M and predict again. Returns (logits (B, V) of
        the token after them, decode state)."""
        ew, work = self.ops, self._buffers(ds.c.shape[0])
        x_emb, _ = ew.rms_hat(self.emb[tokens.to(self.device)])
        u = ew.mm(x_emb, self.u_W)
        fg, first = work.fuse_gate, work.layers.views[0]
        ew.mm(ds.c_hat, self.fg_W, fg, self.fg_b)
        s = ew.ground(fg, ds.c, u, fg, first.x_hat[0], first.rms[0])  # g = u + sigmoid(.) c, normalised for layer 0
        return self._predict(GPNState(s, ds.state.s, ds.M), s, ds.key, work)

    def _predict(self, state: GPNState, s, key, work: _Work):
        """The write (GPN+M) and the predict layers from s = state.s, whose normalised form is in
        layer 0's input buffer (`core.predict_step`); then the logits of the prediction."""
        memory = _Memory(self.mem, state.M.contiguous(), key, work) if self.cfg.memory else None
        c_hat = torch.empty_like(s)
        c = predict_step(work.layers, s, memory, (0, 0, 0, 0), (torch.empty_like(s), c_hat, work.pred_rms))
        h = self.ops.mm(c_hat, self.dec_W, bias=self.dec_b)
        logits = at_least_f32(h @ self.emb_T)
        if memory is None:
            return logits, GPNDecodeState(state=state, c=c, c_hat=c_hat, M=None, key=None)
        return logits, GPNDecodeState(state=state, c=c, c_hat=c_hat, M=memory.M, key=memory.heads[:, 0])


# ---- Transformer++ -----------------------------------------------------------------------------


class KVCache(NamedTuple):
    """Per layer (keys, values), each (B, n_heads, capacity, head_dim), keys rotated; the first
    `length` positions are filled. `last_token`: (B,) the token the next step reads, None for the
    empty context (the model's `start`)."""

    keys: list
    values: list
    length: int
    last_token: torch.Tensor | None


class TransformerDecoder:
    """Transformer++ with a KV cache filled in place (module docstring)."""

    RESERVE = 256  # positions allocated beyond the prompt when the number of new tokens is not given

    def __init__(self, model: Transformer, new_tokens: int | None = None):
        self.model = model
        self.device = _device(model)
        self.reserve = self.RESERVE if new_tokens is None else max(1, new_tokens)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, state=None):
        """The forward once over tokens (B, T), its keys and values copied into a cache with room to
        grow, then the first prediction."""
        B, T = tokens.shape
        if T:
            state = self.model(tokens.to(self.device), state=state).state
        return self.resume(state, B)

    @torch.no_grad()
    def resume(self, state=None, batch: int = 1):
        """The prediction from a model state (a `TransformerState`; None: the empty context)."""
        model = self.model
        if state is None:
            like = model.embedding
            n_heads = model.config.n_heads
            shape = (batch, n_heads, 1 + self.reserve, model.config.d_model // n_heads)  # `start`'s and the steps'
            keys = [like.new_empty(shape) for _ in model.layers]
            values = [like.new_empty(shape) for _ in model.layers]
            return self.step(KVCache(keys, values, 0, None), None)
        past = state.kv[0][0].shape[2]
        keys, values = [], []
        for k, v in state.kv:
            room = k.new_empty(k.shape[:2] + (past + 1 + self.reserve, k.shape[3]))  # the last token's and the steps'
            keys.append(room), values.append(torch.empty_like(room))
            keys[-1][:, :, :past], values[-1][:, :, :past] = k, v
        return self.step(KVCache(keys, values, past, None), state.last_token)

    @torch.no_grad()
    def step(self, cache: KVCache, tokens: torch.Tensor | None):
        """Feed tokens (B,) (None: the empty context's `start`) at the next position: their keys and
        values go into the cache, in place. Returns (logits (B, V) of the token after them, cache)."""
        model = self.model
        B = cache.keys[0].shape[0]
        pos = cache.length
        if pos == cache.keys[0].shape[2]:  # full: double it
            grow = lambda x: torch.cat([x, torch.empty_like(x)], 2)  # noqa: E731
            cache = cache._replace(keys=[grow(k) for k in cache.keys], values=[grow(v) for v in cache.values])
        if tokens is None:
            x = model.start.expand(B, 1, -1)
        else:
            x = model.embedding[tokens.to(self.device)][:, None]
        for layer, K, V in zip(model.layers, cache.keys, cache.values):
            attn = layer.mixer
            h = layer.mixer_norm(x)
            q, k, v = (p(h).view(B, 1, attn.n_heads, -1).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            K[:, :, pos : pos + 1] = rotary(k, pos, attn.theta)
            V[:, :, pos : pos + 1] = v
            o = F.scaled_dot_product_attention(rotary(q, pos, attn.theta), K[:, :, : pos + 1], V[:, :, : pos + 1])
            x = x + attn.o_proj(o.transpose(1, 2).reshape(B, 1, -1))
            x = x + layer.mlp(layer.mlp_norm(x))
        logits = at_least_f32(model.norm(x)[:, 0] @ model.embedding.T)
        return logits, cache._replace(length=pos + 1, last_token=tokens)


# ---- other layered models ----------------------------------------------------------------------


class LayeredDecoder:
    """A layered model whose state holds the last token (Gated DeltaNet): one forward per token.

    The forward on a placeholder reads the last token at its position 0 and returns the
    distribution after it; its state is then the state after that token, but for its
    `last_token`, which the next step sets to the token chosen."""

    def __init__(self, model):
        self.model = model
        self.device = _device(model)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, state=None):
        if tokens.shape[1]:
            state = self.model(tokens.to(self.device), state=state).state
        return self.resume(state, tokens.shape[0])

    @torch.no_grad()
    def resume(self, state=None, batch: int = 1):
        placeholder = torch.full((batch if state is None else state.last_token.shape[0], 1), PLACEHOLDER,
                                 dtype=torch.long, device=self.device)
        out = self.model(placeholder, state=state, return_logits=True)
        return out.logits[:, 0], out.state

    @torch.no_grad()
    def step(self, state, tokens: torch.Tensor):
        return self.resume(state._replace(last_token=tokens.to(self.device)))
