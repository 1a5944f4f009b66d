"""No command writes into an output that is not its own: each refuses, in one line and before
writing anything, an existing directory that is neither new, empty, nor its own resumable output
(data_prep/outputs.py). Driven through the CLI as a user would, against a real training run, a real
prep output, a native checkpoint and a plain MDS dataset; each refused directory is compared file
by file (bytes) before and after.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from support.eval_fixtures import make_prep, make_tokenizer, tiny_model

import support.reference_checkpoint as reference_checkpoint
import support.reference_gpn as reference_gpn
from gpn_scale.cli import main
from gpn_scale.storage.native import save_native
from support.mds_fixture import write_windows
from support import ROOT

TINY = ROOT / "configs" / "train" / "gpn_m_tiny.yaml"


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(path.rglob("*"))}


def error(capsys, *argv) -> str:
    """The one line a refused command prints (exit status 2, no traceback)."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """A real training run (2 steps, one checkpoint), a real prep output with its tokenizer, a native
    checkpoint, a plain MDS dataset (train/ written by MosaicML Streaming, not by prep) and a
    reference checkpoint to convert."""
    root = tmp_path_factory.mktemp("outputs")
    data = root / "windows"
    write_windows(data / "train", 64, 32, 512)
    run = root / "run"
    proc = subprocess.run([sys.executable, "-m", "gpn_scale", "train", str(TINY), f"run.dir={run}",
                           f"data.train={data / 'train'}", "data.val=null", "train.total_steps=2", "train.save_every=2",
                           "zero.stage=0"], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    tok = make_tokenizer(root / "tok.json")
    prep = make_prep(root / "prep_in", tok)
    native = root / "native"
    save_native(tiny_model(300), native)
    mds = root / "mds"
    write_windows(mds / "train", 16, 32, 512)
    cfg = dict(vocab_size=41, d_state=16, d_emb=8, d_ffn=12, n_heads=2, d_key=4, d_val=3, n_layers=1)
    reference = reference_checkpoint.write(root / "reference", reference_gpn.random_params(
        cfg, True, np.random.default_rng(0)), cfg)
    return {"run": run, "data": data, "prep": prep, "native": native, "mds": mds, "tok": tok, "reference": reference}


def test_convert_refuses_another_models_export_and_a_run_directory(outputs, tmp_path, capsys):
    ckpt, config = outputs["reference"]
    for name, held in (("native", "holds a native checkpoint"), ("run", "holds a training run")):
        before = snapshot(outputs[name])
        line = error(capsys, "convert", "--from-reference", ckpt, "--config", config, "--out", outputs[name])
        assert f"--out {outputs[name]}: {held}" in line and "convert writes a new directory" in line, line
        assert snapshot(outputs[name]) == before  # the run still evaluates its own checkpoints
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["convert", "--from-reference", str(ckpt), "--config", str(config), "--out", str(empty)]) == 0
    assert sorted(p.name for p in empty.iterdir()) == ["manifest.json", "model.safetensors", "model.yaml"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging directory left


@pytest.mark.parametrize("target, held", [("mds", "holds an MDS dataset (MosaicML Streaming's train/index.json)"),
                                          ("run", "holds a training run (gpn-scale train's status.json)"),
                                          ("native", "holds a native checkpoint")])
def test_prep_refuses_a_foreign_mds_dataset_and_a_run_directory(outputs, target, held, capsys):
    before = snapshot(outputs[target])
    line = error(capsys, "prep", outputs["prep"].parent / "train.jsonl", "--out", outputs[target], "--tokenizer",
                 outputs["tok"], "--seq-len", 32, "--workers", 1)
    assert f"--out {outputs[target]}: {held}" in line and "its own earlier output (prep.json)" in line, line
    assert snapshot(outputs[target]) == before


def test_a_prep_output_resumes_and_refuses_nothing_of_its_own(outputs, tmp_path, capsys):
    out = tmp_path / "copy"
    import shutil

    shutil.copytree(outputs["prep"], out)
    before = snapshot(out)
    src = outputs["prep"].parent
    assert main(["prep", str(src / "train.jsonl"), str(src / "val.jsonl"), "--val-files", str(src / "val.jsonl"),
                 "--out", str(out), "--tokenizer", str(outputs["tok"]), "--seq-len", "32", "--workers", "1"]) == 0
    assert "0 documents" in capsys.readouterr().err  # every unit already committed
    after = snapshot(out)
    assert {k: v for k, v in after.items() if not k.startswith(".tmp")} == before


@pytest.mark.parametrize("target, held", [("prep", "holds a prep output (gpn-scale prep's prep.json)"),
                                          ("native", "holds a native checkpoint"),
                                          ("mds", "holds an MDS dataset")])
def test_train_refuses_a_run_dir_holding_another_output(outputs, target, held, capsys):
    before = snapshot(outputs[target])
    line = error(capsys, "train", TINY, f"run.dir={outputs[target]}", f"data.train={outputs['data'] / 'train'}",
                 "data.val=null")
    assert f"run.dir {outputs[target]}: {held}" in line and "train writes into a new or empty directory" in line, line
    assert snapshot(outputs[target]) == before


def test_run_dir_naming_a_file_is_one_line(outputs, tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    line = error(capsys, "train", TINY, f"run.dir={file}", f"data.train={outputs['data'] / 'train'}", "data.val=null")
    assert line == f"error: run.dir {file}: exists and is not a directory; choose another run.dir"
    assert file.read_text() == "mine"


def test_a_run_dir_may_hold_its_config_file_and_a_sweep_point_is_trains_own(outputs, tmp_path):
    from data_prep.errors import UserError
    from gpn_scale.train.preflight import check_run_dir

    run = tmp_path / "run"
    run.mkdir()
    (run / "my.yaml").write_text(TINY.read_text())
    check_run_dir(run, run / "my.yaml")  # the config it is started from: allowed
    (run / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="holds files that are not train's \\(notes.txt\\)"):
        check_run_dir(run, run / "my.yaml")
    point = tmp_path / "point"
    point.mkdir()
    (point / "point.json").write_text("{}")
    (point / "train.yaml").write_text("{}")
    check_run_dir(point, point / "train.yaml")
    check_run_dir(outputs["run"], None)  # its own run: resumed


def test_sweep_demo_analyze_and_lm_eval_refuse_a_run_directory(outputs, tmp_path, capsys):
    run = outputs["run"]
    before = snapshot(run)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"train": str(TINY), "families": ["gpn_m_1l"], "params": [3e4],
                                    "tokens_per_param": [0.05], "seq_len": 32, "global_batch": 4}))
    line = error(capsys, "sweep", spec, "--out", run, "--dry-run")
    assert f"--out {run}: holds a training run" in line and "sweep writes into" in line
    line = error(capsys, "demo", "--out", run)
    assert f"--out {run}: holds a training run" in line and "its own earlier output (corpus/pydoc-topics-*.parquet)" in line
    line = error(capsys, "analyze", run, "--data", outputs["data"] / "train", "--out", run)
    assert f"--out {run}: holds a training run" in line and "analyze writes a new directory" in line
    pytest.importorskip("lm_eval")
    line = error(capsys, "lm-eval", run, "--tasks", "lambada_openai", "--output_path", run)
    assert f"--output_path {run}: holds a training run" in line
    assert snapshot(run) == before
    line = error(capsys, "demo", "--out", outputs["prep"])
    assert "holds a prep output" in line


def test_eval_checks_its_out_before_anything_is_read(outputs, tmp_path, capsys, monkeypatch):
    file = tmp_path / "results"
    file.write_text("mine")
    # --data does not exist: the output is refused before the data (or the model) is even opened.
    line = error(capsys, "eval", outputs["run"], "--data", tmp_path / "nowhere", "--out", file)
    assert line == f"error: --out {file}: exists and is not a directory; choose another --out"
    line = error(capsys, "eval", outputs["run"], "--data", tmp_path / "nowhere", "--out", outputs["prep"])
    assert "holds a prep output" in line and "eval writes a new directory and overwrites nothing" in line
    assert file.read_text() == "mine"

    # By default a second evaluation goes beside the first, never over it.
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        assert main(["eval", str(outputs["run"]), "--data", str(outputs["data"] / "train"), "--windows", "2"]) == 0
    first, second = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("eval", "eval-2"))
    assert first["loss"] == second["loss"] and second["loss_by_position"] == "eval-2/loss_by_position.csv"
    assert "metrics: eval-2/metrics.json" in capsys.readouterr().out


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine with a GPU has a CUDA device")
def test_eval_device_cuda_without_a_gpu_is_one_line(outputs, tmp_path, capsys):
    line = error(capsys, "eval", outputs["native"], "--data", outputs["data"] / "train", "--device", "cuda",
                 "--out", tmp_path / "o")
    assert line.startswith("error: --device cuda: no CUDA GPU is available here") and not (tmp_path / "o").exists()
    line = error(capsys, "generate", outputs["native"], "--prompt", "x", "--tokenizer", outputs["tok"],
                 "--device", "nodevice")
    assert line == "error: --device: 'nodevice' is not a torch device"


def test_train_tokenizer_never_overwrites_a_file(outputs, tmp_path, capsys):
    out = tmp_path / "tok.json"
    out.write_text("{}")
    line = error(capsys, "prep", "train-tokenizer", outputs["prep"].parent / "train.jsonl", "--vocab-size", 300,
                 "--out", out)
    assert line == f"error: --out {out}: a file of that name exists; nothing is overwritten: choose another --out"
    assert out.read_text() == "{}"


def test_two_preps_into_one_out_at_once_the_second_refuses(outputs, tmp_path):
    """The first prep's worker waits on a named pipe as its input, so it holds the output (and its
    lock) for as long as the test needs: a real concurrent prep, with no timing involved. Once it is
    killed, a rerun takes its lock over and completes."""
    pipe = tmp_path / "in" / "docs.jsonl"
    pipe.parent.mkdir()
    os.mkfifo(pipe)
    out = tmp_path / "out"
    args = [str(pipe), "--out", str(out), "--tokenizer", str(outputs["tok"]), "--seq-len", "8", "--workers", "1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    first = subprocess.Popen([sys.executable, "-m", "gpn_scale", "prep", *args], env=env, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    lock = out / "prep.node-0.lock"
    try:
        deadline = time.monotonic() + 300  # a hang, not a verdict: it takes seconds
        while not (lock.is_file() and lock.read_text().endswith("\n")):  # written whole, before any unit
            assert first.poll() is None, first.stderr.read()
            assert time.monotonic() < deadline, "the first prep never took its lock"
            time.sleep(0.05)
        second = subprocess.run([sys.executable, "-m", "gpn_scale", "prep", *args], env=env, capture_output=True,
                                text=True, timeout=300)
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
        assert f"--out {out} is in use by pid {first.pid} on {socket.gethostname()}" in second.stderr
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the prep and its worker, as a crashed node would go
        first.wait()
    pipe.unlink()
    pipe.write_text("".join(json.dumps({"text": f"the cat sat on the mat {i}"}) + "\n" for i in range(50)))
    third = subprocess.run([sys.executable, "-m", "gpn_scale", "prep", *args], env=env, capture_output=True, text=True,
                           timeout=300)
    assert third.returncode == 0, third.stderr
    assert f"took over the stale lock {lock} (process {first.pid} is gone)" in third.stderr
    assert json.loads((out / "stats.json").read_text())["splits"]["train"]["documents"] == 50 and not lock.exists()


def test_a_full_disk_at_start_leaves_nothing_behind(outputs, tmp_path, capsys):
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
        try:  # fill it to the last byte
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        run = mount / "run"
        line = error(capsys, "train", TINY, f"run.dir={run}", f"data.train={outputs['data'] / 'train'}", "data.val=null")
        assert line == (f"error: run.dir {run}: no space left on device (cannot write the lock trainer.lock); free some "
                        "space and run the same command again")
        assert sorted(p.name for p in mount.iterdir()) == ["filler"]  # not even an empty run.dir or lock
        out = mount / "prep"
        line = error(capsys, "prep", outputs["prep"].parent / "train.jsonl", "--out", out, "--tokenizer", outputs["tok"],
                     "--seq-len", 32, "--workers", 1)
        assert "no space left on device" in line and sorted(p.name for p in mount.iterdir()) == ["filler"]
    finally:
        subprocess.run(["umount", "-l", str(mount)])
