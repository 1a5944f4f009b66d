"""`gpn-scale train`: real DeepSpeed (CPU accelerator, gloo), real MDS streams, real processes."""

import fcntl
import glob
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import termios
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from gpn_scale.storage.checkpoints import step_of
from gpn_scale.config import model_config
from data_prep.errors import UserError
from gpn_scale.models import build_model
from gpn_scale.train.config import load_train_config
from gpn_scale.train.engine import EXIT_PREEMPTED
from gpn_scale.train.gc import GarbageCollection
from gpn_scale.train.metrics import flops_per_token
from gpn_scale.train.optim import lr_factor
from kernels.graph import CPU_GRAPHS_ENV
from kernels.side_streams import CPU_STREAMS_ENV
from support.mds_fixture import write_windows
from support.wandb_records import history
from support import ROOT, process_env
from support.train_runs import CONFIG, TOTAL, losses, samples, train, train_cmd  # noqa: F401 (imported by name)

# The runs the 2-rank tests share: a global batch of 12 (2 x 3 micro-batches on 2 ranks) divides
# every world size the world-size test resumes on; every checkpoint is kept for it to branch from.
BATCH = ("train.grad_accum=null", "train.global_batch=12", "train.micro_batch=2", "train.save_every=2",
         f"train.keep_last={TOTAL // 2}")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_windows(root / "train", 300, 32, 512)
    write_windows(root / "val", 16, 32, 512, seed=1)
    return root


def test_the_loops_garbage_collection_runs_on_its_schedule_and_restores_the_collector():
    import gc

    collections = []
    callback = lambda phase, info: phase == "stop" and collections.append(info["generation"])  # noqa: E731
    gc.callbacks.append(callback)
    try:
        with GarbageCollection(every=3) as collector:
            assert not gc.isenabled()
            for step in range(1, 8):
                collections.clear()
                for _ in range(5000):  # enough new objects to trip the automatic thresholds
                    [[]]
                collector.step(step)
                assert collections == ([2] if step % 3 == 0 else []), step  # a full collection, or none
        assert gc.isenabled()
        gc.disable()
        GarbageCollection().close()
        assert not gc.isenabled()  # left as it found it
        gc.enable()
    finally:
        gc.callbacks.remove(callback)
        gc.enable()
    with pytest.raises(ValueError, match="every"):
        GarbageCollection(every=0)


@pytest.fixture(scope="module")
def reference_runs(data, tmp_path_factory):
    """Uninterrupted 2-process runs, one per ZeRO stage under test."""
    root = tmp_path_factory.mktemp("ref")
    for stage in (0, 1, 2, 3):
        train(data, root / f"zero{stage}", 2, *BATCH, f"zero.stage={stage}")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_is_bitwise_identical(data, reference_runs, tmp_path, stage):
    """The uninterrupted run as it was at its middle checkpoint (later checkpoints and records
    left out), resumed in new processes, repeats the second half bit for bit. (Stopping by
    signal and resuming: the SIGTERM test; by `stop_at_step`: the world-size test.)"""
    ref = reference_runs / f"zero{stage}"
    assert len(losses(ref)) == TOTAL
    run, half = tmp_path / "run", TOTAL // 2
    shutil.copytree(ref, run, ignore=lambda d, names: [
        n for n in names if Path(d).name == "checkpoints" and not (n.startswith("step_") and step_of(n) <= half)])
    for name in ("metrics.jsonl", "samples.jsonl"):
        rows = (run / name).read_text().splitlines()
        (run / name).write_text("".join(r + "\n" for r in rows if json.loads(r)["step"] <= half))
    train(data, run, 2, *BATCH, f"zero.stage={stage}", resume="auto")
    assert sorted(losses(run)) == list(range(1, TOTAL + 1))
    assert losses(run) == losses(ref)  # bitwise: exact float equality at every step
    assert samples(run) == samples(ref)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_graphed_core_trains_as_the_eager_one(data, reference_runs, tmp_path, stage):
    """The fused core's loops through the CPU stand-ins for CUDA graphs (kernels/graph.py) and for
    the reverse sweep's side stream (kernels/side_streams.py, which checks its events), with gradient
    accumulation on 2 ranks: ZeRO-1 keeps the accumulated .grad across micro-batches, ZeRO-2 moves
    it into its buckets after each."""
    run = tmp_path / "run"
    proc = train(data, run, 2, *BATCH, f"zero.stage={stage}", extra_env={CPU_GRAPHS_ENV: "1", CPU_STREAMS_ENV: "1"})
    ref = reference_runs / f"zero{stage}"
    assert losses(run) == losses(ref)  # bitwise: the same kernels, run from the graphs' buffers
    # eager, then capture (its replay counted); every later micro-batch replays (12 / 2 per rank, per step)
    micro_batches = TOTAL * 12 // (2 * 2)
    assert (f"fused core graphs: forward 1 eager, 1 captured, {micro_batches - 1} replayed, 0 failed"
            in proc.stdout), proc.stdout[-3000:]


