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

from gpn_scale.models.core import fuse_weights
from gpn_scale.models.core_structures import Spec, columns
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


class _LayerWork(NamedTuple):
    """One layer's buffers for a batch size, written and read within a step (never carried), and
    the views of them the step's kernels take, made once: slicing costs microseconds a view."""

    x: torch.Tensor  # (B, d): the normalised layer input (layer 0's: the grounded state's)
    r: torch.Tensor  # (B, 1): its rms
    y: torch.Tensor  # (B, N): the fused projection's output (core_structures.columns' blocks)
    h1: torch.Tensor  # its SwiGLU blocks
    h2: torch.Tensor
    pg: torch.Tensor  # the predict gate's block
    z: torch.Tensor  # (B, F [+ H*dv]): the second GEMM's input [silu(h1) h2 | read output]
    z_ffn: torch.Tensor
    z_read: torch.Tensor | None
    heads: torch.Tensor | None  # (B, 2 or 1, H, dk): [next key |] query, before normalising
    gate: torch.Tensor | None  # the read's gate block
    norms: torch.Tensor | None  # the normalised heads' norms
    q: torch.Tensor | None  # (B, 1, H, dk): a later layer's normalised query
    o: torch.Tensor | None  # (B, H*dv): the raw read
    v: torch.Tensor | None = None  # layer 0 of GPN+M: the write's value (B, H, dv), gates' blocks
    beta: torch.Tensor | None = None
    a: torch.Tensor | None = None


