"""`gpn-scale train` under faults and careless use: nothing is lost, nothing is silently wrong.

Each test works on a copy of one trained run directory (6 steps, a checkpoint every 2) and
drives the CLI in a real process, as a user would.
"""

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpn_scale.storage.jsonl import read_jsonl
from gpn_scale.storage import checkpoints as ckpt
from gpn_scale.train.engine import EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_PREEMPTED
from support.mds_fixture import write_windows
from support import ROOT, process_env
from support.train_runs import error_line

CONFIG = ROOT / "configs" / "train" / "gpn_m_tiny.yaml"
STEPS = 6


def cmd(data, run_dir, *overrides, resume=None):
    return [sys.executable, "-m", "gpn_scale", "train", str(CONFIG), f"run.dir={run_dir}", f"data.train={data / 'train'}",
            f"data.val={data / 'val'}", "data.log_sample_ids=true", f"train.total_steps={STEPS}", "train.save_every=2",
            "zero.stage=1", *overrides] + (["--resume", resume] if resume else [])


def train(data, run_dir, *overrides, resume=None, expect=0):
    proc = subprocess.run(cmd(data, run_dir, *overrides, resume=resume), env=process_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == expect, proc.stderr[-5000:]
    return proc


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "loss" in r}


def logged_lr(run_dir) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "lr" in r}


def schedule(step: int, lr=6e-4, warmup=2, total=STEPS, floor=0.1) -> float:
    """The learning rate of optimiser step `step` (1-based, as logged): it uses the schedule at
    step - 1 (the paper's: linear warm-up, then a cosine to floor x lr), whatever the accumulation."""
    s = step - 1
    return lr * (s + 1) / warmup if s < warmup else lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))))


def changes_applied(proc) -> set[str]:
    """The settings a resume reported as changed ("key old -> new"; a moved run.dir by its key)."""
    [line] = [l for l in proc.stdout.splitlines() if l.startswith("resuming with changed settings: ")]
    items = line.split(": ", 1)[1].split(", ")
    return {"run.dir" if item.startswith("run.dir ") else item for item in items}


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_windows(root / "train", 200, 32, 512)
    write_windows(root / "val", 8, 32, 512, seed=1)
    return root


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    run = tmp_path_factory.mktemp("trained") / "run"
    train(data, run)
    assert sorted(losses(run)) == list(range(1, STEPS + 1))
    assert logged_lr(run) == pytest.approx({s: schedule(s) for s in range(1, STEPS + 1)}, rel=1e-12)  # 2 micro-batches a step
    return run