@pytest.mark.slow
def test_sigterm_on_one_rank_checkpoints_and_resumes_exactly(data, reference_runs, tmp_path):
    import psutil

    run = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(data, run, 2, *BATCH, "zero.stage=2"), env=process_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.time() < deadline, "run ended before it could be signalled"
        time.sleep(0.05)
    ranks = psutil.Process(proc.pid).children()
    assert len(ranks) == 2
    ranks[1].send_signal(signal.SIGTERM)  # one rank only: the other learns at the step boundary
    stdout, stderr = proc.communicate(timeout=300)
    assert f"exitcode  : {EXIT_PREEMPTED}" in stderr or proc.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert "SIGTERM received: checkpointed at step" in stdout
    stopped_at = max(losses(run))
    assert 2 <= stopped_at < TOTAL
    assert (run / "checkpoints" / f"step_{stopped_at:08d}" / "manifest.json").is_file()

    train(data, run, 2, *BATCH, "zero.stage=2", resume="auto")
    ref = reference_runs / "zero2"
    assert losses(run) == losses(ref)
    assert samples(run) == samples(ref)


def first_windows_loss(run, step: int, val: Path, n: int) -> float:
    """The mean loss of the run's model at `step` over the first `n` windows of `val`, each from the
    empty state, in this one process."""
    import torch

    from gpn_scale.storage.mds_datasets import reading
    from gpn_scale.storage.checkpoints import load_model

    model = load_model(Path(run) / "checkpoints" / f"step_{step:08d}").eval()
    with reading(local=str(val), shuffle=False, batch_size=1) as ds:
        x = torch.stack([torch.from_numpy(ds[i]["tokens"].astype("int64")) for i in range(n)])
    with torch.no_grad():
        return model(x).token_losses.double().mean().item()


VAL_BATCHES = 3  # 6 windows: blocks of 2 on 3 ranks, 3 on 2 (one forward of 2 rows, one of 1)
WORLD_CHAIN = (3, 1, 2)  # after the reference's 2 ranks, every direction: 2 -> 3 up, 3 -> 1 down, 1 -> 2 up from one rank
CHAIN_STEPS = 2 * (len(WORLD_CHAIN) + 1)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_world_size_changes_keep_the_sample_order_and_the_losses(data, reference_runs, tmp_path, stage):
    """The uninterrupted 2-rank run taken from its step-2 checkpoint on 3, 1, then 2 ranks (2
    steps each; its global batch of 12 divides every world size). ZeRO-2 and ZeRO-3, whose
    checkpoints DeepSpeed partitions differently; ZeRO-1's are ZeRO-2's (one optimizer class, the
    gradients' partitioning is not saved), converted by the same path."""
    ref = reference_runs / f"zero{stage}"
    run = tmp_path / "run"
    step_2 = "step_00000002"
    # The reference as it was at step 2 (its later checkpoints and `latest` left out); the resume
    # drops its later records.
    shutil.copytree(ref, run, ignore=lambda d, names: [n for n in names if Path(d).name == "checkpoints" and n != step_2])
    for i, world in enumerate(WORLD_CHAIN):  # each stage ends with an evaluation (eval.every=2)
        proc = train(data, run, world, *BATCH, f"zero.stage={stage}", f"train.stop_at_step={2 * (i + 2)}",
                     "eval.every=2", f"eval.batches={VAL_BATCHES}", resume="auto")
        assert f"world size {(2, *WORLD_CHAIN)[i]} -> {world}: converting" in proc.stdout
    assert samples(run) == samples(ref)[:CHAIN_STEPS]  # the same global order, step by step
    flat = sum(samples(run), [])
    assert len(flat) == len(set(flat)) == CHAIN_STEPS * 12  # nothing repeated or skipped
    assert sorted(losses(run)) == list(range(1, CHAIN_STEPS + 1))
    for step in range(1, CHAIN_STEPS + 1):  # the same run, up to float reduction order
        assert losses(run)[step] == pytest.approx(losses(ref)[step], rel=1e-5), step
    # 3, 1 and 2 ranks each scored the same windows: the split's first eval.batches x train.micro_batch
    val = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r}
    assert sorted(val) == [4, 6, 8]
    assert all(r["val_tokens"] == VAL_BATCHES * 2 * 32 for r in val.values()), val
    for step, row in val.items():
        assert row["val_loss"] == pytest.approx(first_windows_loss(run, step, data / "val", VAL_BATCHES * 2), rel=1e-5)