class _Work(NamedTuple):
    layers: list  # _LayerWork per layer
    out: torch.Tensor  # (B, d): the second GEMM's output
    fg: torch.Tensor  # (B, d): the fuse gate's pre-activation, then the gate
    rp: torch.Tensor  # (B, 1): rms of the prediction
    gates: torch.Tensor | None  # (3, B, H): the write's beta, gamma, decay
    e: torch.Tensor | None  # (B, H, dv): the write's error


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
        spec = Spec(cfg.d_state, cfg.d_ffn, cfg.n_heads, cfg.d_key, cfg.d_val, cfg.memory, cfg.core_chunk, cfg.bptt,
                    self.dtype, backend)
        self.cols = [columns(spec, i == 0) for i in range(cfg.n_layers)]
        sd, pack = self.dtype, self.ops.pack
        with torch.no_grad():
            layers, fg_W, fg_b = fuse_weights(model)
            layers = [L._replace(W=L.W.to(sd), b=L.b.to(sd), W2o=L.W2o.to(sd)) for L in layers]
            self.widths = [L.W.shape[1] for L in layers]
            steps = 1 << 20  # a generation's: enough to be worth laying out once
            self.layers = [L._replace(W=pack(L.W, steps, batch), W2o=pack(L.W2o, steps, batch)) for L in layers]
            self.fg_W, self.fg_b = pack(fg_W.to(sd), steps, batch), fg_b.to(sd)
            self.u_W = pack((model.fuse_norm_w[:, None] * model.fuse_proj_k).to(sd), steps, batch)
            self.dec_W = pack((model.decode_norm_w[:, None] * model.decode_proj_k).to(sd), steps, batch)
            self.dec_b = None if model.decode_bias is None else model.decode_bias.to(sd)
            self.emb = model.embedding.to(sd)
            self.emb_T = self.emb.T
            if cfg.memory:
                k = self.cols[0]["k"]
                self.key_W, self.key_b = layers[0].W[:, k], layers[0].b[k]
                self.A = -torch.exp(model.write_A_log.to(sd))
        self._work: dict[int, _Work] = {}

    def _buffers(self, B: int) -> _Work:
        work = self._work.get(B)
        if work is None:
            cfg = self.cfg
            new = lambda *shape: torch.empty(shape, dtype=self.dtype, device=self.device)  # noqa: E731
            Fd, H, dk, mem = cfg.d_ffn, cfg.n_heads, cfg.d_key, cfg.memory
            layers = []
            for i, (width, col) in enumerate(zip(self.widths, self.cols)):
                y, z = new(B, width), new(B, Fd + (H * cfg.d_val if mem else 0))
                ffn = y[:, col["ffn"]]
                views = dict(x=new(B, cfg.d_state), r=new(B, 1), y=y, h1=ffn[:, :Fd], h2=ffn[:, Fd:], pg=y[:, col["pg"]],
                             z=z, z_ffn=z[:, :Fd], z_read=None, heads=None, gate=None, norms=None, q=None, o=None)
                if mem:
                    nh = 2 if i == 0 else 1
                    views.update(z_read=z[:, Fd:], heads=y[:, col["heads"]].view(B, nh, H, dk), gate=y[:, col["gate"]],
                                 norms=new(B, nh, H, 1), q=None if i == 0 else new(B, 1, H, dk), o=new(B, H * cfg.d_val))
                    if i == 0:
                        views.update(v=y[:, col["v"]].view(B, H, cfg.d_val), beta=y[:, col["beta"]], a=y[:, col["a"]])
                layers.append(_LayerWork(**views))
            work = self._work[B] = _Work(layers, new(B, cfg.d_state), new(B, cfg.d_state), new(B, 1),
                                         new(3, B, H) if mem else None, new(B, H, cfg.d_val) if mem else None)
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
        ew.rms_hat(s, work.layers[0].x, work.layers[0].r)
        return self._predict(state, s, key, work)

    @torch.no_grad()
    def step(self, ds: GPNDecodeState, tokens: torch.Tensor):
        """Ground the prediction with tokens (B,), write M and predict again. Returns (logits (B, V) of
        the token after them, decode state)."""
        ew, work = self.ops, self._buffers(ds.c.shape[0])
        x_emb, _ = ew.rms_hat(self.emb[tokens.to(self.device)])
        u = ew.mm(x_emb, self.u_W)
        ew.mm(ds.c_hat, self.fg_W, work.fg, self.fg_b)
        first = work.layers[0]
        s = ew.ground(work.fg, ds.c, u, work.fg, first.x, first.r)  # g = u + sigmoid(.) c, normalised for layer 0
        return self._predict(GPNState(s, ds.state.s, ds.M), s, ds.key, work)

    def _predict(self, state: GPNState, s, key, work: _Work):
        """The write (GPN+M) and the predict layers from s = state.s, whose normalised form is in
        layer 0's input buffer; then the logits of the prediction."""
        cfg, ew, mem = self.cfg, self.ops, self.mem
        M, next_key, c, c_hat = state.M, None, s, None
        last = cfg.n_layers - 1
        for i, (L, w) in enumerate(zip(self.layers, work.layers)):
            ew.mm(w.x, L.W, w.y, L.b)
            if not cfg.memory:
                ew.post_projection(w.h1, w.h2, w.z_ffn)
            elif i == 0:
                heads = torch.empty_like(w.heads)  # [next key | query]: the key is carried to the next step
                beta, gamma, decay = work.gates
                ew.post_projection(w.h1, w.h2, w.z_ffn, w.heads, heads, w.norms, w.beta, w.a, self.A, beta, gamma, decay)
                M = state.M.contiguous()
                M, *_ = mem.memory_step(M, key, w.v, beta, decay, heads[:, 1], w.gate, out_e=work.e, out_o=w.o,
                                        out_y=w.z_read, out_M=torch.empty_like(M))  # M_{t+1}: carried
                next_key = heads[:, 0]
            else:
                ew.post_projection(w.h1, w.h2, w.z_ffn, w.heads, w.q, w.norms)
                mem.memory_read(M, w.q[:, 0], w.gate, out_o=w.o, out_y=w.z_read)
            if i == last:
                c_hat = torch.empty_like(s)
                x_next, r_next, out = c_hat, work.rp, torch.empty_like(s)
            else:
                x_next, r_next, out = work.layers[i + 1].x, work.layers[i + 1].r, None
            c = ew.residual_rms(ew.mm(w.z, L.W2o, work.out), w.pg, c, out, x_next, r_next)
        h = ew.mm(c_hat, self.dec_W, bias=self.dec_b)
        logits = at_least_f32(h @ self.emb_T)
        return logits, GPNDecodeState(state, c, c_hat, M, next_key)


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
