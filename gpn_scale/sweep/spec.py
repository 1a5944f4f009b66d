"""A sweep spec (YAML) and the points it expands to: one training run per
(family, target parameters, tokens per parameter, seed).

```yaml
train: demo                  # the base training config; each point replaces its model and schedule
overrides: {data.train: runs/demo/data/train, data.val: runs/demo/data/val}
families: [gpn_m_1l, transformer]      # sizing rules: gpn_m_1l gpn_m_2l gpn_1l transformer gdn
params: [30e3, 60e3, 120e3, 240e3]     # target parameter counts (total, embedding included)
tokens_per_param: [2]        # token budgets, as multiples of the parameter count
seq_len: 128                 # tokens per window of the data
global_batch: 16             # windows per optimiser step
lr: {base: 3.0e-3, ref_params: 1.0e5, power: 0.0}   # lr = base * (params / ref_params) ** -power
seeds: [0]
```

Each point gets a directory `OUT/<family>-<size>-x<tokens per param>-s<seed>/` holding `train.yaml`
(the resolved training config, run.dir = that directory) and `point.json` (what the point is).

With `schedule: wsd` (warm-up, stable, decay) the budgets of one (family, size, seed) share one
run: the largest budget is trained in full (its *trunk*), saving a kept checkpoint where each
smaller budget's decay starts, and each smaller budget is a decay branch from that checkpoint
(`gpn-scale train --branch-from`): its decay alone is trained, `decay_fraction` of its steps.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from gpn_scale.config import build_dataclass, merge, parse_overrides, read_yaml, resolve_config_path, yaml_number
from data_prep.errors import UserError
from gpn_scale.sweep import sizing


@dataclass
class LRRule:
    base: float = 6e-4  # the paper's 130M recipe, at ref_params
    ref_params: float = 1.3e8
    power: float = 0.0  # 0: one lr for every size

    def __call__(self, params: int) -> float:
        return self.base * (params / self.ref_params) ** -self.power


@dataclass
class SlurmSection:
    script: str = "launchers/slurm/train.sbatch"
    sbatch_args: list = field(default_factory=list)  # e.g. [--nodes=2, --time=12:00:00, --partition=gpu]
    chain: bool = False  # each point's job waits for the previous one (--dependency=afterany)


@dataclass
class SweepSpec:
    train: str = ""
    overrides: dict = field(default_factory=dict)  # dotted keys, applied to every point
    families: list = field(default_factory=list)
    params: list = field(default_factory=list)
    tokens_per_param: list = field(default_factory=lambda: [20.0])
    seq_len: int = 0
    global_batch: int = 0
    warmup_fraction: float = 0.05  # of each point's steps (wsd: of the size's smallest budget, shared by its points)
    schedule: Literal["cosine", "wsd"] = "cosine"
    decay_fraction: float = 0.2  # wsd: each budget's decay, this share of its steps
    decay_shape: Literal["linear", "1-sqrt"] = "1-sqrt"  # wsd
    seeds: list = field(default_factory=lambda: [0])
    vocab_size: int | None = None  # default: the base config's model's
    model: dict = field(default_factory=dict)  # per family: model keys every size shares (bptt, ...)
    out: str = ""  # default: runs/sweeps/<spec file name>
    lr: LRRule = field(default_factory=LRRule)
    slurm: SlurmSection = field(default_factory=SlurmSection)

    def __post_init__(self):
        for name in ("params", "tokens_per_param"):  # YAML 1.1 reads 300e3 as a string
            value = getattr(self, name)
            if isinstance(value, list):
                setattr(self, name, [yaml_number(v) if isinstance(v, str) and yaml_number(v) else v for v in value])
        if not self.train:
            raise ValueError("train: missing (the base training config)")
        for name, kind in (("families", str), ("params", (int, float)), ("tokens_per_param", (int, float)),
                           ("seeds", int)):
            value = getattr(self, name)
            if not isinstance(value, list) or not value or not all(isinstance(v, kind) and not isinstance(v, bool)
                                                                   for v in value):
                raise ValueError(f"{name}: expected a non-empty list of {getattr(kind, '__name__', 'numbers')}, "
                                 f"got {value!r}")
        unknown = [f for f in self.families if f not in sizing.RULES]
        if unknown:
            raise ValueError(f"families: {unknown[0]!r} is not one of {', '.join(sizing.RULES)}")
        for name in ("params", "tokens_per_param"):
            bad = [v for v in getattr(self, name) if not (math.isfinite(v) and v > 0)]  # YAML's .nan, .inf
            if bad:
                raise ValueError(f"{name}: expected finite positive numbers, got {bad[0]!r}")
        if not isinstance(self.model, dict) or any(f not in sizing.RULES or not isinstance(v, dict)
                                                   for f, v in self.model.items()):
            raise ValueError(f"model: expected a mapping of family -> model keys (families: {', '.join(sizing.RULES)})")
        for name in ("seq_len", "global_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer (tokens per step = seq_len x global_batch)")
        if not 0 < self.decay_fraction < 1:
            raise ValueError(f"decay_fraction: expected a number in (0, 1), got {self.decay_fraction}")


def load_spec(path: str | Path) -> tuple[SweepSpec, Path]:
    """The validated spec and its output directory."""
    path = resolve_config_path(path, "sweeps")
    data, where = read_yaml(path), str(path)
    sections = {}
    for name, cls in (("lr", LRRule), ("slurm", SlurmSection)):
        value = data.pop(name, {})
        if not isinstance(value, dict):
            raise UserError(f"{where}: {name}: expected a mapping, got {type(value).__name__}")
        sections[name] = build_dataclass(cls, value, where, prefix=f"{name}.")
    spec = build_dataclass(SweepSpec, {**data, **sections}, where)
    return spec, Path(spec.out or Path("runs") / "sweeps" / path.stem)


@dataclass
class Point:
    name: str
    family: str
    target_params: float
    tokens_per_param: float
    seed: int
    params: int
    tokens: int
    steps: int
    seq_len: int
    lr: float
    model: dict
    warmup_steps: int = 0
    decay_steps: int | None = None  # wsd: the steps of this point's decay
    keep_steps: list = field(default_factory=list)  # wsd trunk: where its branches start (kept checkpoints)
    branch_of: str | None = None  # wsd branch: the trunk point it starts from, at step branch_step
    branch_step: int | None = None

    def trained_steps(self) -> int:
        """The steps this point trains itself: all of them, or a branch's decay alone."""
        return self.steps - (self.branch_step or 0)