def test_corrupted_newest_checkpoint_falls_back_to_the_previous(data, tmp_path):
    run = tmp_path / "run"
    train(data, run, 1, "zero.stage=1", "train.stop_at_step=6")
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000006"
    victim = next((ckpts / "step_00000006").glob("*optim_states.pt"))
    data_bytes = bytearray(victim.read_bytes())
    data_bytes[len(data_bytes) // 2] ^= 0xFF
    victim.write_bytes(bytes(data_bytes))
    (ckpts / "step_00000009").mkdir()  # a crash mid-save: no manifest
    (ckpts / "step_00000009" / "mp_rank_00_model_states.pt").write_bytes(b"partial")

    proc = train(data, run, 1, "zero.stage=1", "train.stop_at_step=7", resume="auto")
    warnings = [l for l in proc.stderr.splitlines() if l.startswith("warning: checkpoint")]
    assert len(warnings) == 2
    assert "step_00000009 skipped: incomplete" in warnings[0]
    assert "step_00000006 skipped:" in warnings[1] and "xxh3_128 hash (corrupted)" in warnings[1]
    assert f"resumed from {ckpts / 'step_00000003'} at step 3" in proc.stdout
    assert sorted(losses(run)) == list(range(1, 8))


def test_fresh_start_refuses_a_run_dir_with_checkpoints(data, tmp_path):
    run = tmp_path / "run"
    train(data, run, 1, "train.stop_at_step=3")
    proc = train(data, run, 1, "train.stop_at_step=3", expect=2)
    assert "already has checkpoints" in proc.stderr and "--resume auto" in proc.stderr


def test_wandb_offline_logs_the_metrics_into_the_run_dir(data, tmp_path):
    """Also: what people watch (step time, peak memory, elapsed, ETA, MFU where a peak is set)."""
    run = tmp_path / "run"
    proc = train(data, run, 1, "logging.wandb=offline", "train.total_steps=4", "logging.peak_tflops=0.001")
    files = glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    rows = history(files[0])
    logged = {r["_step"]: r["loss"] for r in rows if "loss" in r}
    assert logged == losses(run)
    assert {r["_step"]: r["peak_mem_bytes"] for r in rows if "loss" in r} == {
        r["step"]: r["peak_mem_bytes"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r}
    assert any("val_loss" in r for r in rows)
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    fpt = flops_per_token(build_model(model_config("gpn_m_tiny")), 32)
    for r in records:
        assert r["tokens"] == r["step"] * 4 * 32 and r["tokens_per_s"] == pytest.approx(4 * 32 / r["step_time_s"])
        assert 100 << 20 < r["peak_mem_bytes"] < psutil.virtual_memory().total  # a process with torch: its RSS
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / 1e9)  # tokens/s x FLOPs/token / peak
    assert [r["eta_s"] is None for r in records] == [True, False, False, False]  # no rate from the first step
    assert records[-1]["eta_s"] == 0 and records[-1]["elapsed_s"] >= sum(r["step_time_s"] for r in records)
    assert [r["elapsed_s"] for r in records] == sorted(r["elapsed_s"] for r in records)
    # Off a terminal: the plain line, at the last step at least.
    assert re.search(r"^step 4/4 \| loss \d+\.\d{4} \| [\d,]+ tok/s \| \d+\.\d GiB \| \d+s elapsed, ETA 0s$",
                     proc.stdout, re.M), proc.stdout


def test_lr_schedule_is_warmup_then_cosine_to_ten_percent():
    assert lr_factor(0, 100, 10_000, 0.1) == pytest.approx(0.01)
    assert lr_factor(99, 100, 10_000, 0.1) == pytest.approx(1.0)
    assert lr_factor(10_000, 100, 10_000, 0.1) == pytest.approx(0.1)
    mid = lr_factor(5050, 100, 10_000, 0.1)
    assert mid == pytest.approx(0.55)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.totl_steps=5", "train.totl_steps: unknown key"),
        ("train.total_steps=ten", "train.total_steps: expected int, got str"),
        ("zero.stage=4", "zero.stage: expected one of 0, 1, 2, 3, got 4"),
        ("precision=fp16", "precision: expected one of fp32, bf16, got 'fp16'"),
        ("optimizer.lr=1", "optimizer: unknown key"),
        ("model.d_state=wide", "command-line override: model.d_state: expected int"),  # not the YAML file
        ("model.recompute_every=128", "model.recompute_every: 128 has no effect with model.core=fused"),
    ],
)
def test_config_validator_names_the_key(override, message):
    with pytest.raises(UserError, match=message) as e:
        load_train_config(CONFIG, [override])
    assert "\n" not in str(e.value)


