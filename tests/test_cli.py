"""The CLI as users know CLIs: --version, help with defaults, overrides after flags, did-you-mean
that blames the override, absolute data paths in a run's config, launchers found from any directory,
and generate's --top-k / EOS stop."""

import argparse
import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
import yaml
from support.eval_fixtures import make_prep, make_tokenizer, tiny_model

from gpn_scale.cli import COMMANDS, main
from gpn_scale.eval.codec import Codec
from gpn_scale.eval.generate import generate_tokens, sampling_probs
from gpn_scale.storage.native import save_native
from gpn_scale.train.config import load_train_config
from support import ROOT

TINY = ROOT / "configs" / "train" / "gpn_m_tiny.yaml"


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"gpn-scale {version('gpn-scale')}\n"


SUBPARSERS = [[name] for name in COMMANDS] + [["prep", "train-tokenizer"], ["prep", "merge"], ["ckpt", "verify"],
                                              ["ckpt", "to-universal"], ["sweep", "collect"],
                                              ["config", "keys"]]


@pytest.mark.parametrize("argv", SUBPARSERS, ids=" ".join)
def test_every_option_has_help_text_showing_its_default(argv, monkeypatch, capsys):
    shown = []
    monkeypatch.setattr(argparse.ArgumentParser, "print_help", lambda self, file=None: shown.append(self))
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    (parser,) = shown
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        assert action.help, f"{' '.join(argv)}: {action.option_strings or action.dest} has no help"
        text = parser.formatter_class(parser.prog)._get_help_string(action)
        if action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS):
            assert "default" in text, f"{' '.join(argv)}: {action.option_strings[0]} does not show its default"