@pytest.fixture
def run(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def test_checks_run_before_anything_starts(data, tmp_path):
    """Bad paths, a vocabulary the model cannot embed and a taken run.dir: one line, before any step."""
    fresh = tmp_path / "fresh"
    proc = train(data, fresh, "data.val=/nonexistent", expect=2)
    assert "data.val: /nonexistent: no MDS index.json" in error_line(proc)
    assert not (fresh / "status.json").exists() and not (fresh / "checkpoints").exists()

    prep = tmp_path / "prep"  # a prep output whose tokenizer is bigger than the model's vocabulary
    shutil.copytree(data / "train", prep / "train")
    (prep / "stats.json").write_text(json.dumps({"vocab_size": 1000, "seq_len": 32}))
    proc = subprocess.run(cmd(data, fresh, f"data.train={prep / 'train'}"), env=process_env(), capture_output=True, text=True)
    assert proc.returncode == 2
    assert "vocabulary of 1000" in error_line(proc) and "vocab_size 512" in error_line(proc)

    empty = tmp_path / "empty"  # a prep output with no windows
    write_windows(empty / "train", 0, 32, 512)
    assert "no samples (an empty prep output)" in error_line(train(data, fresh, f"data.train={empty / 'train'}", expect=2))

    for override, message in (("train.lr=-1", "command-line override: train.lr: expected a finite number > 0, got -1"),
                              ("train.lr=.nan", "command-line override: train.lr: expected a finite number, got nan"),
                              ("train.lr=[1,", "override 'train.lr=[1,': the value is not valid YAML")):
        assert message in error_line(train(data, fresh, override, expect=2))
    assert not fresh.exists()


def test_a_taken_run_dir_refuses_and_sigint_checkpoints(data, run):
    """A second trainer on a run.dir refuses, naming the holder; Ctrl-C checkpoints and exits 130;
    a lock left by a dead process is taken over. The first trainer has more steps than it can run
    before the test stops it, however slow or fast the machine: it holds its lock throughout."""
    first = subprocess.Popen(cmd(data, run, "train.total_steps=1000000", resume="auto"), env=process_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while max(losses(run)) < STEPS + 1:  # training, not starting
            assert first.poll() is None and time.time() < deadline, first.stderr.read()[-3000:] if first.poll() else "slow"
            time.sleep(0.2)
        second = train(data, run, "train.total_steps=1000000", resume="auto", expect=2)
        assert f"is in use by pid {first.pid} on {socket.gethostname()}" in error_line(second)
        first.send_signal(signal.SIGINT)
        stdout, stderr = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == EXIT_INTERRUPTED, stderr[-3000:]
    stopped = max(losses(run))
    assert f"SIGINT received: checkpointed at step {stopped}" in stdout
    assert ckpt.verify(run / "checkpoints" / ckpt.tag_for(stopped)) is None
    assert json.loads((run / "status.json").read_text())["status"] == "interrupted"
    assert not (run / "trainer.lock").exists()

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run / "trainer.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout)}))
    proc = train(data, run, "train.total_steps=1000000", f"train.stop_at_step={stopped + 1}", resume="auto")
    assert f"took over the stale lock {run / 'trainer.lock'} (process {int(dead.stdout)} is gone)" in proc.stderr


def test_rotation_keeps_what_it_just_wrote(data, run):
    """Newer checkpoints that do not verify are neither counted as kept nor sorted above the new one."""
    ckpts = run / "checkpoints"
    for tag in ("step_00000004", "step_00000006"):
        corrupt(ckpts / tag / "mp_rank_00_model_states.pt")
    proc = train(data, run, "train.keep_last=1", "train.stop_at_step=4", resume="auto")
    assert f"resumed from {ckpts / 'step_00000002'}" in proc.stdout
    assert logged_lr(run) == pytest.approx({s: schedule(s) for s in range(1, 5)}, rel=1e-12)  # after the resume too
    latest = (ckpts / "latest").read_text()
    assert latest == "step_00000004" and ckpt.verify(ckpts / latest) is None
    assert f"done at step 4: checkpoint {ckpts / latest}" in proc.stdout
    assert not (ckpts / "step_00000002").exists()  # replaced by a newer verified one
    assert (ckpts / "step_00000006").exists()  # newer than this run: left for its saves to replace


@pytest.mark.parametrize("fault", ["manifests deleted", "all corrupted"])
def test_resume_auto_never_restarts_from_scratch_over_checkpoints(data, run, fault):
    ckpts = run / "checkpoints"
    history = (run / "metrics.jsonl").read_text()
    for tag in ckpt.tags(ckpts):
        if fault == "manifests deleted":
            (ckpts / tag / ckpt.MANIFEST).unlink()
        else:
            corrupt(ckpts / tag / "mp_rank_00_model_states.pt")
    line = error_line(train(data, run, resume="auto", expect=2))
    assert "--resume auto: no checkpoint in" in line
    for tag in ("step_00000002", "step_00000004", "step_00000006"):
        assert f"{tag}: {'incomplete' if fault == 'manifests deleted' else 'mp_rank_00_model_states.pt does not match'}" in line
    assert (run / "metrics.jsonl").read_text() == history


def test_a_diverging_run_stops_without_saving_its_state(data, run):
    ckpts = run / "checkpoints"
    before = {t: (ckpts / t / ckpt.MANIFEST).read_text() for t in ckpt.tags(ckpts)}
    proc = train(data, run, "train.lr=1e8", "train.total_steps=12", "--allow-config-change", resume="auto",
                 expect=EXIT_DIVERGED)
    assert changes_applied(proc) == {"run.dir", "train.lr 0.0006 -> 100000000.0", "train.total_steps 6 -> 12"}
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1 and "the run diverged" in lines[0] and "Traceback" not in proc.stderr
    assert json.loads((run / "status.json").read_text())["status"] == "diverged"
    records = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r and r["step"] > STEPS]
    bad = [r["step"] for r in records if not all(map(_finite, (r["loss"], r["grad_norm"])))]
    assert bad == [records[-1]["step"]]  # the first non-finite step ends the run
    # Strict JSON (no NaN or Infinity literals), the non-finite values named under "nonfinite".
    strict = [json.loads(line, parse_constant=_refuse) for line in (run / "metrics.jsonl").read_text().splitlines()]
    [last] = [r for r in strict if r.get("step") == bad[0] and "loss" in r]
    assert set(last["nonfinite"]) & {"loss", "grad_norm"} and set(last["nonfinite"].values()) <= {"nan", "inf", "-inf"}
    assert all(last[k] is None for k in last["nonfinite"])
    # Every checkpoint is finite: the ones from before kept as they were, any new one from a finite step.
    for tag in ckpt.tags(ckpts):
        assert ckpt.verify(ckpts / tag) is None
        assert tag in before or ckpt.step_of(tag) < bad[0]
    assert all((ckpts / t / ckpt.MANIFEST).read_text() == m for t, m in before.items() if (ckpts / t).exists())
    assert (ckpts / "step_00000006").exists()


def _finite(x) -> bool:
    return x is not None and abs(x) < float("inf")


def _refuse(constant: str):
    raise AssertionError(f"metrics.jsonl holds {constant}, which strict JSON readers reject")


def test_a_torn_metrics_line_is_dropped_and_kept(data, run):
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 5.1, "l')  # the disk filled mid-write
    proc = train(data, run, "train.total_steps=8", "model.core_chunk=8", resume="auto")
    assert changes_applied(proc) == {"run.dir", "model.core_chunk 32 -> 8", "train.total_steps 6 -> 8"}
    assert sorted(losses(run)) == list(range(1, 9))
    kept = run / "metrics.jsonl.before_step_6"
    assert kept.read_text().endswith('"l') and f"previous file is kept as {kept}" in proc.stdout + proc.stderr
    [change] = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("event") == "config_change"]
    assert change["step"] == STEPS and change["changes"]["model.core_chunk"] == {"checkpoint": 32, "now": 8}
    assert change["changes"]["train.total_steps"] == {"checkpoint": 6, "now": 8} and len(change["changes"]) == 3


