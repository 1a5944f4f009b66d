"""Reading what the system writes, for everything that loads a model: evaluation, generation,
analysis, conversion and export, and the trainer when it resumes. Nothing here needs the trainer
(DeepSpeed is imported only to gather a ZeRO-3 checkpoint's shards).

Training checkpoints, under a run's `checkpoints/` (written by `gpn_scale.train.checkpoint_writer`):

    step_00000500/            DeepSpeed's sharded save (model, optimiser and scheduler states)
        trainer_state.json    step, tokens, loader position, world size, ZeRO stage, config
        rng_rank{r}.pt        Python / NumPy / torch RNG states of each rank
        manifest.json         every file above with its size and xxh3-128 hash: written last
        universal/            the world-size-independent form, once converted, with its own manifest
    latest                    the newest complete tag: moved only after its manifest exists
    .leases/                  readers' leases, which rotation respects (`gpn_scale.storage.leases`)

A directory without a manifest (a crash mid-save), whose files no longer match it (truncated,
corrupted) or that holds a file its manifest does not list is not a checkpoint to load. Native
checkpoints (`gpn_scale.storage.native`) are `model.safetensors` + `model.yaml` + `manifest.json`. Every
pickle file is checked and loaded through torch's restricted unpickler (`gpn_scale.storage.safe_load`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from gpn_scale.storage import leases, manifest, safe_load
from gpn_scale.config import model_config, read_yaml, saved_model_keys
from data_prep.errors import UserError
from gpn_scale.models import build_model
from gpn_scale.storage.native import CONFIG, WEIGHTS

MANIFEST, TRAINER_STATE = manifest.MANIFEST, "trainer_state.json"
UNIVERSAL = "universal"  # sub-directory with the world-size-independent form of a checkpoint
# Beside a checkpoint's own files, not listed in its manifest: the universal form (its own manifest
# covers it) and DeepSpeed's pointer to it, written by the conversion and read by nothing here.
DERIVED = (UNIVERSAL, "latest_universal")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(tag: str) -> int:
    return int(tag.split("_")[-1])


def verify(tag_dir: Path) -> str | None:
    """None when the checkpoint is complete and intact, else what is wrong with it."""
    if not (tag_dir / MANIFEST).is_file():
        return "incomplete (no manifest: the save did not finish)"
    return manifest.verify_manifest(tag_dir, besides=DERIVED)


def tags(root: Path) -> list[str]:
    """Checkpoint tags under root, newest first."""
    if not root.is_dir():
        return []
    found = [p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()]
    return sorted(found, key=step_of, reverse=True)


def committed(root: Path) -> list[str]:
    """Tags whose save finished (a manifest exists), newest first; not verified against it."""
    return [t for t in tags(root) if (root / t / MANIFEST).is_file()]


def newest_complete(root: Path, warn=print, rejected: list | None = None) -> str | None:
    """The newest tag that verifies; each one skipped on the way is reported in one line (and
    appended to `rejected` as (tag, problem))."""
    for tag in tags(root):
        problem = verify(root / tag)
        if problem is None:
            return tag
        warn(f"warning: checkpoint {root / tag} skipped: {problem}")
        if rejected is not None:
            rejected.append((tag, problem))
    return None


def training_checkpoint(path: str | Path, warn=lambda message: None, verified: bool = True) -> Path | None:
    """The training checkpoint `path` names, or a run directory's (or its `checkpoints/`) newest
    one: the newest that verifies, or with `verified=False` the newest with a manifest, which costs
    no hashing. None where there is none. `warn` hears of each one skipped.

    The checkpoint is leased until the command ends (`gpn_scale.storage.leases`): rotation in a live run
    does not delete it, and a second call with the same path answers the same checkpoint, so what
    a command reads of it (weights, trainer state) comes from one checkpoint. One that rotation is
    already removing is passed over for the next."""
    path = Path(path)
    known = leases.held(path)
    if known is not None:
        tag_dir, lease, was_verified = known
        if verified and not was_verified:
            problem = verify(tag_dir)
            if problem:
                raise UserError(f"{tag_dir}: {problem}")
            leases.remember(path, tag_dir, lease, True)
        return tag_dir
    if (path / TRAINER_STATE).is_file() or path.name.startswith("step_"):  # a checkpoint, named
        root, candidates, named = path.parent, [path.name], True
    else:
        root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        candidates, named = tags(root), False
    for tag in candidates:
        lease = leases.take(root, tag)
        if lease is None:
            if named:
                raise UserError(f"{path}: no such checkpoint" + (" (rotation, train.keep_last, is removing it: name a "
                                "newer one, or the run directory for its newest)" if path.is_dir() else ""))
            continue
        problem = verify(root / tag) if verified else (None if (root / tag / MANIFEST).is_file() else "no manifest")
        if problem is None:
            leases.remember(path, root / tag, lease, verified)
            return root / tag
        lease.release()
        if named:
            raise UserError(f"{path}: {problem}")
        warn(f"warning: checkpoint {root / tag} skipped: {problem}")
    return None


@dataclass(frozen=True)
class TrainerState:
    """`trainer_state.json`: where a run stood when it saved a checkpoint."""

    step: int
    tokens: int
    loader: dict  # the training data's position (ShuffledBatches.state_dict, or StreamBatches' with carry_state)
    world_size: int
    zero_stage: int
    global_batch: int
    data_seq_len: int | None  # tokens per training window, where known
    config: dict  # the run's resolved config (TrainConfig.to_dict); config["model"] is the model's


def _field(where: Path, raw: dict, key: str, kind: str, low: int = 0, optional: bool = False, within: str = ""):
    value = raw.get(key)
    if value is None and optional:
        return None
    if kind == "int" and (type(value) is not int or value < low):
        raise UserError(f"{where}: {within}{key}: expected an integer >= {low}, got {value!r}")
    if kind == "object" and not isinstance(value, dict):
        raise UserError(f"{where}: {within}{key}: expected a JSON object, got {value!r:.60}")
    return value


def read_trainer_state(tag_dir: Path) -> TrainerState:
    """The checkpoint's trainer state; a one-line UserError naming the file and the field when it is
    not what the trainer writes."""
    where = tag_dir / TRAINER_STATE
    try:
        raw = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{where}: missing (not a training checkpoint)") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a JSON object with step, tokens, loader, world_size, zero_stage, "
                        "global_batch and config")
    loader = _field(where, raw, "loader", "object")
    if loader.get("kind") == "streams":  # train.carry_state: the steps read of every stream (train/carry.py)
        _field(where, loader, "step", "int", within="loader.")
    else:
        for key in ("epoch", "sample_in_epoch"):
            _field(where, loader, key, "int", within="loader.")
        _field(where, loader, "initial_nodes", "int", 1, optional=True, within="loader.")
    config = _field(where, raw, "config", "object")
    if not isinstance(config.get("model"), dict):
        raise UserError(f"{where}: config.model: expected the model's config (a JSON object), got {config.get('model')!r:.60}")
    stage = _field(where, raw, "zero_stage", "int")
    if stage > 3:
        raise UserError(f"{where}: zero_stage: expected 0, 1, 2 or 3, got {stage}")
    return TrainerState(
        step=_field(where, raw, "step", "int"), tokens=_field(where, raw, "tokens", "int"), loader=loader,
        world_size=_field(where, raw, "world_size", "int", 1), zero_stage=stage,
        global_batch=_field(where, raw, "global_batch", "int", 1),
        data_seq_len=_field(where, raw, "data_seq_len", "int", 1, optional=True),
        config=dict(config, model=saved_model_keys(config["model"])))


def load_trained_model(path: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The model of a training checkpoint (`.../checkpoints/step_N`) or of a run directory's newest
    complete checkpoint, in float32, whatever ZeRO stage wrote it (verified and leased by
    `training_checkpoint`)."""
    found = training_checkpoint(path, warn=print)
    if found is None:
        raise UserError(f"{path}: no complete training checkpoint there")
    path = found
    state = read_trainer_state(path)
    model = build_model(model_config(state.config["model"], where=f"{path / TRAINER_STATE}: config.model"))
    safe_load.check_checkpoint(path, besides=DERIVED)  # every pickle file, before any is loaded
    if state.zero_stage == 3:  # parameters are sharded across the ranks' files
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with safe_load.restricted(path):  # zero_to_fp32's own torch.load calls, restricted
            weights = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
    else:
        weights = safe_load.load(path / "mp_rank_00_model_states.pt")["module"]
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    return model.to(device)