def test_overrides_after_flags(capsys):
    assert main(["launch", str(TINY), "--dry-run", "--nproc", "1", "train.total_steps=7", "run.dir=r"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("+ ") and out.rstrip().endswith("train.total_steps=7 run.dir=r --resume auto")


@pytest.mark.parametrize("argv, kind, given, nearest", [
    (["train", "gpn_m_tin"], "train", "gpn_m_tin", "gpn_m_tiny"),
    (["train", "transformer_tiny.yml"], "train", "transformer_tiny.yml", "transformer_tiny"),
    (["train", "gpn_m_tiny", "model=gpn_m_tin"], "models", "gpn_m_tin", "gpn_m_tiny"),
    (["launch", "gpn_m_tiny", "--dry-run", "model=transfomer_tiny"], "models", "transfomer_tiny", "transformer_tiny"),
    (["model-info", "gdn_tinyy"], "models", "gdn_tinyy", "gdn_tiny"),
    (["sweep", "--dry-run", "cpu_tin"], "sweeps", "cpu_tin", "cpu_tiny"),
])
def test_a_mistyped_bundled_config_name_gets_the_nearest_name(argv, kind, given, nearest, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no file of that name here: the name is a bundled config's
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (ROOT / "configs" / kind / f"{nearest}.yaml").is_file()
    assert err == (f"error: {given}: no such config file (nor {ROOT / 'configs' / kind / Path(given).name}"
                   f"{'' if Path(given).suffix else '.yaml'}); did you mean {nearest}?\n"), err


@pytest.mark.parametrize("argv, kind", [(["train", "nothing_like_it"], "train"),
                                        (["model-info", "nothing_like_it"], "models"),
                                        (["sweep", "--dry-run", "nothing_like_it"], "sweeps")])
def test_a_config_name_near_no_bundled_one_lists_them(argv, kind, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    names = sorted(p.stem for p in (ROOT / "configs" / kind).glob("*.yaml"))
    assert len(names) >= 3 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: nothing_like_it: no such config file (nor ") and "did you mean" not in err
    assert err.endswith(f"; the bundled {kind} configs are: {', '.join(names)}\n"), err


@pytest.mark.parametrize("argv, message", [
    (["train", str(TINY), "--resume", "auto", "train.total_stepz=10"],
     "error: command-line override: train.total_stepz: unknown key; did you mean train.total_steps? expected one of:"),
    (["train", str(TINY), "trian.total_steps=10"],
     "error: command-line override: trian: unknown key; did you mean train? expected one of:"),
    (["launch", str(TINY), "--dry-run", "model.d_stat=3"],
     "error: command-line override: model.d_stat: unknown key; did you mean model.d_state? expected one of:"),
    (["model-info", "gpn_m_tiny", "n_head=3"],
     "error: command-line override: n_head: unknown key; did you mean n_heads? expected one of:"),
])
def test_a_mistyped_override_is_blamed_with_the_nearest_key(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, message", [
    (["train", str(TINY), "train.total_steps=abc"], "error: command-line override: train.total_steps: expected int, got str 'abc'"),
    (["train", str(TINY), "train.lr=-1"], "error: command-line override: train.lr: expected a finite number > 0, got -1.0"),
    (["train", str(TINY), "logging.peak_tflops=.inf"], "error: command-line override: logging.peak_tflops: expected a finite number, got inf"),
    (["train", str(TINY), "model.d_state=x"], "error: command-line override: model.d_state: expected int, got str 'x'"),
    (["train", str(TINY), "seed=1.5"], "error: command-line override: seed: expected int, got float 1.5"),
    (["model-info", "gpn_m_tiny", "d_state=.nan"], "error: command-line override: d_state: expected int, got float nan"),
])
def test_a_wrongly_typed_override_is_blamed_not_the_yaml_file(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == message + "\n", err


@pytest.mark.parametrize("argv, message", [
    (["train", str(TINY), "model.checkpoint_every=8"],
     "error: command-line override: model.checkpoint_every: renamed; use model.recompute_every"),
    (["train", str(TINY), "model=gpn_m_tiny", "model.checkpoint_every=8"],
     "error: command-line override: model.checkpoint_every: renamed; use model.recompute_every"),
    (["model-info", "gpn_m_tiny", "checkpoint_every=8"],
     "error: command-line override: checkpoint_every: renamed; use recompute_every"),
])
def test_the_old_name_of_recompute_every_is_refused_naming_the_new_one(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == message + "\n", err


@pytest.mark.parametrize("order", ["name first", "fields first"])
def test_a_model_chosen_by_name_takes_field_overrides_in_either_order(order):
    from gpn_scale.train.config import load_train_config

    items = ["model=gpn_m_demo", "model.vocab_size=1024", "model.d_state=96"]
    cfg = load_train_config(TINY, items if order == "name first" else items[::-1])
    assert (cfg.model.d_state, cfg.model.vocab_size, cfg.model.d_emb) == (96, 1024, 96)  # d_emb: the demo's


@pytest.mark.parametrize("argv, message", [
    (["seed=1", "seed.x=2"], "command-line override 'seed.x=2': seed is set to a value by another override, not a mapping"),
    (["train.x.y=2", "train.x=1"], "command-line override 'train.x=1': train.x is a mapping that other overrides set "
                                   "fields of"),
    (["model="], "model: missing"),
])
def test_overrides_that_cannot_both_hold_are_one_line(argv, message, capsys):
    assert main(["train", str(TINY), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


def test_a_mistyped_yaml_key_blames_the_file_with_the_nearest_key(tmp_path, capsys):
    config = yaml.safe_load(TINY.read_text())
    config["train"]["save_evrey"] = config["train"].pop("save_every")
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path), "train.total_steps=3"]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: {path}: train.save_evrey: unknown key; did you mean train.save_every?")


def test_resolved_config_has_absolute_local_data_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_train_config(TINY, ["data.train=d/train", "data.val=d/val", "data.cache=c", "run.dir=r"])
    assert (cfg.data.train, cfg.data.val, cfg.data.cache) == tuple(str(tmp_path / p) for p in ("d/train", "d/val", "c"))
    assert cfg.run.dir == "r"
    url = load_train_config(TINY, ["data.train=s3://bucket/train", "run.dir=r"])
    assert url.data.train == "s3://bucket/train"


def test_sweep_slurm_dry_run_finds_the_launchers_from_another_directory(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gpn_scale", "sweep", str(ROOT / "configs/sweeps/cpu_tiny.yaml"),
                           "--backend", "slurm", "--dry-run", "--out", str(tmp_path / "sweep")],
                          capture_output=True, text=True, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    sbatch = [line for line in proc.stdout.splitlines() if line.startswith("+ sbatch")]
    assert sbatch and all(f" {ROOT / 'launchers/slurm/train.sbatch'} " in line for line in sbatch)


def test_top_k_keeps_only_the_k_most_likely_by_hand():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    probs = sampling_probs(logits, temperature=0.5, top_k=2)
    kept = torch.exp(torch.tensor([3.0, 2.0], dtype=torch.float64) / 0.5)
    assert torch.allclose(probs, torch.tensor([0, kept[0], 0, kept[1], 0], dtype=torch.float64) / kept.sum())
    assert torch.equal(sampling_probs(logits, top_k=0), torch.softmax(logits.double(), -1))


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """An untrained tiny model: near-uniform samples, so some seed soon samples EOS (id 0 of trained tokenizers)."""
    root = tmp_path_factory.mktemp("eos")
    tok = make_tokenizer(root / "tok.json")
    codec = Codec(tok)
    model = tiny_model(codec.vocab_size, kernel="torch").eval()
    save_native(model, root / "ckpt")
    return root, tok, codec, model


def test_generate_stops_at_eos_unless_told_to_ignore_it(eos_model, capsys):
    root, tok, codec, model = eos_model
    assert codec.eos_id == 0
    prompt = codec.encode("the cat sat")
    for seed in range(200):  # a seed whose sample reaches EOS early, found with the library, not the CLI
        tokens = [t for t, _ in generate_tokens(model, prompt, 40, 1.0, 1.0, seed)]
        if 0 in tokens[1:]:
            break
    else:
        pytest.fail("no seed reached EOS")
    cut = tokens.index(0)
    args = ["generate", str(root / "ckpt"), "--tokenizer", str(tok), "--prompt", "the cat sat", "--max-new-tokens",
            "40", "--seed", str(seed)]
    assert main(args) == 0
    assert capsys.readouterr().out == "the cat sat" + codec.decode(tokens[:cut]) + "\n"
    assert main(args + ["--ignore-eos"]) == 0
    assert capsys.readouterr().out == "the cat sat" + codec.decode(tokens) + "\n"


def test_top_k_1_samples_the_greedy_text(eos_model, capsys):
    root, tok, _, _ = eos_model
    base = ["generate", str(root / "ckpt"), "--tokenizer", str(tok), "--prompt", "the cat", "--max-new-tokens", "12"]
    assert main(base + ["--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert main(base + ["--top-k", "1", "--seed", "3"]) == 0
    assert capsys.readouterr().out == greedy
    assert main(base + ["--top-k", "-1"]) == 2
    assert "--top-k: expected >= 0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def relative_run(tmp_path_factory):
    """A 2-step run of the tiny GPN+M (ZeRO-2), trained from its own directory with relative data and run
    paths, overrides after --resume: (its directory, the prep output, the environment it ran in)."""
    home = tmp_path_factory.mktemp("relative") / "project"
    prep = make_prep(home, make_tokenizer(home.parent / "tok.json"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, "-m", "gpn_scale", "train", str(TINY), "--resume", "auto",
                           f"data.train={prep.name}/train", f"data.val={prep.name}/val", "run.dir=run",
                           "train.total_steps=2", "train.save_every=2", "model.vocab_size=300"],
                          cwd=home, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return home / "run", prep, env


@pytest.mark.slow
def test_a_run_trained_with_relative_paths_evaluates_from_another_directory(relative_run, tmp_path):
    """Evaluated from elsewhere, where the run's relative paths mean nothing."""
    run, prep, env = relative_run
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["data"]["train"] == str(prep / "train") and saved["data"]["val"] == str(prep / "val")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "lambada.jsonl").write_text(json.dumps({"text": "the cat sat on the mat"}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "gpn_scale", "eval", str(run), "--lambada", "lambada.jsonl",
                           "--json"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout)["lambada_examples"] == 1


@pytest.mark.slow
def test_eval_json_is_json_alone_on_stdout(relative_run, tmp_path):
    """`gpn-scale eval RUN --json | jq`: loading a ZeRO checkpoint imports DeepSpeed, whose logger prints
    "Setting accelerator to CPU ..." on a machine without a GPU (DS_ACCELERATOR unset); that goes to
    stderr, and stdout is the metrics object alone, the one metrics.json holds."""
    run, prep, env = relative_run
    env = {k: v for k, v in env.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-m", "gpn_scale", "eval", str(run), "--data", str(prep), "--windows", "4",
                           "--json", "--out", str(tmp_path / "out")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = json.loads(proc.stdout)  # the whole of stdout
    assert metrics == json.loads((tmp_path / "out" / "metrics.json").read_text()) and metrics["windows"] == 4
    if not torch.cuda.is_available():  # the case this is about: DeepSpeed's warning was printed, on stderr
        assert "Setting accelerator to CPU" in proc.stderr


@pytest.mark.parametrize("command", [["train"], ["model-info"], ["sweep", "--dry-run"]])
def test_a_config_that_is_not_utf8_is_one_line_naming_it(command, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"model:\n  family: \xff\xfe gpn\n")
    assert main([*command, str(bad)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {bad}: not UTF-8 text (at byte offset 17)\n", err


def test_json_state_files_that_are_not_utf8_are_one_line_naming_them(tmp_path):
    from gpn_scale.eval.prep_output import open_prep_output

    from data_prep.errors import UserError

    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "index.json").write_text('{"version": 2, "shards": []}')
    (tmp_path / "stats.json").write_bytes(b'{"vocab_size": "\xff"}')

    with pytest.raises(UserError, match=r"stats.json: not UTF-8 text \(at byte offset 16\)"):
        open_prep_output(tmp_path)


def test_a_reader_that_stops_early_ends_the_output_without_a_traceback():
    """`gpn-scale config keys | head -3`: the pipe closes while the command still writes; the
    command ends quietly with the status a shell gives a command SIGPIPE ended (141)."""
    import fcntl

    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, 1031, 4096)  # F_SETPIPE_SZ, before the command starts: the listing (7 KB) cannot fit
    proc = subprocess.Popen([sys.executable, "-m", "gpn_scale", "config", "keys"], stdout=write_end,
                            stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    os.close(write_end)
    first = os.read(read_end, 200)  # unbuffered: the rest (over 2 KB more than the pipe holds) stays unread
    os.close(read_end)
    _, err = proc.communicate(timeout=120)
    assert first.startswith(b"model: ") and proc.returncode == 141 and err == b"", err.decode()[-3000:]
