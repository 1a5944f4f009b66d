"""The paper's trainer as far as resuming goes, in JAX: its optimiser chain, `Trainer._load_checkpoint`
and a training step.

The paper's code is not part of this repository; this reconstructs its resume path from what the
project knows of it (docs/model.md: "Reference checkpoints" for the pickle, "Training recipe" for the
optimiser): `checkpoint.pkl` is unpickled, and params, opt_state, step and data_position are put back
as the trainer holds them, the arrays on the device; the optimiser is optax's chain of global-norm
clipping and AdamW with weight decay on matrices and a warm-up + cosine schedule. The model's loss is
docs/model.md's, written in jax.numpy (tests/support/reference_gpn.py is the NumPy transcription it follows).

Run as a program, in a process of its own as the paper's code runs (and so that jax's threads never
live in a process that later forks):

    cd tests && python -m support.reference_trainer CKPT_DIR --train TRAIN.json --batch TOKENS.npy --out RESULT
    cd tests && python -m support.reference_trainer CKPT_DIR --train TRAIN.json --data WINDOWS.npy --batch-size B --out RESULT

loads CKPT_DIR, checks what it restored, takes one training step on the batch (given, or the next
one the paper's loader reads from WINDOWS: `Dataset.batches(B, start=data_position)`), and writes
RESULT.json (what was restored, the batch index read, the loss) and RESULT.npz (the parameters
after the step).
"""

from __future__ import annotations

import argparse
import itertools
import json
import pickle
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from support.reference_gpn import layer_prefixes


def schedule(lr: float, warmup: int, total: int, min_ratio: float):
    """Linear warm-up to lr, then a cosine to min_ratio * lr at `total` steps, of the update count."""

    def fn(count):
        warm = (count + 1) / warmup
        progress = jnp.clip((count - warmup) / max(1, total - warmup), 0.0, 1.0)
        return lr * jnp.where(count < warmup, warm, min_ratio + (1 - min_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * progress)))

    return fn


def make_optimizer(train: dict) -> optax.GradientTransformation:
    """clip_by_global_norm, then AdamW whose weight decay is masked to the matrices."""
    return optax.chain(
        optax.clip_by_global_norm(train["grad_clip"]),
        optax.adamw(schedule(train["lr"], train["warmup_steps"], train["total_steps"], train["min_lr_ratio"]),
                    b1=train["beta1"], b2=train["beta2"], eps=1e-8, weight_decay=train["weight_decay"],
                    mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)))


def _rms(x, w):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w


def _l2n(x):
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-12)


def _gate(x, p, prefix):
    return jax.nn.sigmoid(_rms(x, p[prefix + "norm_w"]) @ p[prefix + "gate_k"] + p[prefix + "gate_b"])


def loss_fn(params: dict, model_cfg: dict, tokens) -> jax.Array:
    """Mean cross-entropy over every position of the windows (B, T), each from the empty state; the time
    loop is a `lax.scan` over the tokens, carrying the grounded states and the memory."""
    p = params
    memory = "write_W_k_k" in p
    B = tokens.shape[0]
    d, H = p["fg_gate_b"].shape[0], model_cfg.get("n_heads", 1)
    zeros = jnp.zeros((B, d))
    M0 = jnp.zeros((B, H, model_cfg["d_key"], model_cfg["d_val"]) if memory else (B, 1, 1, 1))

    def step(carry, x):
        g, g_prev, M = carry
        if memory:
            a_prev, a = _rms(g_prev, p["write_norm_w"]), _rms(g, p["write_norm_w"])
            k = _l2n(jax.nn.relu(a_prev @ p["write_W_k_k"] + p["write_W_k_b"]).reshape(B, H, -1))
            v = (a @ p["write_W_v_k"]).reshape(B, H, -1)
            beta = jax.nn.sigmoid(a @ p["write_W_beta_k"])
            gamma = -jnp.exp(p["write_A_log"]) * jax.nn.softplus(a @ p["write_W_a_k"] + p["write_dt_bias"])
            error = v - jnp.einsum("bhij,bhi->bhj", M, k)
            M = jnp.exp(gamma)[..., None, None] * M + beta[..., None, None] * jnp.einsum("bhi,bhj->bhij", k, error)
        c = g
        for pre in layer_prefixes(model_cfg, memory):
            h = _rms(c, p[pre + "ffn_norm_w"]) @ p[pre + "ffn_w1_k"]
            h1, h2 = jnp.split(h, 2, axis=-1)
            update = (jax.nn.silu(h1) * h2) @ p[pre + "ffn_w2_k"]
            if memory:
                r = _rms(c, p[pre + "read_norm_w"])
                q = _l2n(jax.nn.relu(r @ p[pre + "read_W_q_k"] + p[pre + "read_W_q_b"]).reshape(B, H, -1))
                o = jnp.einsum("bhij,bhi->bhj", M, q).reshape(B, -1)
                update = update + (jax.nn.silu(r @ p[pre + "read_W_gate_k"]) * _rms(o, p[pre + "read_out_norm_w"])
                                   ) @ p[pre + "read_W_o_k"]
            c = _gate(c, p, pre + "pg_") * c + update
        h = _rms(c, p["decode_norm_w"]) @ p["decode_proj_k"]
        if "decode_bias" in p:
            h = h + p["decode_bias"]
        logits = h @ p["embedding"].T
        loss = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, x[:, None], -1)[:, 0]
        u = _rms(p["embedding"][x], p["fuse_norm_w"]) @ p["fuse_proj_k"]
        return (_gate(c, p, "fg_") * c + u, g, M), loss

    _, losses = jax.lax.scan(step, (zeros, zeros, M0), tokens.T)
    return jnp.mean(losses)


