"""`export --to reference`: the paper's checkpoint format (docs/model.md, "Reference checkpoints").

`checkpoint.pkl` is a pickle of `{"step": int, "params": {reference name: float32 array}}`, made of
NumPy arrays and plain containers only, so the strict unpickler of `gpn-scale convert` (and the
paper's own loader) reads it; there is no optimiser state (`opt_state`) nor data position: it
starts an evaluation or a fine-tune, not a resumption. `config.json` holds the model fields under
"model", with the memory fields only for GPN+M, as the reference writes them.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from gpn_scale.convert import to_reference
from gpn_scale.errors import UserError

CHECKPOINT, CONFIG = "checkpoint.pkl", "config.json"
_MODEL_FIELDS = ("vocab_size", "d_state", "d_emb", "d_ffn", "n_layers", "use_decoder_bias")
_MEMORY_FIELDS = ("n_heads", "d_key", "d_val")


def check_exportable(source) -> None:
    if source.family not in ("gpn", "gpn_m"):
        raise UserError(f"{source.path}: --to reference: the paper's format holds GPN and GPN+M only, this is a "
                        f"{source.family} model; export it with --to native")


def reference_config(cfg) -> dict:
    fields = _MODEL_FIELDS + (_MEMORY_FIELDS if cfg.memory else ())
    return {"model": {k: getattr(cfg, k) for k in fields}}


def write(source, out: Path) -> None:
    payload = {"step": source.step or 0, "params": to_reference(source.model)}
    with open(out / CHECKPOINT, "wb") as f:
        pickle.dump(payload, f, protocol=4)
    (out / CONFIG).write_text(json.dumps(reference_config(source.model.config), indent=1) + "\n")
