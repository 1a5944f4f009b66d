"""Readers beside a live run: `eval`, `generate`, `analyze` and `export` lease the checkpoint they
read, rotation (`train.keep_last`) leaves a leased checkpoint in place and removes it at a later
save, and a lease whose reader is gone (dead process; no heartbeat from another host) holds nothing.

The protocol's steps are driven one by one here, in both orders; then a real run saving at every
step with keep_last=1 is read 20 times while it trains, and no read may fail."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpn_scale.storage import checkpoints, leases
from gpn_scale.cli import main
from gpn_scale.train import checkpoint_writer as ckpt
from support import ROOT

HANG_S = 600  # a limit for hangs only, far beyond an idle machine's time


def make_checkpoint(root: Path, step: int) -> str:
    """A complete (manifest-verified) checkpoint directory: what rotation and readers look at."""
    tag = checkpoints.tag_for(step)
    (root / tag).mkdir(parents=True)
    (root / tag / "trainer_state.json").write_text(json.dumps({"step": step}))
    (root / tag / "weights.bin").write_bytes(bytes([step]) * 64)
    ckpt.write_manifest(root / tag)
    return tag


def save(root: Path, step: int, keep_last: int = 1) -> None:
    """What the trainer does at a save: write the checkpoint, then commit (manifest, latest, rotation)."""
    tag = checkpoints.tag_for(step)
    (root / tag).mkdir(parents=True)
    (root / tag / "weights.bin").write_bytes(bytes([step]) * 64)
    ckpt.commit(root, tag, keep_last, set(), [])


@pytest.fixture(autouse=True)
def _release():
    yield
    leases.release_all()


def test_rotation_keeps_a_leased_checkpoint_until_a_save_after_its_reader_is_done(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    make_checkpoint(root, 1)
    held = checkpoints.training_checkpoint(tmp_path / "run")  # the newest that verifies, leased
    assert held == root / "step_00000001"
    save(root, 2)
    save(root, 3)
    assert checkpoints.tags(root) == ["step_00000003", "step_00000001"]  # step 2 went; step 1 is being read
    assert checkpoints.training_checkpoint(tmp_path / "run", verified=False) == held  # the command's checkpoint
    leases.release_all()  # the command ends
    save(root, 4)
    assert checkpoints.tags(root) == ["step_00000004"]
    assert list((root / leases.LEASES).iterdir()) == []


def test_whichever_side_writes_second_sees_the_other(tmp_path):
    root = tmp_path / "checkpoints"
    tag = make_checkpoint(root, 1)
    lease = leases.take(root, tag)  # a reader first: rotation backs off
    assert not leases.remove_unless_read(root, tag)
    assert (root / tag).is_dir() and not (root / leases.LEASES / f"{tag}.removing").exists()
    lease.release()
    (root / leases.LEASES / f"{tag}.removing").write_text("{}")  # rotation first: the reader backs off
    assert leases.take(root, tag) is None
    assert list((root / leases.LEASES).glob(f"{tag}.reader.*")) == []
    (root / leases.LEASES / f"{tag}.removing").unlink()
    assert leases.remove_unless_read(root, tag)
    assert not (root / tag).exists() and leases.take(root, tag) is None  # and a gone one is not leased


def test_a_checkpoint_being_removed_is_passed_over_for_the_next(tmp_path, capsys):
    root = tmp_path / "run" / "checkpoints"
    make_checkpoint(root, 1)
    newest = make_checkpoint(root, 2)
    (root / leases.LEASES).mkdir()
    (root / leases.LEASES / f"{newest}.removing").write_text("{}")
    assert checkpoints.training_checkpoint(tmp_path / "run") == root / "step_00000001"
    leases.release_all()
    assert main(["eval", str(root / newest), "--data", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert f"{root / newest}: no such checkpoint (rotation, train.keep_last, is removing it" in capsys.readouterr().err


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_readers_lease_is_stale_and_a_live_one_from_another_host_is_not(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        make_checkpoint(root, step)
    (root / leases.LEASES).mkdir()

    def lease(tag, holder, age_s):
        path = root / leases.LEASES / f"{tag}.reader.x"
        path.write_text(holder if isinstance(holder, str) else json.dumps(holder))
        os.utime(path, (time.time() - age_s,) * 2)

    lease("step_00000001", {"host": socket.gethostname(), "pid": _dead_pid()}, 0)  # killed on this host
    lease("step_00000002", {"host": "elsewhere", "pid": 1}, leases.STALE_S + 60)  # another host, silent
    lease("step_00000003", {"host": "elsewhere", "pid": 1}, leases.STALE_S / 2)  # another host, beating
    lease("step_00000004", '{"host": "', leases.STALE_S / 2)  # being written (or torn): live until it ages
    assert [leases.remove_unless_read(root, checkpoints.tag_for(s)) for s in (1, 2, 3, 4)] == [True, True, False, False]
    assert checkpoints.tags(root) == ["step_00000004", "step_00000003"]
    assert sorted(p.name for p in (root / leases.LEASES).iterdir()) == ["step_00000003.reader.x", "step_00000004.reader.x"]


def test_the_heartbeat_refreshes_every_lease_held(tmp_path):
    root = tmp_path / "checkpoints"
    tag = make_checkpoint(root, 1)
    lease = leases.take(root, tag)
    file = lease.file
    os.utime(file, (time.time() - 3 * leases.STALE_S,) * 2)
    leases._heartbeat.refresh()  # what the heartbeat thread does every HEARTBEAT_S
    assert time.time() - file.stat().st_mtime < leases.STALE_S
    lease.release()
    assert not file.exists()


def test_where_no_lease_can_be_written_the_checkpoint_is_read_without_one(tmp_path):
    """As on a read-only mount (here: `.leases` cannot be made a directory)."""
    root = tmp_path / "run" / "checkpoints"
    make_checkpoint(root, 1)
    (root / leases.LEASES).write_text("not a directory")
    assert checkpoints.training_checkpoint(tmp_path / "run") == root / "step_00000001"


# ---- for real: readers beside a run that saves at every step and keeps one checkpoint

def _wait_for(condition, what: str):
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, f"hung waiting for {what}"
        time.sleep(0.05)


def test_readers_beside_a_run_rotating_at_every_step_never_fail(tmp_path, capsys):
    from support.eval_fixtures import make_prep, make_tokenizer

    prep = make_prep(tmp_path / "data", make_tokenizer(tmp_path / "tok.json"))
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    trainer = subprocess.Popen(
        [sys.executable, "-m", "gpn_scale", "train", "gpn_m_tiny", f"run.dir={run}", f"data.train={prep / 'train'}",
         f"data.val={prep / 'val'}", "zero.stage=3", "train.total_steps=100000",
         "train.save_every=1", "train.keep_last=1", "eval.batches=1"],
        cwd=ROOT, env=dict(env, OMP_NUM_THREADS="1", WANDB_MODE="disabled"),
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "train.log", "w"))
    latest = run / "checkpoints" / "latest"
    commands = [
        ["eval", str(run), "--data", str(prep), "--windows", "2", "--out", None],
        ["generate", str(run), "--prompt", "the cat", "--max-new-tokens", "4"],
        ["analyze", str(run), "--data", str(prep), "--windows", "2", "--out", None],
        ["export", str(run), "--to", "native", "--out", None],
    ]  # None: a new --out for each call (these commands overwrite nothing)
    failures, steps_read = [], set()
    try:
        _wait_for(lambda: latest.is_file() or trainer.poll() is not None, "the first checkpoint")
        for i in range(20):
            before = latest.read_text()
            _wait_for(lambda: latest.read_text() != before or trainer.poll() is not None, "the next checkpoint")
            assert trainer.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
            argv = [a if a is not None else str(tmp_path / f"out{i}") for a in commands[i % len(commands)]]
            try:
                status = main(argv)
            except Exception as e:  # noqa: BLE001  (a traceback is what this test is about)
                status = f"{type(e).__name__}: {e}"
            err = capsys.readouterr().err
            if status != 0 or "error" in err:
                failures.append((argv[0], status, err[-500:]))
            steps_read.add(latest.read_text())
    finally:
        trainer.send_signal(signal.SIGTERM)
        trainer.wait(timeout=HANG_S)
    assert failures == []
    assert len(steps_read) >= 10  # the run saved (and rotated) between reads
    assert list((run / "checkpoints" / leases.LEASES).glob("*.reader.*")) == []  # every reader let go
    assert len(checkpoints.tags(run / "checkpoints")) == 1  # and rotation caught up: keep_last=1
