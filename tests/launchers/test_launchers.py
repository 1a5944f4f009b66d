"""Launchers as users run them: `gpn-scale launch`, torchrun elastic membership, SLURM requeue.

Real torchrun agents with a c10d rendezvous, real DeepSpeed, and a real SLURM controller and
node daemon started by the test (Debian's slurm-wlm + munge).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import support.slurm_cluster as slurm_cluster
from gpn_scale.storage import checkpoints as ckpt
from support.mds_fixture import write_windows
from support import ROOT, free_port, listening

CONFIG = ROOT / "configs" / "train" / "gpn_m_tiny.yaml"
VENV_BIN = str(Path(sys.executable).parent)


def env(**extra) -> dict:
    # torchrun, sbatch's job and the trainers must all find this interpreter's environment.
    return {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", **extra}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_windows(root / "train", 400, 32, 512)
    write_windows(root / "val", 16, 32, 512, seed=1)
    return root


def overrides(data, run_dir, steps, save_every=3):
    # global_batch (not grad_accum) keeps the batch, and so the sample order, fixed when the world shrinks.
    return [f"run.dir={run_dir}", f"data.train={data / 'train'}", f"data.val={data / 'val'}",
            "data.log_sample_ids=true", f"train.total_steps={steps}", f"train.save_every={save_every}",
            "train.grad_accum=null", "train.global_batch=4"]


def reference(data, run_dir, steps, save_every=3):
    """An uninterrupted 2-process run on this node, through `gpn-scale launch`."""
    proc = subprocess.run([sys.executable, "-m", "gpn_scale", "launch", str(CONFIG),
                           *overrides(data, run_dir, steps, save_every),
                           "--nproc", "2"], env=env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.startswith("+ ") and "gpn_scale.train.torchrun --standalone" in proc.stdout
    return run_dir


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun puts its workers in their own sessions)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def rows(run_dir, key) -> dict[int, object]:
    name = "samples.jsonl" if key == "samples" else "metrics.jsonl"
    out = {}
    for line in (Path(run_dir) / name).read_text().splitlines():
        row = json.loads(line)
        if key in row:
            out[row["step"]] = row[key]
    return out


def test_launch_prints_the_torchrun_command_and_rejects_bad_input(tmp_path):
    dry = subprocess.run([sys.executable, "-m", "gpn_scale", "launch", "gpn_m_tiny", f"run.dir={tmp_path}",
                          "--nproc", "3", "--nnodes", "2:4", "--rdzv-endpoint", "head:29400", "--max-restarts", "2",
                          "--dry-run"], env=env(), capture_output=True, text=True, cwd=ROOT)
    assert dry.returncode == 0, dry.stderr
    cmd = dry.stdout.strip()
    for part in ("--nnodes 2:4", "--max-restarts 2", "--rdzv-backend c10d", "--rdzv-endpoint head:29400",
                 "--nproc-per-node 3", "-m gpn_scale train gpn_m_tiny", f"run.dir={tmp_path}", "--resume auto"):
        assert part in cmd
    bad = subprocess.run([sys.executable, "-m", "gpn_scale", "launch", "gpn_m_tiny", "train.nope=1", "--dry-run"],
                         env=env(), capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "nope" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_bad_input_to_a_launch_script_is_one_line_before_torchrun_starts(data, tmp_path):
    """torchrun.sh, elastic.sh, train.sbatch and `gpn-scale launch` check the config, the data and
    run.dir once (`gpn-scale train --check`) before any rank starts: one line, exit status 2, and
    neither a line per rank nor torchrun's ChildFailedError traceback (which exits 1)."""
    missing = f"data.train={tmp_path / 'nowhere'}"
    runs = {
        "torchrun.sh": [str(ROOT / "launchers" / "torchrun.sh"), "2", str(CONFIG), *overrides(data, tmp_path / "a", 2),
                        "train.nope=1"],
        "elastic.sh": [str(ROOT / "launchers" / "elastic.sh"), str(CONFIG), *overrides(data, tmp_path / "b", 2), missing],
        # the stream count against the global batch of 4: train.sbatch checks before it asks SLURM anything
        "train.sbatch": ["bash", str(ROOT / "launchers" / "slurm" / "train.sbatch"), str(CONFIG),
                         *overrides(data, tmp_path / "c", 2), "train.carry_state=true"],
        "launch": [sys.executable, "-m", "gpn_scale", "launch", str(CONFIG), *overrides(data, tmp_path / "d", 2),
                   "--nproc", "2", missing],
    }
    expected = {"torchrun.sh": "nope", "elastic.sh": "nowhere", "train.sbatch": "no streams.json", "launch": "nowhere"}
    for name, cmd in runs.items():
        proc = subprocess.run(cmd, env=env(RDZV_ENDPOINT=f"127.0.0.1:{free_port()}"), capture_output=True, text=True,
                              timeout=300, cwd=ROOT)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (name, proc.stderr[-3000:])
        assert expected[name] in lines[0], (name, lines[0])
        assert "torchrun" not in proc.stdout, name
    assert not any((tmp_path / d).exists() for d in "abcd")