def _size_label(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n:.0f}"


def _base_train_config(spec: SweepSpec) -> tuple[dict, Path]:
    path = resolve_config_path(spec.train, "train")
    base = merge(read_yaml(path), parse_overrides([f"{k}={v}" for k, v in spec.overrides.items()]))
    return base, path


def plan(spec: SweepSpec) -> list[Point]:
    """Every point of the sweep, sized and scheduled (no files written)."""
    from gpn_scale.config import model_config

    base, path = _base_train_config(spec)
    vocab = spec.vocab_size
    if vocab is None:
        model = base.get("model")
        if isinstance(model, str) and not Path(model).is_absolute() and (path.parent / model).exists():
            model = path.parent / model
        vocab = model_config(model, where=f"{path}: model").vocab_size
    tokens_per_step = spec.seq_len * spec.global_batch
    points, sized = [], {}
    for family in spec.families:
        for target in spec.params:
            if (family, target) not in sized:
                sized[family, target] = sizing.size(family, target, vocab, **spec.model.get(family, {}))
            model, params = sized[family, target]
            budgets = {tpp: max(1, math.ceil(tpp * params / tokens_per_step)) for tpp in spec.tokens_per_param}
            for seed in spec.seeds:
                same = [Point(name=f"{family}-{_size_label(target)}-x{tpp:g}-s{seed}", family=family,
                              target_params=target, tokens_per_param=tpp, seed=seed, params=params,
                              tokens=steps * tokens_per_step, steps=steps, seq_len=spec.seq_len, lr=spec.lr(params),
                              model=model, warmup_steps=max(1, round(spec.warmup_fraction * steps)))
                        for tpp, steps in budgets.items()]
                points += _decay_branches(spec, same) if spec.schedule == "wsd" else same
    return points


