"""Native checkpoints: `model.safetensors` (weights, native names) + `model.yaml` (the model config)
+ `manifest.json` (their sizes and xxh3-128 hashes, written last, checked at every load). An
export adds the tokenizer (`tokenizer.json` or `tokenizer.model`) and `tokenizer.yaml`, how the
training data framed each document with it (BOS prepended or not, the EOS that ended it), so a
prompt is framed as the model was trained.

Safetensors holds no code, so the manifest guards integrity (a truncated, corrupted, swapped or
added file), as for training checkpoints. A native checkpoint written before manifests existed still
loads, with a one-line warning that its files are not verified; `add_manifest(DIR)` gives it one.
Reading them is `gpn_scale.storage.checkpoints.load_native`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from data_prep.errors import UserError
from gpn_scale.storage.manifest import files_under, write_manifest

WEIGHTS, CONFIG = "model.safetensors", "model.yaml"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # a Hugging Face tokenizer.json, a sentencepiece .model
TOKENIZER_INFO = "tokenizer.yaml"


@dataclass(frozen=True)
class TokenizerSource:
    """A tokenizer file and how the training data framed each document with it."""

    path: Path
    add_bos: bool = False  # every document began with BOS: so must a prompt
    bos_id: int | None = None
    eos_id: int | None = None  # what ended every document; None: the tokenizer's own, by its usual names

    @property
    def prompt_bos(self) -> int | None:
        """The token to put before a prompt: BOS when the training documents began with it."""
        return self.bos_id if self.add_bos else None


def save_native(model: torch.nn.Module, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, out / WEIGHTS)
    (out / CONFIG).write_text(yaml.safe_dump(model.config.to_dict(), sort_keys=False))
    add_manifest(out)
    return out


def add_manifest(path: str | Path) -> Path:
    """Write (or rewrite) the manifest of a native checkpoint from its files as they are now (all
    of them: a manifest lists every file of its directory)."""
    return write_manifest(path, files_under(path))


def write_tokenizer(tokenizer: TokenizerSource, out: Path) -> list[str]:
    """The tokenizer file and its framing into a native checkpoint; returns the names written."""
    name = "tokenizer.model" if tokenizer.path.suffix == ".model" else "tokenizer.json"  # one of TOKENIZER_FILES
    (out / name).write_bytes(tokenizer.path.read_bytes())
    info = {"file": name, "add_bos": tokenizer.add_bos, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
    (out / TOKENIZER_INFO).write_text(yaml.safe_dump(info, sort_keys=False))
    return [name, TOKENIZER_INFO]


def read_tokenizer(path: str | Path) -> TokenizerSource | None:
    """The tokenizer a native checkpoint keeps beside its weights, if any, with its framing
    (an export written before `tokenizer.yaml` existed: the file alone, no BOS)."""
    path = Path(path)
    info_path = path / TOKENIZER_INFO
    if not info_path.is_file():
        found = [path / name for name in TOKENIZER_FILES if (path / name).is_file()]
        return TokenizerSource(found[0]) if found else None
    try:
        info = yaml.safe_load(info_path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"{info_path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise UserError(f"{info_path}: not UTF-8 text") from None
    except yaml.YAMLError as e:
        raise UserError(f"{info_path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(info, dict):
        raise UserError(f"{info_path}: expected a mapping with file, add_bos, bos_id, eos_id")
    unknown = sorted(set(map(str, info)) - {"file", "add_bos", "bos_id", "eos_id"})
    if unknown:
        raise UserError(f"{info_path}: {unknown[0]}: unknown key (expected file, add_bos, bos_id, eos_id)")
    if info.get("file") not in TOKENIZER_FILES:
        raise UserError(f"{info_path}: file: expected one of {', '.join(TOKENIZER_FILES)}, got {info.get('file')!r}")
    if not isinstance(info.get("add_bos"), bool):
        raise UserError(f"{info_path}: add_bos: expected true or false, got {info.get('add_bos')!r}")
    for key in ("bos_id", "eos_id"):
        value = info.get(key)
        if value is not None and (type(value) is not int or value < 0):
            raise UserError(f"{info_path}: {key}: expected a token id (an integer >= 0) or null, got {value!r}")
    if info["add_bos"] and info.get("bos_id") is None:
        raise UserError(f"{info_path}: add_bos is true but bos_id is null")
    if not (path / info["file"]).is_file():
        raise UserError(f"{path}: {info['file']} is missing ({TOKENIZER_INFO} names it)")
    return TokenizerSource(path / info["file"], info["add_bos"], info.get("bos_id"), info.get("eos_id"))