@dataclass(frozen=True)
class AdamState:
    """AdamW's state in a training checkpoint, per native parameter name: the first and second
    moments (float32, the parameter's shape) and the number of updates made."""

    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: int


def _universal_tensor(path: Path) -> torch.Tensor:
    """One state of one parameter in DeepSpeed's universal form: the tensor, or (ZeRO 1-2) a dict holding it as "param"."""
    value = safe_load.load(path)
    return value["param"] if isinstance(value, dict) else value


def read_adam_state(path: Path, model: torch.nn.Module) -> AdamState:
    """The AdamW moments of the training checkpoint `path` (a step directory) for `model`'s parameters.

    ZeRO 1-3 (and bf16 at any stage) keep them in flat partitions per rank: DeepSpeed's universal
    conversion, the one a resume on another world size makes, writes them per parameter, here into a
    temporary directory (the checkpoint itself is not written to). ZeRO 0 in fp32 keeps torch's AdamW
    state in the model-states file, its parameters numbered in the order of the family's parameter
    groups (`ModelSpec.param_groups`: decayed, then not), as the trainer built the optimiser. Every
    file is scanned before anything unpickles it.
    """
    import tempfile

    from gpn_scale.models import MODEL_FAMILIES

    safe_load.check_checkpoint(path)  # before DeepSpeed's conversion unpickles the shards unrestricted
    names = {id(p): n for n, p in model.named_parameters()}
    shapes = {n: p.shape for n, p in model.named_parameters()}
    if not any(path.glob("*optim_states.pt")):  # ZeRO 0, fp32: torch's own optimiser state
        saved = safe_load.load(path / "mp_rank_00_model_states.pt").get("optimizer")
        if not saved or "state" not in saved:
            raise UserError(f"{path / 'mp_rank_00_model_states.pt'}: holds no optimiser state")
        groups = MODEL_FAMILIES[model.config.family].param_groups(model)
        order = [names[id(p)] for p in [*groups.decay, *groups.no_decay]]
        numbered = [i for group in saved["param_groups"] for i in group["params"]]
        if len(numbered) != len(order):
            raise UserError(f"{path}: the optimiser state has {len(numbered)} parameters, the model {len(order)}")
        states = {order[k]: saved["state"].get(i, {}) for k, i in enumerate(numbered)}
        moments = {key: {n: st[key].float().reshape(shapes[n]) for n, st in states.items() if key in st}
                   for key in ("exp_avg", "exp_avg_sq")}
        steps = {int(st["step"]) for st in states.values() if "step" in st}
        return AdamState(moments["exp_avg"], moments["exp_avg_sq"], max(steps, default=0))
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    with tempfile.TemporaryDirectory(prefix="gpn-scale-adam-") as tmp:  # ours alone, gone after
        out = Path(tmp) / "universal"
        with contextlib.redirect_stdout(sys.stderr):  # its progress lines: stdout is the command's own
            ds_to_universal(argparse.Namespace(input_folder=str(path), output_folder=str(out), num_extract_workers=1,
                                               num_merge_workers=1, keep_temp_folder=False, strict=True,
                                               inject_missing_state=True))  # unpickles the shards: scanned above
        moments = {key: {} for key in ("exp_avg", "exp_avg_sq")}
        steps = set()
        for name, shape in shapes.items():
            folder = out / "zero" / name
            for key in moments:
                if (folder / f"{key}.pt").is_file():
                    moments[key][name] = _universal_tensor(folder / f"{key}.pt").float().reshape(shape)
            if (folder / "step.pt").is_file():
                steps.add(int(_universal_tensor(folder / "step.pt")))
        if not steps and (out / "zero" / "optimizer_state.pt").is_file():  # ZeRO-3: one count per group, kept there
            common = safe_load.load(out / "zero" / "optimizer_state.pt").get("optimizer_state_dict") or {}
            steps = {int(st["step"]) for st in common.get("state", {}).values() if "step" in st}
    return AdamState(moments["exp_avg"], moments["exp_avg_sq"], max(steps, default=0))