def test_a_refusal_in_the_ranks_is_one_line_once_with_exit_status_2(data, tmp_path):
    """What the launchers run once the check passed, on 2 real ranks: torchrun through
    gpn_scale.train.torchrun. Every rank refuses the bad key, rank 0 alone prints it, and the
    launcher ends with that line and exit status 2: no ChildFailedError traceback, no agent log."""
    proc = subprocess.run([sys.executable, "-m", "gpn_scale.train.torchrun", "--standalone", "--nnodes", "1",
                           "--nproc-per-node", "2", "-m", "gpn_scale", "train", str(CONFIG),
                           *overrides(data, tmp_path / "run", 2), "train.nope=1", "--resume", "auto"],
                          env=env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [line for line in lines if line.startswith("error: ")] == [lines[-1]] and "nope" in lines[-1], proc.stderr


_MEMBER = """
import json, os, pathlib, sys, time
out = pathlib.Path(sys.argv[1])
(out / f"worker{os.getpid()}.json").write_text(json.dumps({k: os.environ[k] for k in ("RANK", "WORLD_SIZE")}))
while not (out / "stop").exists():
    time.sleep(0.1)
"""


def _agent_logs(tmp_path) -> str:
    """Both agents' logs, the end of each: a failed round is explained by the member that did not answer."""
    return "\n".join(f"== agent{i}.log ==\n" + (tmp_path / f"agent{i}.log").read_text(errors="replace")[-3000:]
                     for i in range(2))


def test_a_node_joining_a_running_elastic_job_is_admitted(tmp_path):
    """Scale-up through the launchers' torchrun: a second node arrives after the first one's round
    closed and its worker runs. The agents must restart as a world of 2. With torch's shared
    rendezvous store the newcomer waits for an address that rank 0 wrote in the earlier round only,
    and both agents end in a store timeout instead (gpn_scale/train/torchrun.py turns sharing off)."""
    (tmp_path / "member.py").write_text(_MEMBER)
    port = free_port()
    cmd = [sys.executable, "-m", "gpn_scale.train.torchrun", "--nnodes", "1:2", "--nproc-per-node", "1",
           "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "scale-up", "--rdzv-conf", "last_call_timeout=1", "--monitor-interval", "0.5",
           str(tmp_path / "member.py"), str(tmp_path)]

    def worlds() -> list[tuple[str, str]]:
        rows = [json.loads(p.read_text()) for p in tmp_path.glob("worker*.json")]
        return sorted((r["RANK"], r["WORLD_SIZE"]) for r in rows)

    logs = [open(tmp_path / f"agent{i}.log", "w") for i in range(2)]
    agents = [subprocess.Popen(cmd, env=env(), stdout=logs[0], stderr=subprocess.STDOUT, cwd=ROOT)]
    try:
        deadline = time.time() + 600  # hang guards only: each wait ends on what the members wrote
        while worlds() != [("0", "1")]:
            assert time.time() < deadline and agents[0].poll() is None, _agent_logs(tmp_path)
            time.sleep(0.2)
        agents.append(subprocess.Popen(cmd, env=env(), stdout=logs[1], stderr=subprocess.STDOUT, cwd=ROOT))
        while not {("0", "2"), ("1", "2")} <= set(worlds()):
            assert time.time() < deadline and all(a.poll() is None for a in agents), _agent_logs(tmp_path)
            time.sleep(0.2)
        (tmp_path / "stop").touch()
        assert [a.wait(timeout=300) for a in agents] == [0, 0], _agent_logs(tmp_path)
    finally:
        (tmp_path / "stop").touch()
        for a in agents:
            if a.poll() is None:
                kill_tree(a.pid)
        for log in logs:
            log.close()


@pytest.mark.slow
def test_elastic_survivor_finishes_from_the_last_checkpoint(data, tmp_path):
    steps = 12
    ref = reference(data, tmp_path / "ref", steps)
    run_dir = tmp_path / "elastic"
    port = free_port()
    agent_env = env(RDZV_ENDPOINT=f"127.0.0.1:{port}", RDZV_ID="elastic-test", MIN_NODES="1", MAX_NODES="2",
                    MAX_RESTARTS="3", RDZV_CONF="last_call_timeout=5,join_timeout=120")
    cmd = [str(ROOT / "launchers" / "elastic.sh"), str(CONFIG), *overrides(data, run_dir, steps)]
    logs = [open(tmp_path / f"agent{i}.log", "w") for i in range(2)]
    survivor = subprocess.Popen(cmd, env=agent_env, stdout=logs[0], stderr=subprocess.STDOUT, cwd=ROOT)
    # The survivor hosts the rendezvous store (losing that node would end the run): the victim starts
    # once the store listens, however long the survivor takes to start.
    deadline = time.time() + 600  # a hang guard only
    while not listening(port):
        assert time.time() < deadline and survivor.poll() is None, (tmp_path / "agent0.log").read_text()[-4000:]
        time.sleep(0.2)
    victim = subprocess.Popen(cmd, env=agent_env, stdout=logs[1], stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.time() + 600
        while not ckpt.committed(run_dir / "checkpoints"):
            assert time.time() < deadline and survivor.poll() is None and victim.poll() is None, _agent_logs(tmp_path)
            time.sleep(0.2)
        kill_tree(victim.pid)  # the node is gone: its agent and its worker
        killed_at = len(rows(run_dir, "samples"))
        assert survivor.wait(timeout=600) == 0, _agent_logs(tmp_path)
    finally:
        for proc in (survivor, victim):
            if proc.poll() is None:
                kill_tree(proc.pid)
        for log in logs:
            log.close()
    assert killed_at < steps, "the run finished before a member was lost: nothing was tested"
    status = json.loads((run_dir / "status.json").read_text())
    assert status == {"status": "finished", "step": steps, "world_size": 1}
    # The survivor alone replays from the checkpoint the same global sample order, step by step.
    assert rows(run_dir, "samples") == rows(ref, "samples")
    ref_loss, loss = rows(ref, "loss"), rows(run_dir, "loss")
    assert sorted(loss) == list(range(1, steps + 1))
    assert loss[steps] == pytest.approx(ref_loss[steps], rel=1e-3)  # world 2 -> 1 changes only the summation order


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not slurm_cluster.available():
        pytest.skip("needs slurm-wlm and munge (scripts/test.sh installs them)")
    cluster = slurm_cluster.Cluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


def wait_for(cluster, job_id: str, timeout: float = 900) -> dict:
    """Poll until the job ends; release requeued jobs at once instead of after SLURM's back-off."""
    deadline, state = time.time() + timeout, {}
    while time.time() < deadline:
        state = cluster.job(job_id)
        if state["JobState"] in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        if state["JobState"] == "PENDING" and state.get("Reason") == "BeginTime":
            cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        time.sleep(2)
    return state


@pytest.mark.slow
def test_slurm_job_checkpoints_at_the_time_limit_signal_requeues_and_finishes(data, cluster, tmp_path):
    # The signal a time limit sends (the template's `--signal=B:USR1@...`) comes from slurmctld's
    # periodic check, at a moment no test controls, and again to every requeued run of a short
    # limit. The test sends the batch script that signal itself (`scancel --batch`, as slurmctld
    # does), once, as soon as the trainers have logged a step: one checkpoint, one requeue.
    # 120 steps: the signal comes after the first (about a second of polling and scancel), and a step
    # of the tiny model on 2 ranks takes at least 0.04 s, so the run is still going when it arrives
    steps = 120
    ref = reference(data, tmp_path / "ref", steps, save_every=40)  # also builds DeepSpeed's CPU ops first
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    submit = cluster.run(
        "sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--time=30", f"--output={log}",
        str(ROOT / "launchers" / "slurm" / "train.sbatch"), str(CONFIG),
        *overrides(data, run_dir, steps, save_every=40), env=env(RDZV_PORT=str(free_port())))
    job = submit.stdout.strip().split(";")[0]
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 300
    while not (metrics.is_file() and '"loss"' in metrics.read_text()) and time.time() < deadline:
        time.sleep(0.2)
    cluster.run("scancel", "--batch", "--signal=USR1", job)
    state = wait_for(cluster, job)
    text = log.read_text(errors="replace")
    assert state.get("JobState") == "COMPLETED", text[-6000:]
    assert int(state["Restarts"]) == 1, text[-4000:]
    assert "[sbatch] USR1 received" in text and "USR1 received: checkpointed at step" in text
    assert "requeueing job" in text
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
    # Interrupted, requeued and resumed: the same losses, bit for bit, as the uninterrupted run.
    assert rows(run_dir, "loss") == rows(ref, "loss")
    assert rows(run_dir, "samples") == rows(ref, "samples")


@pytest.mark.slow
def test_slurm_prep_array_and_merge_write_what_one_process_writes(cluster, tmp_path):
    from support.prep_runs import SEQ_LEN, prep, tree_bytes, write_corpus

    corpus = write_corpus(tmp_path / "corpus", files=3, docs_per_file=40, row_group=11)
    tokenizer = tmp_path / "tok.json"
    assert subprocess.run([sys.executable, "-m", "gpn_scale", "prep", "train-tokenizer", str(corpus),
                           "--vocab-size", "300", "--out", str(tokenizer)], env=env(), cwd=ROOT).returncode == 0
    common = ["--tokenizer", str(tokenizer), "--seq-len", str(SEQ_LEN), "--val-fraction", "0.2", "--on-error", "skip"]
    assert prep(corpus, "--out", tmp_path / "single", "--workers", 1, *common)[0] == 0

    out = tmp_path / "array"
    submitted = subprocess.run([str(ROOT / "launchers" / "slurm" / "prep.sh"), "2", str(corpus), "--out", str(out),
                                *common], env=env(SBATCH_ARGS=f"--output={tmp_path}/%x-%j.out", SLURM_CONF=str(cluster.conf)),
                               capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    array_id, merge_id = (word for word in submitted.stdout.split() if word.isdigit())
    merged = wait_for(cluster, merge_id, timeout=600)
    logs = "\n".join(p.read_text(errors="replace") for p in tmp_path.glob("*.out"))
    assert merged["JobState"] == "COMPLETED", logs[-6000:]
    assert "array task 0 of 2" in logs and "array task 1 of 2" in logs
    assert tree_bytes(out) == tree_bytes(tmp_path / "single")


@pytest.mark.slow
def test_sweep_srun_backend_runs_two_points_at_once_as_job_steps(data, cluster, tmp_path):
    import yaml

    spec, out, log = tmp_path / "spec.yaml", tmp_path / "sweep", tmp_path / "job.log"
    spec.write_text(yaml.safe_dump({
        "train": str(CONFIG), "out": str(out),
        "overrides": {"data.train": str(data / "train"), "data.val": str(data / "val"), "eval.batches": 1,
                      "train.micro_batch": 4},
        "families": ["gpn_m_1l"], "params": ["40e3", "60e3"], "tokens_per_param": [0.05],
        "seq_len": 32, "global_batch": 4}))
    script = tmp_path / "sweep.sh"
    script.write_text(f"#!/bin/bash\nexec {sys.executable} -m gpn_scale sweep {spec} --backend srun --slots 2\n")
    submit = cluster.run("sbatch", "--parsable", "--nodes=1", "--ntasks=2", "--cpus-per-task=1", f"--output={log}",
                         str(script), env=env())
    state = wait_for(cluster, submit.stdout.strip().split(";")[0], timeout=600)
    text = log.read_text(errors="replace")
    assert state.get("JobState") == "COMPLETED", text[-4000:]
    events = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["event"] == "start"]
    ends = [e for e in events if e["event"] == "end"]
    assert len(starts) == 2 and all(e["command"].startswith("srun --exact --nodes=1 --ntasks=1") for e in starts)
    assert all("--cpus-per-task=1" in e["command"] for e in starts)  # the allocation's 2 CPUs, one per step
    assert [e["exit"] for e in ends] == [0, 0] and {e["status"] for e in ends} == {"finished"}
    assert max(e["time"] for e in starts) < min(e["time"] for e in ends)  # the two job steps ran at once