def test_the_old_name_of_recompute_every_is_refused_in_a_model_yaml_and_a_train_configs_model(tmp_path):
    """checkpoint_every, now recompute_every: refused in one line naming the new key, blamed on the file
    that gives it (the override: test_cli.py); a checkpoint that saved it still loads (test_train_faults.py)."""
    model_file = tmp_path / "old.yaml"
    model_file.write_text(yaml.safe_dump({"family": "gpn_m", "core": "naive", "checkpoint_every": 8}))
    for source, message in ((model_file, f"{model_file}: checkpoint_every: renamed; use recompute_every"),
                            ({"model": {"family": "gpn", "checkpoint_every": 8}, "run": {"dir": "r"},
                              "data": {"train": "d"}},
                             "config: model: checkpoint_every: renamed; use recompute_every")):
        with pytest.raises(UserError) as e:
            model_config(source) if isinstance(source, Path) else load_train_config(source)
        assert str(e.value) == message
    train_file = tmp_path / "train.yaml"
    train_file.write_text(yaml.safe_dump({"model": str(model_file), "run": {"dir": "r"}, "data": {"train": "d"}}))
    with pytest.raises(UserError) as e:
        load_train_config(train_file)
    assert str(e.value) == f"{model_file}: checkpoint_every: renamed; use recompute_every"


def test_shipped_configs_load_and_agree_on_the_130m_learning_rate():
    from gpn_scale.sweep.spec import load_spec

    for path in sorted((ROOT / "configs" / "train").glob("*.yaml")):
        load_train_config(path, ["data.train=x"])  # recompute_every only where it has an effect
    assert load_train_config(CONFIG, ["model.recompute_every=128", "model.core=naive"]).model.recompute_every == 128
    spec, _ = load_spec(ROOT / "configs" / "sweeps" / "gpu_130m_to_1b.yaml")
    recipe = load_train_config("gpn_m_130m_1l", ["data.train=x"]).train.lr
    assert recipe == 6e-4 and spec.lr(130e6) == pytest.approx(recipe)  # the paper's 130M recipe, both places
    assert spec.lr(1.3e9) < recipe < spec.lr(20e6)


def test_resolved_config_inlines_the_model():
    cfg = load_train_config(CONFIG, ["train.global_batch=16", "train.grad_accum=null"])
    assert cfg.model.family == "gpn_m" and cfg.model.d_state == 64
    assert cfg.train.global_batch == 16


def test_off_a_terminal_progress_is_plain_lines_not_a_redrawn_bar(tmp_path, capsys):
    from gpn_scale.train.metrics import MetricsLog, StepMetrics

    log = MetricsLog(tmp_path, {}, "disabled", "p", "n", start_step=0, total_steps=3, enabled=True)
    for step in (1, 2, 3):
        log.progress(StepMetrics(step=step, loss=4.0 - step, lr=1e-3, grad_norm=1.0, tokens=step, tokens_per_s=12345.0,
                                 step_time_s=1.0, peak_mem_bytes=2**30, elapsed_s=60.0 * step, eta_s=60.0 * (3 - step),
                                 mfu=None))
    log.close()
    out, err = capsys.readouterr()
    assert "\r" not in out + err  # pytest's capture is not a terminal: no bar
    # the last step always, then every 30 s
    assert out.splitlines() == ["step 3/3 | loss 1.0000 | 12,345 tok/s | 1.0 GiB | 3m elapsed, ETA 0s"]