# ---- native checkpoints ----------------------------------------------------------------------


def check_manifest(path: Path) -> None:
    """UserError unless the files match the manifest; a checkpoint without one: a warning (and no
    symlink leading out of it, which holds either way)."""
    if not (path / MANIFEST).is_file():
        outside = manifest.link_outside(path)
        if outside:
            raise UserError(f"{path}: {outside}")
        print(f"warning: {path} has no {MANIFEST} (written before native checkpoints had one): its files are "
              "not verified; gpn_scale.storage.native.add_manifest(DIR) writes one", file=sys.stderr)
        return
    problem = manifest.verify_manifest(path, required=(WEIGHTS, CONFIG))
    if problem:
        raise UserError(f"{path}: {problem}")


def load_native(path: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    path = Path(path)
    for name in (WEIGHTS, CONFIG):
        if not (path / name).is_file():
            raise UserError(f"{path}: not a native checkpoint (missing {name})")
    check_manifest(path)
    cfg = model_config(saved_model_keys(read_yaml(path / CONFIG)), where=str(path / CONFIG))
    with torch.device("meta"):
        model = build_model(cfg)
    try:
        state = load_file(path / WEIGHTS, device=str(device))
    except SafetensorError as e:
        raise UserError(f"{path / WEIGHTS}: unreadable weights ({e})") from None
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as e:
        first = str(e).splitlines()[1].strip() if "\n" in str(e) else str(e)
        raise UserError(f"{path / WEIGHTS}: weights do not match {CONFIG}: {first}") from None
    return model


def load_model(path: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Any model the system writes: a native checkpoint (model.safetensors + model.yaml), a training
    checkpoint directory, or a run directory (its newest complete checkpoint)."""
    path = Path(path)
    if (path / WEIGHTS).is_file():
        return load_native(path, device)
    return load_trained_model(path, device)
