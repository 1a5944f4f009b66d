"""Discoverable config keys: `gpn-scale config keys` lists every key of the training config (and of
each model family's) with its type, default and meaning, taken from the dataclasses the validator
builds; `gpn-scale train ... --print-config` prints the resolved config with each value's origin
(default, the YAML file, or an override) and starts nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml

from gpn_scale.cli import main
from gpn_scale.config import CONFIG_ROOT, describe_keys, field_meanings
from gpn_scale.models import MODEL_FAMILIES
from gpn_scale.train.config import load_train_config, resolve_train_config
from gpn_scale.train.config_view import keys_in, model_keys, training_keys
from support import ROOT

TINY_TRAIN = CONFIG_ROOT / "train" / "gpn_m_tiny.yaml"  # as `gpn_m_tiny` resolves: the origin printed
TINY_MODEL = CONFIG_ROOT / "models" / "gpn_m_tiny.yaml"
ARGS = ["gpn_m_tiny", "run.dir=run", "train.lr=0.001", "model.d_state=48", "train.keep_steps=[2, 4]"]


def gpn_scale(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "gpn_scale", *args], cwd=cwd,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)


def imported(proc: subprocess.CompletedProcess) -> set[str]:
    """The top-level packages the process imported (-X importtime's lines on stderr)."""
    return {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in proc.stderr.splitlines()
            if line.startswith("import time:")}


def commented_origins(text: str) -> dict[str, str]:
    """--print-config's `# ORIGIN` comments by dotted key (a mapping's heading comment under its own key)."""
    origins, path = {}, []
    for line in text.splitlines():
        body, _, comment = line.partition("  # ")
        depth = (len(body) - len(body.lstrip())) // 2
        path[depth:] = [body.strip().split(":")[0]]
        if comment:
            origins[".".join(path)] = comment
    return origins


EXPECTED_ORIGINS = {
    "train.lr": "override",  # key=value
    "train.keep_steps": "override",  # a list: one value
    "train.total_steps": str(TINY_TRAIN),  # the training YAML
    "train.schedule": "default",
    "model.d_state": "override",  # model.FIELD=value
    "model.d_emb": str(TINY_MODEL),  # the model YAML the training YAML names
    "model.core": "default",  # the model config's default
    "precision": str(TINY_TRAIN),
    "seed": str(TINY_TRAIN),
    "logging.wandb": "default",
}


def test_print_config_shows_each_values_origin_and_starts_nothing(tmp_path, monkeypatch):
    proc = gpn_scale("train", *ARGS, "--print-config", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    monkeypatch.chdir(tmp_path)  # data paths resolve against the working directory, as the command's did
    assert yaml.safe_load(proc.stdout) == load_train_config(ARGS[0], ARGS[1:]).to_dict()
    origins = commented_origins(proc.stdout)
    assert {key: origins[key] for key in EXPECTED_ORIGINS} == EXPECTED_ORIGINS, proc.stdout
    assert origins["model"] == f"chosen in {TINY_TRAIN}"
    assert "  lr: 0.001" in proc.stdout and "  keep_steps: [2, 4]" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # no run.dir, nothing else
    assert "deepspeed" not in imported(proc) and "torch" in imported(proc)  # the check sees imports


def test_print_config_json_is_json_alone_on_stdout(tmp_path):
    proc = gpn_scale("train", *ARGS, "model=gpn_m_tiny", "--print-config", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)  # the whole of stdout
    assert {key: printed["origins"][key] for key in EXPECTED_ORIGINS} == EXPECTED_ORIGINS
    assert printed["model_chosen_in"] == "override" and printed["config"]["model"]["d_state"] == 48
    assert set(printed["origins"]) >= {"run.dir", "data.train", "model.family", "profile.steps"}
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["logging.wandb=true", "--print-config"],
     "command-line override: logging.wandb: expected one of online, offline, disabled, got True"),
    (["precision=fp16", "--print-config"], "command-line override: precision: expected one of fp32, bf16, got 'fp16'"),
    (["zero.stage=4"], "command-line override: zero.stage: expected one of 0, 1, 2, 3, got 4"),
    (["model.core=loop", "--print-config"], "command-line override: model.core: expected one of fused, naive, got 'loop'"),
    (["--json"], "--json: prints the config of --print-config; pass --print-config too"),
])
def test_bad_input_to_print_config_is_one_line(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(TINY_TRAIN), "run.dir=run", *argv]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_an_enumerated_value_in_the_yaml_blames_the_file(tmp_path, capsys):
    config = yaml.safe_load(TINY_TRAIN.read_text()) | {"logging": {"wandb": True}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path), "--print-config"]) == 2
    assert capsys.readouterr().err == f"error: {path}: logging.wandb: expected one of online, offline, disabled, got True\n"