def _steps(log, n):
    from gpn_scale.train.metrics import StepMetrics

    for step in range(1, n + 1):
        log.progress(StepMetrics(step=step, loss=4.0 - step, lr=1e-3, grad_norm=1.0, tokens=step, tokens_per_s=12345.0,
                                 step_time_s=1.0, peak_mem_bytes=2**30, elapsed_s=60.0 * step, eta_s=60.0 * (n - step),
                                 mfu=None))


class Terminal:
    """A pseudo-terminal whose output is collected while a process writes to it (a pty's buffer
    is small: unread, it would block the writer)."""

    def __init__(self):
        self.master, self.slave = os.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a window's size, not 0 x 0
        self.chunks = []
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()

    def _drain(self):
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: every writer has closed the other end
                return
            if not data:
                return
            self.chunks.append(data)

    def text(self) -> str:
        """What the terminal showed, once its writers have closed; the pty's own \r\n as \n."""
        self.reader.join(timeout=60)
        os.close(self.master)
        return b"".join(self.chunks).decode(errors="replace").replace("\r\n", "\n")


def test_on_a_terminal_progress_is_a_bar_and_no_lines(tmp_path):
    from gpn_scale.train.metrics import MetricsLog

    term = Terminal()
    with os.fdopen(term.slave, "w") as out:
        log = MetricsLog(tmp_path, {}, "disabled", "p", "n", start_step=0, total_steps=3, enabled=True, out=out)
        _steps(log, 3)
        log.write("resumed from somewhere")
        log.close()
        log.write("done at step 3")
    shown = term.text()
    assert "3/3" in shown and "\r" in shown  # the bar, redrawn
    assert "step 3/3 | loss" not in shown  # no plain lines beside it
    assert shown.count("resumed from somewhere") == shown.count("done at step 3") == 1


def test_progress_and_summary_reach_tee_and_the_terminal_shows_them_once(data, tmp_path):
    """`gpn-scale train ... | tee train.log` on a terminal: the log keeps the progress lines and the
    closing summary (with DeepSpeed's stdout); the terminal, which has both tee's copy of stdout and
    stderr, shows each once and no bar."""
    run, log = tmp_path / "run", tmp_path / "train.log"
    cmd = " ".join(map(str, train_cmd(data, run, 1, "train.total_steps=4", "eval.every=2")))
    term = Terminal()
    proc = subprocess.Popen(["bash", "-c", f"set -o pipefail; {cmd} | tee {log}"], stdin=subprocess.DEVNULL,
                            stdout=term.slave, stderr=term.slave, env=process_env())
    os.close(term.slave)
    code = proc.wait(timeout=600)
    shown = term.text()
    assert code == 0, shown[-5000:]
    kept = log.read_text()
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if "loss" in r][-1]
    val = [r for r in rows if "val_loss" in r][-1]
    progress = f"step 4/4 | loss {final['loss']:.4f} | "
    done = f"done at step 4: checkpoint {run / 'checkpoints' / 'step_00000004'}, metrics {run / 'metrics.jsonl'}"
    summary = re.search(r"^train loss (\S+) \(step 4\) \| val loss (\S+), PPL (\S+) \(step 4\) \| ([\d,]+) tok/s \| "
                        r"wall time (\d+)s$", kept, re.M)
    assert progress in kept and done in kept and summary, kept[-3000:]
    assert float(summary[1]) == pytest.approx(final["loss"], abs=1e-4)
    assert float(summary[2]) == pytest.approx(val["val_loss"], abs=1e-4)
    step_time = sum(r["step_time_s"] for r in rows if "loss" in r)
    assert int(summary[4].replace(",", "")) == pytest.approx(final["tokens"] / step_time, rel=0.01, abs=1)
    assert kept.index("training gpn_m (") < kept.index(progress) < kept.index(done) < kept.index(summary[0])
    for line in (progress, done, summary[0]):  # once on the terminal: tee's copy, nothing of it on stderr
        assert shown.count(line) == 1, shown[-3000:]
    assert "\r" not in shown  # no bar redrawn beside the lines