def test_resume_refuses_changed_settings(data, run, tmp_path):
    other = tmp_path / "other"  # the same prep at another window length
    write_windows(other / "train", 200, 16, 512)
    config = (run / "config.yaml").read_text()
    for overrides, named in ((["train.lr=0.5"], "train.lr 0.0006 -> 0.5"),
                             (["model.vocab_size=600"], "model.vocab_size 512 -> 600"),
                             ([f"data.train={other / 'train'}", "data.val=null"], "data.train windows 32 -> 16")):
        line = error_line(train(data, run, *overrides, resume="auto", expect=2))
        assert named in line and "--allow-config-change" in line
    assert (run / "config.yaml").read_text() == config  # a refused resume rewrites nothing


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_allow_config_change_onto_another_model_shape_is_one_line_and_writes_nothing(data, run):
    before = snapshot(run)
    proc = train(data, run, "model.vocab_size=600", "--allow-config-change", resume="auto", expect=2)
    line = error_line(proc)
    assert "--allow-config-change: step_00000006 holds weights of another shape (embedding: [512, " in line, line
    assert "[600, " in line and "needs a new run.dir" in line
    assert snapshot(run) == before  # config.yaml, metrics, status and checkpoints as they were


BROKEN_STATES = {  # what a damaged or hand-edited trainer_state.json can look like, its manifest regenerated
    "not JSON": lambda state: "{not json",
    "no global_batch": lambda state: json.dumps({k: v for k, v in state.items() if k != "global_batch"}),
    "no config": lambda state: json.dumps({k: v for k, v in state.items() if k != "config"}),
    "a step that is text": lambda state: json.dumps({**state, "step": "six"}),
}


@pytest.mark.parametrize("how", sorted(BROKEN_STATES))
def test_a_malformed_trainer_state_is_one_line_in_every_command_that_reads_it(data, run, tmp_path, capsys, how):
    from gpn_scale.cli import main
    from gpn_scale.train.checkpoint_writer import write_manifest

    tag = run / "checkpoints" / "step_00000006"
    state_file = tag / "trainer_state.json"
    state_file.write_text(BROKEN_STATES[how](json.loads(state_file.read_text())))
    write_manifest(tag)
    before = snapshot(run)
    assert error_line(train(data, run, "train.total_steps=8", resume="auto", expect=2)).startswith(f"error: {state_file}: ")
    assert snapshot(run) == before
    for argv in (["eval", run, "--data", data / "val", "--out", tmp_path / "eval"],
                 ["generate", run, "--prompt", "x", "--tokenizer", tmp_path / "none.json"],
                 ["analyze", run, "--data", data / "val", "--out", tmp_path / "analyze"],
                 ["export", run, "--to", "reference", "--out", tmp_path / "export"]):
        assert main([str(a) for a in argv]) == 2, argv[0]
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {state_file}: "), (argv[0], err)
    assert main(["ckpt", "verify", str(tag)]) == 1
    assert capsys.readouterr().out.startswith(f"{tag}: {state_file}: ")


