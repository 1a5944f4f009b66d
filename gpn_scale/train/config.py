"""The training run's config: one YAML file, validated, with dotted command-line overrides.

Every key has a default except `model`, `data.train` and `run.dir`; unknown keys and wrong types
are one-line errors naming the key (and the nearest valid one), blaming the command-line override
when one is at fault. The resolved config (with the model config inlined and local data paths made
absolute) is saved as `run.dir/config.yaml`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gpn_scale.config import (OVERRIDDEN, OVERRIDE, Origins, build_dataclass, dataclass_keys, merge, model_config,
                              parse_overrides, read_yaml, resolve_config_path, unknown_key)
from data_prep.errors import UserError
from gpn_scale.models import MODEL_FAMILIES, GPNConfig, ModelConfig


@dataclass
class RunSection:
    dir: str = ""  # where checkpoints, metrics.jsonl, config.yaml and wandb go: a new or empty directory, or this run's
    name: str = ""  # for wandb; default: the directory's name


@dataclass
class DataSource:
    """One source of a mixture (`data.train` or `data.val` given as a list of these)."""

    path: str = ""  # a prep output's split (OUT/train, OUT/val) or a remote URL, as data.train takes one
    # in the metrics (mix/NAME, val_loss/NAME); default: the prep output's directory name (OUT of OUT/train)
    name: str = ""
    # the source's weight, one kind for all of data.train's sources (MosaicML Streaming's Stream weights):
    proportion: float | None = None  # its share of each epoch's samples (normalised over the sources), or
    repeat: float | None = None  # its samples each epoch, times this (2.0 upsamples, 0.5 subsamples), or
    choose: int | None = None  # this many of its samples each epoch; none: all of its samples once

    def __post_init__(self):
        if not self.path:
            raise ValueError("path: missing (a prep output's split directory or URL)")
        given = [k for k in ("proportion", "repeat", "choose") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[1]}: give one of proportion, repeat or choose, not {' and '.join(given)}")
        for key in ("proportion", "repeat"):
            value = getattr(self, key)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{key}: expected a finite number > 0, got {value}")
        if self.choose is not None and self.choose < 1:
            raise ValueError(f"choose: expected a number of samples >= 1, got {self.choose}")
        if not self.name:
            self.name = default_source_name(self.path)

    def weight(self) -> str:
        """How it is weighted, for the start-up line: `proportion 0.7`, `repeat 2.0`, `choose 1000`, `all once`."""
        for key in ("proportion", "repeat", "choose"):
            if getattr(self, key) is not None:
                return f"{key} {getattr(self, key)}"
        return "all once"


def default_source_name(path: str) -> str:
    """OUT for a prep output's OUT/train or OUT/val (OUT/streams/train too), else the last path element."""
    parts = [p for p in path.rstrip("/").split("/") if p]
    while len(parts) > 1 and parts[-1] in ("train", "val", "streams"):
        parts.pop()
    return parts[-1] if parts else path


def sources(location: str | list[DataSource] | None) -> list[DataSource]:
    """data.train or data.val as a list of sources: one for a single directory or URL."""
    if location is None:
        return []
    if isinstance(location, str):
        return [DataSource(path=location)]
    return list(location)


@dataclass
class DataSection:
    # MDS directory (the prep's OUT/train) or a remote URL (then `cache` is the local copy); or a mixture, a
    # list of sources [{path, name, proportion | repeat | choose}, ...] sharing one tokenizer (DataSource)
    train: str | list[DataSource] = ""
    # the held-out windows: a directory or URL, or a list of sources (weights unused), each scored on its
    # own (val_loss/NAME) besides val_loss over all of them
    val: str | list[DataSource] | None = None
    cache: str | None = None  # local cache root for remote datasets
    shuffle: bool = True  # Streaming's shuffle of the sample order, seeded by seed
    num_canonical_nodes: int = 1  # fixes the global sample order whatever the world size
    log_sample_ids: bool = False  # write samples.jsonl: the global sample ids of every optimiser step


DEFAULT_DECAY_FRACTION = 0.2  # train.schedule=wsd without decay_steps or decay_fraction