def _decay_branches(spec: SweepSpec, same: list[Point]) -> list[Point]:
    """One size's budgets as a WSD trunk (the largest, first) and decay branches from it: every
    point warms up as the smallest budget does, and decays over `decay_fraction` of its steps."""
    same = sorted(same, key=lambda p: p.steps)
    warmup = same[0].warmup_steps
    for p in same:
        p.warmup_steps, p.decay_steps = warmup, max(1, round(spec.decay_fraction * p.steps))
        if p.steps - p.decay_steps < warmup:
            raise UserError(f"tokens_per_param: {p.tokens_per_param:g} is {p.steps} steps at {p.name}: its decay of "
                            f"{p.decay_steps} would start inside the warm-up of {warmup} (lower warmup_fraction or "
                            f"decay_fraction, or raise the budget)")
    trunk, branches = same[-1], same[:-1]
    for p in branches:
        p.branch_of, p.branch_step = trunk.name, p.steps - p.decay_steps
    trunk.keep_steps = sorted({p.branch_step for p in branches})
    return [trunk, *branches]


def train_flops(model: dict, seq_len: int, tokens: int) -> float:
    """Training FLOPs of `tokens` tokens of a point's model (Point.model, as point.json keeps it: perhaps
    written before a key was renamed) in windows of `seq_len`."""
    from gpn_scale.config import model_config, saved_model_keys
    from gpn_scale.models import build_model
    from gpn_scale.train.metrics import flops_per_token
    import torch

    with torch.device("meta"):
        built = build_model(model_config(saved_model_keys(model), where="point.json: model"))
    return flops_per_token(built, seq_len) * tokens


def plan_cost(points: list[Point]) -> tuple[float, float]:
    """Training FLOPs of the plan as scheduled, and of one run per point from scratch."""
    per_token = {}
    scheduled = separate = 0.0
    for p in points:
        key = (p.family, p.params)
        if key not in per_token:
            per_token[key] = train_flops(p.model, p.seq_len, 1)
        tokens_per_step = p.tokens / p.steps
        scheduled += per_token[key] * p.trained_steps() * tokens_per_step
        separate += per_token[key] * p.tokens
    return scheduled, separate


def train_config(spec: SweepSpec, point: Point, run_dir: Path) -> dict:
    """The resolved training config of one point (validated), with run.dir = `run_dir`."""
    from gpn_scale.train.config import load_train_config

    base, _ = _base_train_config(spec)
    train = dict(base.get("train", {}), total_steps=point.steps, global_batch=spec.global_batch, grad_accum=None,
                 lr=point.lr, warmup_steps=point.warmup_steps, stop_at_step=None)
    if point.decay_steps is None:
        train.update(schedule="cosine", decay_steps=None, decay_fraction=None)
    else:
        train.update(schedule="wsd", decay_steps=point.decay_steps, decay_fraction=None, decay_shape=spec.decay_shape,
                     keep_steps=point.keep_steps)
    train["save_every"] = min(train.get("save_every", point.steps), point.steps)
    config = merge(base, {"model": point.model, "run": {"dir": str(run_dir), "name": point.name},
                          "train": train, "seed": point.seed})
    return load_train_config(config).to_dict()


def write_point(spec: SweepSpec, point: Point, out: Path) -> Path:
    run_dir = out / point.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "train.yaml").write_text(yaml.safe_dump(train_config(spec, point, run_dir), sort_keys=False))
    (run_dir / "point.json").write_text(json.dumps(asdict(point), indent=1) + "\n")
    return run_dir