def test_a_checkpoint_saved_before_recompute_every_was_named_so_loads_and_resumes(data, run):
    """A trainer_state.json written when GPN's recompute_every was checkpoint_every: read under the new
    name wherever a saved run is read back (loading its model, comparing it with a resuming run's
    config), never refused as a user's config with the old key is."""
    from gpn_scale.train.checkpoint_writer import write_manifest

    tag = run / "checkpoints" / "step_00000006"
    state_file = tag / "trainer_state.json"
    state = json.loads(state_file.read_text())
    model = state["config"]["model"]
    state["config"]["model"] = {("checkpoint_every" if k == "recompute_every" else k): v for k, v in model.items()}
    assert state["config"]["model"]["checkpoint_every"] == 0
    state_file.write_text(json.dumps(state, indent=1))
    write_manifest(tag)
    assert ckpt.read_trainer_state(tag).config["model"] == model
    assert ckpt.load_trained_model(tag).config.recompute_every == 0
    proc = train(data, run, "train.total_steps=8", resume="auto")
    assert changes_applied(proc) == {"run.dir", "train.total_steps 6 -> 8"}  # recompute_every 0 then and now
    assert sorted(losses(run)) == list(range(1, 9))


def test_disk_full_during_a_save_keeps_every_checkpoint(data, run, tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    used = sum(p.stat().st_size for p in run.rglob("*") if p.is_file())
    size = used + 600_000  # room for the metrics, not for another checkpoint (~1.2 MB)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        small = mount / "run"
        shutil.copytree(run, small)
        proc = train(data, small, "train.total_steps=8", resume="auto", expect=2)
        line = error_line(proc)
        assert "step_00000008: no space left on device" in line and "--resume auto (from step_00000006)" in line
        status = json.loads((small / "status.json").read_text())
        assert status["status"] == "failed" and "no space left on device" in status["reason"]
        ckpts = small / "checkpoints"
        assert (ckpts / "latest").read_text() == "step_00000006"
        assert all(ckpt.verify(ckpts / t) is None for t in ckpt.tags(ckpts))
        subprocess.run(["mount", "-o", f"remount,size={size + 4_000_000}", str(mount)], check=True)
        train(data, small, "train.total_steps=8", resume="auto")
        assert sorted(losses(small)) == list(range(1, 9))
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def test_a_lock_from_another_host_is_stale_only_without_heartbeat(tmp_path, monkeypatch):
    from data_prep.errors import UserError
    from data_prep import lock

    path = tmp_path / lock.LOCK
    path.write_text(json.dumps({"host": "node-7", "pid": 1, "started": "then"}))
    with pytest.raises(UserError, match=f"is in use by pid 1 on node-7 since then \\({path}\\)"):
        lock.RunLock(tmp_path)
    old = time.time() - lock.STALE_S - 5
    os.utime(path, (old, old))
    warnings = []
    held = lock.RunLock(tmp_path, warn=warnings.append)
    assert warnings == [f"warning: took over the stale lock {path} (no heartbeat from node-7 for {lock.STALE_S + 5:.0f} s)"]
    assert json.loads(path.read_text())["pid"] == os.getpid()
    held.release()
    assert not path.exists()

    # A requeued SLURM job (same job id, next restart) takes over its own lock at once, from any host.
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    path.write_text(json.dumps({"host": "node-7", "pid": 1, "slurm_job": "42", "slurm_restart": "0"}))
    held = lock.RunLock(tmp_path, warn=warnings.append)
    assert warnings[-1].endswith("(SLURM job 42 was requeued)")
    held.release()


def test_rotation_hashes_only_checkpoints_this_run_has_not_verified(tmp_path, monkeypatch):
    from gpn_scale.train import checkpoint_writer as writer

    for step in (2, 4, 6, 8):
        tag_dir = tmp_path / ckpt.tag_for(step)
        tag_dir.mkdir()
        (tag_dir / "weights.pt").write_bytes(bytes([step]) * 100)
        if step < 8:
            writer.write_manifest(tag_dir)
    corrupt(tmp_path / ckpt.tag_for(2) / "weights.pt")
    hashed = []
    monkeypatch.setattr(writer, "verify", lambda d: hashed.append(d.name) or ckpt.verify(d))
    verified = {ckpt.tag_for(6)}  # e.g. the checkpoint this run resumed from
    reports = [writer.hash_own_files(tmp_path / ckpt.tag_for(8), 0, 1)]  # one rank wrote step 8
    writer.commit(tmp_path, ckpt.tag_for(8), 3, verified, reports)
    assert hashed == [ckpt.tag_for(4)]  # not 6: verified already; not 2: three newer ones verify, so it goes
    assert verified == {ckpt.tag_for(s) for s in (4, 6, 8)}
    assert ckpt.tags(tmp_path) == [ckpt.tag_for(s) for s in (8, 6, 4)]
    writer.commit(tmp_path, ckpt.tag_for(8), 2, verified, reports)
    assert hashed == [ckpt.tag_for(4)] and ckpt.tags(tmp_path) == [ckpt.tag_for(8), ckpt.tag_for(6)]
    assert verified == {ckpt.tag_for(6), ckpt.tag_for(8)}


def test_universal_conversion_keeps_every_parameter_and_its_optimizer_state(run):
    """The conversion a resume on another world size does, in-process: each parameter's fp32
    master and Adam moments in universal form, equal to the checkpoint's, under their own manifest."""
    import torch

    from gpn_scale.storage import safe_load
    from gpn_scale.train import checkpoint_writer as writer

    tag_dir = run / "checkpoints" / ckpt.tag_for(STEPS)
    out = writer.to_universal(tag_dir)
    assert ckpt.verify(out) is None
    weights = safe_load.load(tag_dir / "mp_rank_00_model_states.pt")["module"]
    [optim_file] = tag_dir.glob("*optim_states.pt")
    state = safe_load.load(optim_file)["optimizer_state_dict"]
    moments = sum(t.numel() for group in state["base_optimizer_state"]["state"].values()
                  for k, t in group.items() if k in ("exp_avg", "exp_avg_sq"))
    converted = 0
    for name, tensor in weights.items():
        master = safe_load.load(out / "zero" / name / "fp32.pt")["param"]
        assert torch.equal(master.view_as(tensor), tensor.float()), name  # fp32 training: the weights are the master
        for moment in ("exp_avg", "exp_avg_sq"):
            converted += safe_load.load(out / "zero" / name / f"{moment}.pt")["param"].numel()
    assert converted == moments == 2 * sum(t.numel() for t in weights.values())


def test_a_metrics_record_of_the_wrong_type_is_one_line_and_the_run_says_failed(data, run):
    """A record edited by hand: the resume's truncation names file, line and field; the run, which
    had set its status to running, leaves `failed` with that line."""
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": "three", "loss": 1.0}\n')
    n = len((run / "metrics.jsonl").read_text().splitlines())
    line = error_line(train(data, run, "train.total_steps=8", resume="auto", expect=2))
    assert line == f"error: {run / 'metrics.jsonl'}: line {n}: step: expected an integer >= 0, got 'three'"
    status = json.loads((run / "status.json").read_text())
    assert status == {"status": "failed", "step": STEPS, "world_size": 1, "reason": line.removeprefix("error: ")}
    assert not (run / "trainer.lock").exists()


def _signal_caught(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler installed for `sig` (its SigCgt mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(l for l in status.splitlines() if l.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (sig - 1) & 1)


def test_sigterm_while_starting_up_exits_75_with_a_line(data, tmp_path):
    """SIGTERM as soon as the trainer listens for it (before torch has even imported): no step is
    begun, exit 75 and one line, status preempted; the run resumes from scratch later."""
    fresh = tmp_path / "fresh"
    proc = subprocess.Popen(cmd(data, fresh), env=process_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300  # a hang guard only: it listens within a second
        while not _signal_caught(proc.pid, signal.SIGTERM):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert ("SIGTERM received: stopped before step 1, nothing new to checkpoint; exiting with 75 "
            "(resume with --resume auto)") in stdout and "Traceback" not in stderr  # the run's report: stdout
    assert json.loads((fresh / "status.json").read_text()) == {"status": "preempted", "step": 0, "world_size": 1}
    assert not (fresh / "checkpoints").exists() and not (fresh / "trainer.lock").exists()


def _training_until_a_step_is_logged(data, run_dir):
    """A long one-rank run, started and past its first step: (the process, its hang-guard deadline)."""
    proc = subprocess.Popen(cmd(data, run_dir, "train.total_steps=1000000", "train.save_every=1000"), env=process_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # hang guards only
    try:
        while not losses(run_dir):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:] if proc.poll() else ""
            time.sleep(0.05)
    except BaseException:
        proc.kill()
        raise
    return proc, deadline


def test_ctrl_c_twice_leaves_status_interrupted(data, tmp_path):
    """The second Ctrl-C stops the run at once, wherever it is (here: in the checkpoint the first
    one asked for); status.json says so instead of "running", and a save it cut short is never taken
    for a checkpoint."""
    fresh = tmp_path / "fresh"
    proc, deadline = _training_until_a_step_is_logged(data, fresh)
    try:
        proc.send_signal(signal.SIGINT)
        while proc.poll() is None and not (fresh / "checkpoints").is_dir():  # the save the first Ctrl-C asked for
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED, stderr[-3000:]
    status = json.loads((fresh / "status.json").read_text())
    assert status["status"] == "interrupted", status
    assert all(ckpt.verify(fresh / "checkpoints" / t) is None for t in ckpt.committed(fresh / "checkpoints"))


def test_a_rank_aborted_in_native_code_prints_its_python_stacks(data, tmp_path):
    """An abort from a library's C++ (SIGABRT: std::terminate) leaves no Python traceback of its own:
    the trainer prints every thread's Python stack, so the line that was running is known."""
    proc, _ = _training_until_a_step_is_logged(data, tmp_path / "fresh")
    try:
        proc.send_signal(signal.SIGABRT)
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGABRT, stderr[-3000:]
    assert "Fatal Python error: Aborted" in stderr and "Current thread" in stderr, stderr[-3000:]
    assert re.search(r'File ".*gpn_scale/train/engine.py", line \d+ in run', stderr), stderr[-3000:]


def test_a_second_ctrl_c_inside_a_library_that_raises_over_it_still_says_interrupted(data, tmp_path, monkeypatch):
    """The second Ctrl-C can land inside torch.save, whose zip writer, closing, raises its own
    error over the KeyboardInterrupt ("unexpected pos ..."): that is still an interruption (exit
    130, status "interrupted"), not a crash. In-process, the trainer replaced by one that fails so."""
    from gpn_scale.cli import main
    from gpn_scale.train import engine, preflight

    class SavingWhenInterrupted:
        world = 1

        def __init__(self, *args):
            self.step = 3

        def run(self):
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3840 vs 3732")

    monkeypatch.setattr(engine, "Trainer", SavingWhenInterrupted)
    monkeypatch.setattr(preflight, "check", lambda *args, **kwargs: None)
    run = tmp_path / "run"
    assert main(["train", str(CONFIG), f"run.dir={run}", f"data.train={data / 'train'}"]) == EXIT_INTERRUPTED
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "interrupted" and status["step"] == 3, status


def test_status_is_rewritten_in_place_on_a_disk_too_full_for_the_atomic_replacement(tmp_path):
    """The atomic replacement needs room for a second copy; with none left, the final status must
    still replace "running" (its one block is reused), and no half-written sibling stays."""
    from gpn_scale.train.engine import write_status

    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        write_status(mount, "running", 3, 1)
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
        try:  # fill the rest to the last byte
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        with pytest.raises(OSError):
            (mount / "probe").write_text("x" * 5000)  # truly full
        (mount / "probe").unlink(missing_ok=True)
        write_status(mount, "failed", 3, 1, "checkpoint ...: no space left on device")
        assert json.loads((mount / "status.json").read_text()) == {
            "status": "failed", "step": 3, "world_size": 1, "reason": "checkpoint ...: no space left on device"}
        assert sorted(p.name for p in mount.iterdir()) == ["filler", "status.json"]
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def test_a_crash_mid_run_leaves_status_failed_with_the_exception(data, tmp_path):
    """A save that cannot create its checkpoint directory (`checkpoints` is a file here) is a crash
    after the run said "running": a traceback, exit status 1, and status.json naming the exception."""
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "status.json").write_text('{"status": "failed", "step": null, "world_size": 1}\n')  # an earlier try
    (fresh / "checkpoints").write_text("not a directory")
    proc = train(data, fresh, "train.total_steps=2", expect=1)
    assert "Traceback" in proc.stderr
    status = json.loads((fresh / "status.json").read_text())
    assert status["status"] == "failed" and status["step"] == 2, status
    assert status["reason"].split(":")[0].endswith("Error") and "checkpoints" in status["reason"], status
    assert not (fresh / "trainer.lock").exists()
