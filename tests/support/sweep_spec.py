"""A small sweep spec over tests' MDS windows (mds_fixture.write_windows: seq_len 32, vocab 512),
shared by the sweep tests."""

from pathlib import Path

import yaml
from support import ROOT


def write_spec(tmp_path: Path, data: Path, overrides: dict | None = None, **extra) -> Path:
    """tmp_path/spec.yaml: gpn_m_tiny's training config on `data`, 3 sizes of two families; `extra`
    replaces spec keys, `overrides` adds to the training keys every point gets."""
    spec = {
        "train": str(ROOT / "configs" / "train" / "gpn_m_tiny.yaml"),
        "overrides": {"data.train": str(data / "train"), "data.val": str(data / "val"), "train.micro_batch": 4,
                      "eval.batches": 2, **(overrides or {})},
        "families": ["gpn_m_1l", "transformer"], "params": ["40e3", 60000, 90000], "tokens_per_param": [0.05],
        "seq_len": 32, "global_batch": 4, "lr": {"base": 3.0e-3, "ref_params": 6.0e4, "power": 0.5},
        "seeds": [0], "out": str(tmp_path / "sweep"), **extra,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path
