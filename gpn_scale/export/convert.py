"""Interop with checkpoints of the paper's reference trainer (docs/model.md, "Reference checkpoints").

The reference saves `<run>/<name>_<step>/checkpoint.pkl`, a pickle of
`{"step", "data_position", "params": {name: numpy array}, "opt_state": optax state}`, beside a
JSON run config with the model fields under "model". Native parameters have the same shapes and
layout; only per-layer names differ (`L{i}_x` there, `layers.{i}.x` here; a one-layer GPN has no
prefix there).

The pickle is read by an unpickler that can build NumPy arrays and plain containers and nothing
else: no callable named by the file is ever invoked. Classes of the optimiser state (optax, jax,
chex, flax) become inert placeholders, so `opt_state` can be skipped without optax installed.
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import numpy as np
import torch

from data_prep.errors import UserError, read_json
from data_prep.helptext import HelpFormatter
from gpn_scale.models import GPN, GPNConfig

# What a reference pickle may build: NumPy arrays, dtypes and scalars, and plain containers.
_SAFE_GLOBALS = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("collections", "OrderedDict"),
    *((mod, fn) for mod in ("numpy.core.multiarray", "numpy._core.multiarray") for fn in ("_reconstruct", "scalar")),
    *((mod, "_frombuffer") for mod in ("numpy.core.numeric", "numpy._core.numeric")),
    *(("numpy", name) for name in ("float16", "float32", "float64", "int32", "int64", "uint32", "bool_")),
}
# Libraries whose objects may sit in `opt_state`: replaced by placeholders, never imported or called.
_INERT_MODULE_ROOTS = ("optax", "jax", "jaxlib", "chex", "flax")


class _Inert:
    """Stands in for an optimiser-state class of the reference; holds its arguments, runs nothing."""

    qualname = "?"

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.args = args
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"<inert {self.qualname}>"


class _ReferenceUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module.split(".")[0] in _INERT_MODULE_ROOTS:
            return type(name, (_Inert,), {"qualname": f"{module}.{name}"})
        raise UserError(
            f"{self.source}: refusing to load: the pickle asks for {module}.{name}, which is not a NumPy "
            "array or plain container (a reference checkpoint holds nothing else)"
        )

    def persistent_load(self, pid):
        raise UserError(f"{self.source}: refusing to load: the pickle uses persistent ids")


def load_reference_pickle(path: str | Path) -> dict:
    """Safely read a reference `checkpoint.pkl` (or its directory) into a dict."""
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoint.pkl"
    if not path.is_file():
        raise UserError(f"{path}: no such reference checkpoint (expected checkpoint.pkl or its directory)")
    try:
        with open(path, "rb") as f:
            payload = _ReferenceUnpickler(f, str(path)).load()
    except UserError:
        raise
    except Exception as e:  # truncated or not a pickle at all
        raise UserError(f"{path}: not a readable reference checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("params"), dict):
        raise UserError(f"{path}: expected a dict with a 'params' dict of arrays (the reference checkpoint format)")
    return payload


def read_reference_config(config: str | Path | dict, params: dict | None = None) -> GPNConfig:
    """A `GPNConfig` from the reference run config (a JSON path or dict, model fields under "model").

    GPN vs GPN+M: the memory fields of the config decide; when the parameters are given too they
    must agree with it.
    """
    source = "reference config"
    if not isinstance(config, dict):
        source = str(config)
        try:
            config = read_json(config)
        except FileNotFoundError:
            raise UserError(f"{source}: no such reference JSON config") from None
    model = config.get("model", config)
    if not isinstance(model, dict):
        raise UserError(f"{source}: expected the model fields under 'model'")
    required = ["vocab_size", "d_state", "d_emb", "d_ffn"]
    missing = [k for k in required if k not in model]
    if missing:
        raise UserError(f"{source}: model fields missing: {', '.join(missing)}")
    memory = "n_heads" in model
    if params is not None and ("write_W_k_k" in params) != memory:
        kind = "GPN+M (memory)" if "write_W_k_k" in params else "GPN (no memory)"
        raise UserError(f"{source}: the config and the checkpoint disagree: the parameters are {kind}")
    fields = dict(
        family="gpn_m" if memory else "gpn",
        n_layers=int(model.get("n_layers", 1)),
        use_decoder_bias=bool(model.get("use_decoder_bias", False)),
        **{k: int(model[k]) for k in required},
    )
    if memory:
        fields.update({k: int(model[k]) for k in ("n_heads", "d_key", "d_val")})
    try:
        return GPNConfig(**fields)
    except ValueError as e:
        raise UserError(f"{source}: {e}") from None


def _uses_prefix(cfg: GPNConfig) -> bool:
    return cfg.memory or cfg.n_layers > 1


def reference_name(native: str, cfg: GPNConfig) -> str:
    if not native.startswith("layers."):
        return native
    _, i, rest = native.split(".", 2)
    return f"L{i}_{rest}" if _uses_prefix(cfg) else rest


def _native_names(model: GPN) -> dict[str, str]:
    """reference name -> native name, for every parameter of the model."""
    return {reference_name(n, model.config): n for n, _ in model.named_parameters()}


def from_reference(checkpoint: str | Path, config: str | Path | dict) -> GPN:
    """A native model holding the weights of a reference checkpoint (float32)."""
    params = load_reference_pickle(checkpoint)["params"]
    cfg = read_reference_config(config, params)
    model = GPN(cfg)
    names = _native_names(model)
    missing, unexpected = sorted(set(names) - set(params)), sorted(set(params) - set(names))
    if missing or unexpected:
        raise UserError(
            f"{checkpoint}: parameters do not match the config ({cfg.family}, {cfg.n_layers} layer(s)): "
            f"missing {missing or 'none'}, unexpected {unexpected or 'none'}"
        )
    state = {}
    for ref, native in names.items():
        value = params[ref]
        if not isinstance(value, np.ndarray):
            raise UserError(f"{checkpoint}: parameter {ref} is a {type(value).__name__}, expected a NumPy array")
        expected = tuple(model.get_parameter(native).shape)
        if value.shape != expected:
            raise UserError(f"{checkpoint}: parameter {ref} has shape {value.shape}, the config implies {expected}")
        state[native] = torch.from_numpy(np.asarray(value, dtype=np.float32))
    model.load_state_dict(state)
    return model


def to_reference(model: GPN, grads: bool = False) -> dict[str, np.ndarray]:
    """The model's parameters (or, with grads=True, their `.grad`) in reference names and layout.

    Arrays keep the parameters' dtype (float32 for a trained model).
    """
    out = {}
    for native, p in model.named_parameters():
        t = p.grad if grads else p
        if t is None:
            raise ValueError(f"{native} has no gradient; run backward first")
        out[reference_name(native, model.config)] = t.detach().cpu().numpy().copy()
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="gpn-scale convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("--from-reference", required=True, metavar="CKPT", help="checkpoint.pkl or its directory")
    ap.add_argument("--config", required=True, metavar="JSON", help="the reference run's JSON config")
    ap.add_argument("--out", required=True, metavar="DIR",
                    help="native checkpoint directory to create (must not exist, or be empty)")
    args = ap.parse_args(argv)
    from gpn_scale.storage.native import save_native
    from data_prep.outputs import check_new, new_directory

    check_new(args.out, "--out", "convert")  # before the checkpoint is read: a refusal costs nothing
    model = from_reference(args.from_reference, args.config)
    with new_directory(args.out, "--out", "convert") as staging:
        save_native(model, staging)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out} ({model.config.family}, {model.config.n_layers} layer(s), {n:,} parameters)")
    return 0