@dataclass
class TrainSection:
    total_steps: int = 10_000  # optimiser steps; the LR schedule follows this
    stop_at_step: int | None = None  # end early (with a checkpoint) exactly as a preemption would
    micro_batch: int = 8  # windows per rank per forward
    grad_accum: int | None = None  # micro-batches per optimiser step and rank (give this or global_batch; default 1)
    global_batch: int | None = None  # windows per optimiser step, kept at any world size (grad_accum follows it)
    save_every: int = 500  # a checkpoint every this many optimiser steps
    keep_last: int = 3  # complete checkpoints kept (the newest ones)
    # optimiser steps also checkpointed, never removed by keep_last's rotation: the stable phase's
    # checkpoints that decay branches start from (`gpn-scale train --branch-from`)
    keep_steps: list[int] = field(default_factory=list)
    lr: float = 6e-4  # the peak learning rate, reached at the end of the linear warm-up
    # the learning rate after the linear warm-up (gpn_scale/train/optim.py: lr_factor): a cosine to
    # lr * min_lr_ratio at total_steps; wsd: constant, then a decay over the last decay_steps steps to
    # lr * min_lr_ratio at the last step; constant: lr to the end
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    min_lr_ratio: float = 0.1  # the schedule's floor: lr * min_lr_ratio
    warmup_steps: int = 100  # optimiser steps of the linear warm-up to lr
    decay_steps: int | None = None  # wsd: optimiser steps of the decay (give this, decay_fraction or neither)
    decay_fraction: float | None = None  # wsd: the decay as a share of total_steps (default 0.2)
    decay_shape: Literal["linear", "1-sqrt"] = "1-sqrt"  # wsd: the decay's shape (1-sqrt as Hagele et al. 2024)
    weight_decay: float = 0.1  # AdamW's decoupled weight decay, on matrices only (ndim >= 2)
    beta1: float = 0.9  # AdamW's decay of the gradient's running mean
    beta2: float = 0.95  # AdamW's decay of the squared gradient's running mean
    adam_eps: float = 1e-8  # AdamW's epsilon
    grad_clip: float = 1.0  # the global gradient norm is clipped to this before each update (0: no clipping)
    nonfinite_patience: int = 0  # non-finite loss or grad norm: steps tolerated in a row before the run stops
    # each batch slot reads one of the prep's streams window after window (data.train: OUT/streams/train), and
    # the recurrent state ending a window starts the next (gradients stop at the boundary): gpn_scale/train/carry.py
    carry_state: bool = False
    # the state after each EOS token is the empty one, so every document is read from its start alone (the
    # EOS id is the prep's, from stats.json beside data.train): gpn_scale/models/resets.py
    reset_on_eos: bool = False

    def __post_init__(self):
        for name in ("total_steps", "micro_batch", "save_every", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        for name, low, high in (("lr", 0.0, math.inf), ("min_lr_ratio", 0.0, 1.0), ("weight_decay", 0.0, math.inf),
                                ("beta1", 0.0, 1.0), ("beta2", 0.0, 1.0), ("grad_clip", 0.0, math.inf)):
            value = getattr(self, name)
            open_high = name.startswith("beta")  # Adam with a beta of 1 never updates its moments
            if not (math.isfinite(value) and low <= value <= high) or (name == "lr" and value == 0) or (open_high and value == high):
                expected = "a finite number > 0" if name == "lr" else f"a finite number in [{low}, {high}{')' if open_high else ']'}"
                raise ValueError(f"{name}: expected {expected}, got {value}")
        for name in ("warmup_steps", "nonfinite_patience"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if self.grad_accum is not None and self.global_batch is not None:
            raise ValueError("grad_accum: give grad_accum or global_batch, not both")
        if self.stop_at_step is not None and not 1 <= self.stop_at_step <= self.total_steps:
            raise ValueError(f"stop_at_step: expected in [1, total_steps={self.total_steps}], got {self.stop_at_step}")
        if not (math.isfinite(self.adam_eps) and self.adam_eps > 0):
            raise ValueError(f"adam_eps: expected a finite number > 0, got {self.adam_eps}")
        outside = [s for s in self.keep_steps if not 1 <= s <= self.total_steps]
        if outside:
            raise ValueError(f"keep_steps: expected optimiser steps in [1, total_steps={self.total_steps}], got {outside[0]}")
        self._check_decay()

    def _check_decay(self) -> None:
        if self.schedule != "wsd":
            for name in ("decay_steps", "decay_fraction"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: only train.schedule=wsd has a decay phase (schedule is {self.schedule}); "
                                     "remove it, or set train.schedule=wsd")
            return
        if self.decay_steps is not None and self.decay_fraction is not None:
            raise ValueError("decay_steps: give train.decay_steps or train.decay_fraction, not both")
        if self.decay_fraction is not None and not 0 < self.decay_fraction <= 1:
            raise ValueError(f"decay_fraction: expected a number in (0, 1], got {self.decay_fraction}")
        room = self.total_steps - self.warmup_steps
        steps = self.decay_length()
        if not 1 <= steps <= room:
            if self.decay_steps is not None:
                raise ValueError(f"decay_steps: expected in [1, total_steps - warmup_steps = {room}], got {steps}")
            fraction = DEFAULT_DECAY_FRACTION if self.decay_fraction is None else self.decay_fraction
            raise ValueError(f"decay_fraction: {fraction} of total_steps={self.total_steps} is {steps} decay steps; "
                             f"expected 1 to total_steps - warmup_steps = {room}")

    def decay_length(self) -> int | None:
        """wsd: the optimiser steps of the decay, the last ones of the run (decay_steps, or decay_fraction
        of total_steps rounded to the nearest step, half up); None for the other schedules."""
        if self.schedule != "wsd":
            return None
        if self.decay_steps is not None:
            return self.decay_steps
        fraction = DEFAULT_DECAY_FRACTION if self.decay_fraction is None else self.decay_fraction
        return math.floor(fraction * self.total_steps + 0.5)


@dataclass
class ZeroSection:
    # DeepSpeed ZeRO's stage: 0 replicates everything; 1 shards the optimiser state across the ranks, 2 also the
    # gradients, 3 also the parameters
    stage: Literal[0, 1, 2, 3] = 2


@dataclass
class EvalSection:
    every: int = 0  # validation every this many steps (0: only at the end)
    # held-out windows per evaluation, in micro-batches (eval.batches x train.micro_batch windows): the val
    # split's first ones, the same at any world size, split across the ranks (gpn_scale/train/validation.py)
    batches: int = 16


WANDB_TAG_MAX = 64  # characters: wandb refuses longer tags


@dataclass
class LoggingSection:
    # online: a wandb run synced as it goes; offline: a wandb run inside run.dir/wandb, synced later (`wandb sync`)
    wandb: Literal["online", "offline", "disabled"] = "disabled"
    project: str = "gpn-scale"  # the wandb project the run goes to (its name there is run.name)
    wandb_entity: str | None = None  # the wandb team or user the run goes to (default: wandb's own)
    wandb_group: str | None = None  # groups runs in wandb's UI (a sweep, the ranks of an experiment)
    wandb_tags: list[str] = field(default_factory=list)  # the run's wandb tags: distinct, 1 to 64 characters each
    peak_tflops: float | None = None  # per device, for MFU; default: known GPUs, none on CPU
    tensorboard: bool = False  # TensorBoard event files in run.dir/tensorboard with metrics.jsonl's scalars

    def __post_init__(self):
        for name in ("project", "wandb_entity", "wandb_group"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"{name}: expected a non-empty name, got {value!r}")
        for i, tag in enumerate(self.wandb_tags):
            if not tag.strip() or len(tag) > WANDB_TAG_MAX:
                raise ValueError(f"wandb_tags: expected tags of 1 to {WANDB_TAG_MAX} characters, got {tag!r} "
                                 f"(item {i})")
        if len(set(self.wandb_tags)) != len(self.wandb_tags):
            twice = next(t for t in self.wandb_tags if self.wandb_tags.count(t) > 1)
            raise ValueError(f"wandb_tags: {twice!r} given twice")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"peak_tflops: expected a number of TFLOP/s per device > 0, got {self.peak_tflops}")
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("tensorboard: needs the tensorboard package, which is not installed here "
                             "(pip install gpn-scale[tensorboard]), or set logging.tensorboard=false")


@dataclass
class ProfileSection:
    # [A, B]: a torch.profiler trace of optimiser steps A to B (both included) on each rank, as Chrome/Perfetto
    # trace JSON in run.dir/profile (gpn_scale/train/profiling.py); [] profiles nothing
    steps: list[int] = field(default_factory=list)
    # CUDA only: record the allocator's history from the launch's start and dump a snapshot at the end of this
    # optimiser step (and at an out-of-memory) into run.dir/profile; refused on a CPU run
    memory_snapshot_step: int | None = None

    def __post_init__(self):
        if self.steps and (len(self.steps) != 2 or not 1 <= self.steps[0] <= self.steps[1]):
            raise ValueError(f"steps: expected [first, last], two optimiser steps with 1 <= first <= last, "
                             f"got {self.steps}")
        if self.memory_snapshot_step is not None and self.memory_snapshot_step < 1:
            raise ValueError(f"memory_snapshot_step: expected an optimiser step >= 1, got {self.memory_snapshot_step}")


@dataclass
class TrainConfig:
    # the model: a model YAML path (relative to this file), a configs/models name, or a mapping with its family;
    # `gpn-scale config keys model.FAMILY` lists its keys. Held as the family's validated config from here on.
    model: ModelConfig
    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    zero: ZeroSection = field(default_factory=ZeroSection)
    eval: EvalSection = field(default_factory=EvalSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    profile: ProfileSection = field(default_factory=ProfileSection)
    # bf16: autocast, while master weights, optimiser, state and M stay float32; fp32: float32 throughout
    precision: Literal["fp32", "bf16"] = "bf16"
    seed: int = 0  # initial weights and data order

    def to_dict(self) -> dict:
        """The config as plain mappings, the model's included: what config.yaml and trainer_state.json
        hold, --print-config prints and a resume compares with a checkpoint's."""
        return dataclasses.asdict(self)


# Keys without a usable default: a config that leaves one out is refused (`KEY: missing`).
REQUIRED = ("model", "run.dir", "data.train")

_SECTIONS = {"run": RunSection, "data": DataSection, "train": TrainSection, "zero": ZeroSection,
             "eval": EvalSection, "logging": LoggingSection, "profile": ProfileSection}
_TOP_LEVEL = {"model", "precision", "seed", *_SECTIONS}


def _check_override_keys(overrides: dict) -> None:
    """A mistyped key=value argument is blamed as such, not the YAML file it overrides."""
    for key, value in overrides.items():
        if key not in _TOP_LEVEL:
            raise unknown_key(OVERRIDE, key, _TOP_LEVEL)
        if key in _SECTIONS and isinstance(value, dict):
            known = dataclass_keys(_SECTIONS[key])
            unknown = sorted(set(value) - known)
            if unknown:
                raise unknown_key(OVERRIDE, unknown[0], known, f"{key}.")


def load_train_config(source: str | Path | dict, overrides: list[str] | dict | None = None) -> TrainConfig:
    """Validated config from a YAML path (or dict) plus `dotted.key=value` overrides."""
    return resolve_train_config(source, overrides).config


@dataclass
class ResolvedConfig:
    """A validated training config and where each of its values came from (`--print-config`)."""

    config: TrainConfig
    origins: Origins  # keys spelled as in config.to_dict(); the model's under `model.`
    model_named_in: str | None  # where the model's name or path was given; None for an inline mapping


def resolve_train_config(source: str | Path | dict, overrides: list[str] | dict | None = None) -> ResolvedConfig:
    """`load_train_config`, with the origin of every value: the layers merged are the YAML file, the
    key=value overrides, the model's YAML file where a name or path chose it, and the `model.FIELD=`
    overrides; a value none of them set is its dataclass's default."""
    if isinstance(source, dict):
        data, where, base_dir = dict(source), "config", Path.cwd()
    else:
        path = resolve_config_path(source, "train")
        data, where, base_dir = read_yaml(path), str(path), path.parent
    origins = Origins()
    origins.add(data, where)
    choices = []
    if isinstance(overrides, list):
        # `model=NAME` chooses the model and `model.FIELD=V` overrides its fields, in either order.
        choices = [item for item in overrides if item.partition("=")[0] == "model"]
        overrides = parse_overrides([item for item in overrides if item.partition("=")[0] != "model"])
    overrides = dict(overrides or {})
    model_overrides = overrides.pop("model") if isinstance(overrides.get("model"), dict) else {}
    if choices:  # the last one given; `model=` (nothing) is refused below as a missing model
        overrides["model"] = parse_overrides(choices[-1:])["model"]
    _check_override_keys(overrides)
    data = merge(data, overrides)
    origins.add(overrides, OVERRIDDEN)
    unknown = sorted(set(data) - _TOP_LEVEL)
    if unknown:
        raise unknown_key(where, unknown[0], _TOP_LEVEL)

    model = data.get("model")
    if model is None:
        raise UserError(f"{where}: model: missing (a model YAML path, a configs/models name, or a mapping)")
    model_named_in = None
    if isinstance(model, str):  # relative to the config file, or a configs/models name
        model_path = Path(model) if Path(model).is_absolute() or Path(model).exists() else base_dir / model
        model_file = resolve_config_path(model_path if model_path.exists() else model, "models")
        model_data = read_yaml(model_file)
        model_cfg = model_config(model_data, model_overrides, where=str(model_file), override_prefix="model.")
        model_named_in = origins.of("model")
        origins.add({"model": model_data}, str(model_file))  # the file's mapping in place of its name
    elif isinstance(model, dict):
        model_cfg = model_config(model, model_overrides, where=f"{where}: model", override_prefix="model.")
    else:
        raise UserError(f"{where}: model: expected a path or a mapping, got {type(model).__name__}")
    origins.add(model_overrides, OVERRIDDEN, "model.")

    data_section = data.get("data")
    if isinstance(data_section, dict):  # a source listed as its path alone is {path: ...}
        data = dict(data, data={k: [{"path": s} if isinstance(s, str) else s for s in v]
                                if k in ("train", "val") and isinstance(v, list) else v
                                for k, v in data_section.items()})
    sections = {}
    for name, section_cls in _SECTIONS.items():
        value = data.get(name, {})
        if not isinstance(value, dict):
            raise UserError(f"{OVERRIDE if name in overrides else where}: {name}: expected a mapping, got "
                            f"{type(value).__name__}")
        given = overrides.get(name)
        sections[name] = build_dataclass(section_cls, value, where, prefix=f"{name}.",
                                         overridden=frozenset(given) if isinstance(given, dict) else frozenset())
    top = {k: data[k] for k in ("precision", "seed") if k in data}
    cfg = build_dataclass(TrainConfig, dict(top, model=model_cfg, **sections), where,
                          overridden=frozenset(k for k in top if k in overrides))
    if isinstance(cfg.model, GPNConfig) and cfg.model.recompute_every and cfg.model.core != "naive":
        at = OVERRIDE if model_overrides.keys() & {"recompute_every", "core"} else where
        raise UserError(f"{at}: model.recompute_every: {cfg.model.recompute_every} has no effect with "
                        f"model.core={cfg.model.core} (it segments the naive core's recomputation; the fused core's "
                        "memory follows model.core_chunk): remove it, or set model.core=naive")
    # the baselines only: the others have no compile key
    if getattr(cfg.model, "compile", False) and cfg.zero.stage == 3:
        at = OVERRIDE if "compile" in model_overrides or "stage" in overrides.get("zero", {}) else where
        raise UserError(f"{at}: model.compile: true does not work with zero.stage=3 (ZeRO-3 gathers each layer's "
                        "weights in module hooks that split the compiled blocks into dozens of graphs, past torch's "
                        "recompile limit, the rest running eager): use zero.stage 0, 1 or 2, or model.compile=false")
    family = cfg.model.family
    for key, why in (("carry_state", "carries no state from one window to the next (its context is its window)"),
                     ("reset_on_eos", "has no recurrent state to reset (its attention spans the window)")):
        if getattr(cfg.train, key) and not MODEL_FAMILIES[family].carries_state:
            raise UserError(f"{OVERRIDE if key in overrides.get('train', {}) else where}: train.{key}: the {family} family "
                            f"{why}; use gpn, gpn_m or gdn, or set train.{key}=false")
    for key, value in (("steps", cfg.profile.steps and cfg.profile.steps[1]),
                       ("memory_snapshot_step", cfg.profile.memory_snapshot_step)):
        if value and value > cfg.train.total_steps:
            at = OVERRIDE if key in overrides.get("profile", {}) else where
            raise UserError(f"{at}: profile.{key}: step {value} is past train.total_steps={cfg.train.total_steps}, "
                            "so it would never run")
    for key in REQUIRED[1:]:  # model: refused above, where it is resolved
        section, name = key.split(".")
        if not getattr(getattr(cfg, section), name):
            raise UserError(f"{where}: {key}: missing")
    _check_mixtures(cfg, OVERRIDE if "data" in overrides else where)
    # Local data paths are recorded absolute (config.yaml, trainer_state.json), so eval, generate and
    # analyze find the data and the tokenizer beside it from any directory; URLs stay as given.
    for key in ("train", "val", "cache"):
        value = getattr(cfg.data, key)
        if isinstance(value, list):
            for source in value:
                source.path = _absolute(source.path)
        elif value:
            setattr(cfg.data, key, _absolute(value))
    return ResolvedConfig(cfg, origins, model_named_in)


def _absolute(location: str) -> str:
    return location if "://" in location else str(Path(location).resolve())


def _check_mixtures(cfg: TrainConfig, where: str) -> None:
    """What a list of sources must hold besides each source's own checks (DataSource): names that
    tell the sources apart in the metrics, one kind of weight for all of data.train (Streaming
    weighs them either relatively or absolutely), none in data.val, and no carried state."""
    for split in ("train", "val"):
        listed = getattr(cfg.data, split)
        if not isinstance(listed, list):
            continue
        if not listed:
            raise UserError(f"{where}: data.{split}: expected a directory, a URL or a non-empty list of sources, got []")
        names = [s.name for s in listed]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise UserError(f"{where}: data.{split}: two sources are named {twice!r}: give each its own name "
                            f"(data.{split}[i].name)")
        if split == "val":
            weighted = next((i for i, s in enumerate(listed) if s.weight() != "all once"), None)
            if weighted is not None:
                raise UserError(f"{where}: data.val[{weighted}]: {listed[weighted].weight()}: validation scores each "
                                "source's first windows, unweighted; weights belong to data.train's sources")
            continue
        relative = [s.proportion is not None for s in listed]
        if any(relative) and not all(relative):
            i = relative.index(not relative[0], 1) if len(set(relative)) > 1 else 0
            raise UserError(f"{where}: data.train[{i}]: {listed[i].weight()}, but data.train[0] has {listed[0].weight()}: "
                            "give every source a proportion, or none of them (repeat, choose or all once)")
        if cfg.train.carry_state:
            raise UserError(f"{where}: data.train: a mixture of {len(listed)} sources with train.carry_state=true: a "
                            "carried-state run reads one prep --streams layout (each slot one document stream after "
                            "another); mix the documents at prep time (several inputs to one `gpn-scale prep --streams`), "
                            "or set train.carry_state=false")


# What may differ between a checkpoint's run and its resumption: how the run is executed, observed
# and paced, not what it computes. The world size may change with its micro-batch / accumulation
# split (the engine keeps the global batch); the model's own execution keys are its config's
# EXECUTION_KEYS.
RESUMABLE = ("run.", "data.cache", "data.log_sample_ids", "train.total_steps", "train.stop_at_step",
             "train.micro_batch", "train.grad_accum", "train.global_batch", "train.save_every", "train.keep_last",
             "train.keep_steps", "train.nonfinite_patience", "eval.", "logging.", "profile.")
# What a decay branch (`gpn-scale train --branch-from`) may change besides: the schedule after the
# checkpoint it starts from. The warm-up, the peak lr and everything that decides the run up to that
# checkpoint stay the parent's.
BRANCHABLE = RESUMABLE + ("train.schedule", "train.decay_steps", "train.decay_fraction", "train.decay_shape",
                          "train.min_lr_ratio")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _normalised(key: str, value):
    if key in ("data.train", "data.val"):
        if isinstance(value, str):
            return _absolute(value)
        if isinstance(value, list):  # a mixture's sources, as saved: mappings
            return [dict(s, path=_absolute(s["path"])) if isinstance(s, dict) and "path" in s else s for s in value]
    return value


def config_changes(saved: dict, new: TrainConfig,
                   allowed: tuple[str, ...] = RESUMABLE) -> tuple[list[tuple], list[tuple]]:
    """(safe, unsafe) differences between a checkpoint's resolved config (trainer_state.json's) and this
    run's, each a list of (key, saved value, new value), sorted by key. Safe: the keys (or prefixes) in
    `allowed` (RESUMABLE for a resume, BRANCHABLE for a branch) and the model's execution keys. Keys the
    checkpoint's version did not have are new settings at their defaults, not changes."""
    resumable = allowed + tuple(f"model.{k}" for k in new.model.EXECUTION_KEYS)
    old_flat, new_flat = _flat(saved), _flat(new.to_dict())
    safe, unsafe = [], []
    for key in sorted(old_flat.keys() & new_flat.keys()):
        before, after = _normalised(key, old_flat[key]), _normalised(key, new_flat[key])
        if before != after:
            (safe if key.startswith(resumable) else unsafe).append((key, old_flat[key], new_flat[key]))
    return safe, unsafe
