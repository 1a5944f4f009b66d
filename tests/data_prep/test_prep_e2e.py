"""Multi-process data prep: the output does not depend on workers or nodes, and survives SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gpn_scale.cli import main as gpn_main
from support.prep_runs import SEQ_LEN, expected_stream, prep, read_split, tree_bytes, write_corpus
from support import ROOT

pytestmark = pytest.mark.slow


def prep_process(*args, env_extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "gpn_scale", "prep", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen) -> str:
    output = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 0, output
    return output


def train_tokenizer(corpus: Path, out: Path) -> Path:
    assert gpn_main(["prep", "train-tokenizer", str(corpus), "--vocab-size", "400", "--out", str(out),
                     "--max-docs", "300"]) == 0
    return out


def test_one_worker_and_two_workers_on_two_nodes_write_the_same_bytes(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", files=3, docs_per_file=60, row_group=11)
    tokenizer = train_tokenizer(corpus, tmp_path / "tok.json")
    # with the streams for carried-state training: their bytes too are the same (docs/prep.md, 'Streams')
    common = ["--tokenizer", tokenizer, "--seq-len", SEQ_LEN, "--val-fraction", 0.2, "--on-error", "skip",
              "--streams", 4, "--val-streams", 2]

    single = tmp_path / "single"
    assert prep(corpus, "--out", single, "--workers", 1, *common)[0] == 0

    multi = tmp_path / "multi"
    # Two "machines" at once on one shared output: one told its rank by flags, one by SLURM's array variables.
    node0 = prep_process(corpus, "--out", multi, "--workers", 2, "--num-nodes", 2, "--node-rank", 0, *common)
    node1 = prep_process(corpus, "--out", multi, "--workers", 2, *common,
                         env_extra={"SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_TASK_ID": "1"})
    assert "prep merge" in finish(node0) and "prep merge" in finish(node1)
    assert not (multi / "stats.json").exists()
    assert gpn_main(["prep", "merge", str(multi)]) == 0

    assert tree_bytes(multi) == tree_bytes(single)
    assert any(name.startswith("streams/train/shard.") for name in tree_bytes(single))
    stats = json.loads((multi / "stats.json").read_text())
    for split, (stream, dropped) in expected_stream(corpus, tokenizer, 0.2).items():
        assert read_split(multi / split).ravel().tolist() == stream
        assert stats["splits"][split]["dropped_tail_tokens"] == dropped


def test_merge_refuses_while_a_node_has_not_finished(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", files=1, docs_per_file=30, row_group=10)
    tokenizer = train_tokenizer(corpus, tmp_path / "tok.json")
    out = tmp_path / "out"
    assert prep(corpus, "--out", out, "--tokenizer", tokenizer, "--seq-len", SEQ_LEN, "--workers", 1,
                "--num-nodes", 2, "--node-rank", 0, "--on-error", "skip")[0] == 0
    capsys.readouterr()
    assert gpn_main(["prep", "merge", str(out)]) == 2
    assert "work units are not committed yet" in capsys.readouterr().err


def test_sigkill_mid_run_then_rerun_gives_the_uninterrupted_bytes(tmp_path):
    """The run to kill reads its last input from a named pipe that nothing writes, so it cannot end
    before the kill, whatever the machine's speed; the rerun reads the file itself."""
    corpus = write_corpus(tmp_path / "corpus", files=4, docs_per_file=400, row_group=20)
    last = corpus / "zz-last.jsonl"  # sorts last: the last unit
    last_text = "".join(json.dumps({"text": f"the last file's document {i}"}) + "\n" for i in range(30))
    last.write_text(last_text)
    tokenizer = train_tokenizer(corpus, tmp_path / "tok.json")
    common = ["--tokenizer", tokenizer, "--seq-len", SEQ_LEN, "--val-fraction", 0.1, "--on-error", "skip"]
    clean = tmp_path / "clean"
    assert prep(corpus, "--out", clean, "--workers", 2, *common)[0] == 0
    n_units = len(json.loads((clean / "prep.json").read_text())["units"])

    crashed = tmp_path / "crashed"
    last.unlink()
    os.mkfifo(last)
    proc = prep_process(corpus, "--out", crashed, "--workers", 2, *common)
    deadline = time.monotonic() + 600  # a hang guard only
    while len(list((crashed / "units").glob("*.json"))) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the machine dies: parent and workers at once
    proc.wait()
    committed = len(list((crashed / "units").glob("*.json")))
    assert 3 <= committed < n_units and not (crashed / "stats.json").exists()
    last.unlink()
    last.write_text(last_text)

    output = finish(prep_process(corpus, "--out", crashed, "--workers", 2, *common))
    assert f"({committed} already committed)" in output
    assert tree_bytes(crashed) == tree_bytes(clean)
    assert np.array_equal(read_split(crashed / "train"), read_split(clean / "train"))