def test_origins_follow_the_merge_when_an_override_replaces_an_inline_model(tmp_path):
    """An inline model's values are not the YAML's once `model=NAME` replaces the mapping."""
    config = yaml.safe_load(TINY_TRAIN.read_text()) | {"model": yaml.safe_load(TINY_MODEL.read_text()) | {"bptt": 4}}
    path = tmp_path / "inline.yaml"
    path.write_text(yaml.safe_dump(config))
    inline = resolve_train_config(path, ["run.dir=run"])
    assert (inline.origins.of("model.bptt"), inline.origins.of("model.d_emb"), inline.model_named_in) == \
        (str(path), str(path), None)
    named = resolve_train_config(path, ["run.dir=run", "model=gpn_m_tiny"])
    assert named.config.model.bptt == 0
    assert (named.origins.of("model.bptt"), named.origins.of("model.d_emb"), named.model_named_in) == \
        ("default", str(TINY_MODEL), "override")


def test_every_key_has_a_meaning_and_the_validators_keys_are_listed():
    every = training_keys() + [k for family in MODEL_FAMILIES for k in model_keys(family)]
    assert [k.key for k in every if not k.meaning] == []
    built = load_train_config(TINY_TRAIN, ["run.dir=run"]).to_dict()
    validated = {f"{section}.{key}" if isinstance(values, dict) else section
                 for section, values in built.items() if section != "model"
                 for key in (values if isinstance(values, dict) else [None])}
    listed = {k.key for k in training_keys()}
    assert {k for k in listed if "[]" not in k} == validated | {"model"}
    # a list of sections (a mixture's sources) lists its items' keys
    from dataclasses import fields

    from gpn_scale.train.config import DataSource

    for key in ("data.train", "data.val"):
        assert {k.split("[].")[1] for k in listed if k.startswith(f"{key}[].")} == {f.name for f in fields(DataSource)}
    assert {k.key for k in model_keys("gpn_m")} == {f"model.{key}" for key in built["model"]}
    assert {k.key for k in training_keys() if k.required} == {"model", "run.dir", "data.train"}


def test_enumerated_keys_list_their_allowed_values():
    allowed = {k.key: k.allowed for k in training_keys() + model_keys("gpn_m") if k.allowed}
    assert allowed["logging.wandb"] == ("online", "offline", "disabled")
    assert allowed["precision"] == ("fp32", "bf16") and allowed["zero.stage"] == (0, 1, 2, 3)
    assert allowed["train.schedule"] == ("cosine", "wsd", "constant")
    assert allowed["model.kernel"] == ("auto", "triton", "cpp", "torch")
    # every string key with a closed set of values is one: its refusal lists them
    assert {"train.decay_shape", "model.family", "model.core", "model.memory_form", "model.memory_reads",
            "model.core_projections"} <= set(allowed)


@dataclass
class Source:
    path: str  # where the source is
    weight: float = 1.0


@dataclass
class Example:
    # the comment lines right above a field
    # say what it means
    above: int = 1
    trailing: str = "x"  # a trailing comment wins over the lines above
    sources: str | list[Source] = ""  # one path, or a list of sources
    mode: Literal["a", "b"] | None = None
    bare: bool = False
    tags: list[str] = field(default_factory=list)  # a list's default is its factory's value


def test_meanings_come_from_the_comments_and_lists_of_mappings_list_their_keys():
    assert field_meanings(Example) == {
        "above": "the comment lines right above a field say what it means",
        "trailing": "a trailing comment wins over the lines above", "sources": "one path, or a list of sources",
        "mode": "", "bare": "", "tags": "a list's default is its factory's value"}
    keys = {k.key: k for k in describe_keys(Example, "x.", required=frozenset({"x.bare"}))}
    assert list(keys) == ["x.above", "x.trailing", "x.sources", "x.sources[].path", "x.sources[].weight", "x.mode",
                          "x.bare", "x.tags"]
    assert keys["x.sources"].type == "str | list[mapping]" and keys["x.sources[].path"].required
    assert (keys["x.mode"].type, keys["x.mode"].allowed, keys["x.mode"].default) == ("a | b | null", ("a", "b"), None)
    assert keys["x.bare"].required and not keys["x.above"].required and keys["x.tags"].default == []


def test_config_keys_lists_a_key_through_the_cli(tmp_path):
    proc = gpn_scale("config", "keys", "logging.wandb", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("logging.wandb: online | offline | disabled = disabled\n    online: a wandb run")
    assert "deepspeed" not in imported(proc)


def test_config_keys_sections_json_and_mistakes(capsys):
    assert main(["config", "keys", "model.gdn", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed[0] == {"key": "model.family", "type": "gdn", "allowed": ["gdn"], "default": "gdn", "required": True,
                         "meaning": listed[0]["meaning"]}
    assert {k["key"] for k in listed} == {f"model.{key}" for key in MODEL_FAMILIES["gdn"].config_cls.field_names()}
    assert [k.key for k in keys_in("zero")] == ["zero.stage"] and [k.key for k in keys_in("seed")] == ["seed"]
    for section, message in [("lr", "did you mean train.lr?"), ("trian", "did you mean train?"),
                             ("model.gpx", "did you mean model.gpn?")]:
        assert main(["config", "keys", section]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: config keys: {section}: ") and message in err and err.count("\n") == 1, err
