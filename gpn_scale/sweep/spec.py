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
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from gpn_scale.config import build_dataclass, merge, parse_overrides, read_yaml, resolve_config_path, yaml_number
from gpn_scale.errors import UserError
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
    warmup_fraction: float = 0.05
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
            for tpp in spec.tokens_per_param:
                steps = max(1, math.ceil(tpp * params / tokens_per_step))
                for seed in spec.seeds:
                    points.append(Point(
                        name=f"{family}-{_size_label(target)}-x{tpp:g}-s{seed}", family=family, target_params=target,
                        tokens_per_param=tpp, seed=seed, params=params, tokens=steps * tokens_per_step, steps=steps,
                        seq_len=spec.seq_len,
                        lr=spec.lr(params), model=model,
                    ))
    return points


def train_config(spec: SweepSpec, point: Point, run_dir: Path) -> dict:
    """The resolved training config of one point (validated), with run.dir = `run_dir`."""
    from gpn_scale.train.config import load_train_config

    base, _ = _base_train_config(spec)
    train = dict(base.get("train", {}), total_steps=point.steps, global_batch=spec.global_batch, grad_accum=None,
                 lr=point.lr, warmup_steps=max(1, round(spec.warmup_fraction * point.steps)), stop_at_step=None)
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