class Dataset:
    """The paper's loader as its trainer drives it: `batches(batch_size, start)` yields batch after
    batch of consecutive windows from batch index `start` on (the trainer adds one to data_position
    per batch it trains on), and ends where a whole batch no longer fits."""

    def __init__(self, windows: np.ndarray):
        self.windows = windows

    def batches(self, batch_size: int, start: int = 0):
        for index in itertools.count(start):
            batch = self.windows[index * batch_size:(index + 1) * batch_size]
            if len(batch) < batch_size:
                return
            yield batch


class Trainer:
    """config: the run's JSON config, the model fields under "model", the optimiser's under "train"."""

    def __init__(self, config: dict):
        self.model_cfg = config["model"]
        self.optimizer = make_optimizer(config["train"])
        self.params = self.opt_state = None
        self.step = self.data_position = 0

        def update(params, opt_state, tokens):  # one jitted training step, as a JAX trainer compiles it
            loss, grads = jax.value_and_grad(loss_fn)(params, self.model_cfg, tokens)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self._update = jax.jit(update)

    def _load_checkpoint(self, ckpt_dir: str | Path) -> None:
        with open(Path(ckpt_dir) / "checkpoint.pkl", "rb") as f:
            ckpt = pickle.load(f)  # the paper's own load: a plain unpickle of its own file
        self.params = jax.tree.map(jnp.asarray, ckpt["params"])
        self.opt_state = jax.tree.map(jnp.asarray, ckpt["opt_state"])
        self.step = ckpt["step"]
        self.data_position = ckpt["data_position"]

    def train_step(self, tokens) -> float:
        self.params, self.opt_state, loss = self._update(self.params, self.opt_state, jnp.asarray(tokens))
        self.step += 1
        return float(loss)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--train", required=True, help="JSON: the optimiser settings (lr, warmup_steps, ...)")
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--batch", help=".npy of token windows (B, T)")
    source.add_argument("--data", help=".npy of token windows (N, T), read by the paper's loader from data_position")
    ap.add_argument("--batch-size", type=int, help="with --data: windows per batch")
    ap.add_argument("--out", required=True, help="RESULT: RESULT.json and RESULT.npz are written")
    args = ap.parse_args(argv)
    config = json.loads((Path(args.checkpoint) / "config.json").read_text())
    trainer = Trainer({**config, "train": json.loads(Path(args.train).read_text())})
    trainer._load_checkpoint(args.checkpoint)
    adam, schedule = trainer.opt_state[1][0], trainer.opt_state[1][2]
    restored = {
        "structure_matches": jax.tree.structure(trainer.opt_state) == jax.tree.structure(
            trainer.optimizer.init(trainer.params)),
        "classes": [f"{type(x).__module__}.{type(x).__name__}" for x in
                    (trainer.opt_state[0], adam, trainer.opt_state[1][1], schedule)],
        "counts": [int(adam.count), int(schedule.count)], "step": trainer.step, "data_position": trainer.data_position,
        "mu_zero": not any(bool(v.any()) for v in jax.tree.leaves(adam.mu)),
        "nu_nonzero": all(bool(v.any()) for v in jax.tree.leaves(adam.nu)),
    }
    before = trainer.params
    if args.data:
        batch = next(Dataset(np.load(args.data)).batches(args.batch_size, start=trainer.data_position), None)
        if batch is None:  # past the end of its data: the paper's trainer trains on nothing
            Path(args.out + ".json").write_text(json.dumps({"restored": restored, "after": None}))
            return
        restored["batch_read"] = trainer.data_position
        trainer.data_position += 1
    else:
        batch = np.load(args.batch)
    loss = trainer.train_step(batch)
    moved = all(bool((a != b).any()) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.params)))
    after = {"loss": loss, "step": trainer.step, "count": int(trainer.opt_state[1][0].count), "all_moved": moved}
    Path(args.out + ".json").write_text(json.dumps({"restored": restored, "after": after}))
    np.savez(args.out + ".npz", **{k: np.asarray(v) for k, v in trainer.params.items()})


if __name__ == "__main__":
    main(sys.argv[1:])
