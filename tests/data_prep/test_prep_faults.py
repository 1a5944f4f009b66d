"""Prep under faults and bad input, each reproduced through the CLI (the disk-full case in a real process).

A run never loses work and never mixes data; bad input ends it with one line (`error: ...`,
exit 2) naming the file or setting and what was expected, never a library's traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from gpn_scale.cli import main as gpn_main
from support.prep_runs import corpus, fineweb_table, prep, tokenizer, tree_bytes, write_corpus  # noqa: F401 (fixtures)
from support import ROOT

SEQ_LEN = 16


def prep_cli(*args, env: dict | None = None) -> tuple[int, str]:
    """`gpn-scale prep ARGS` as the command line runs it: (exit status, stderr and stdout). In this
    process (a library exception escapes and fails the test), or, with `env`, in a process of its
    own with those variables."""
    if env is not None:
        proc = subprocess.run([sys.executable, "-m", "gpn_scale", "prep", *map(str, args)], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT), **env}, capture_output=True, text=True,
                              timeout=300)
        return proc.returncode, proc.stderr + proc.stdout
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = gpn_main(["prep", *map(str, args)])
        except SystemExit as e:  # argparse's own errors
            code = e.code
    return code, err.getvalue() + out.getvalue()


def one_error(code: int, output: str) -> str:
    """The run's single `error:` line, after checking it is the only one and no traceback came."""
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """Two parquet files of 4 row groups each and one jsonl.zst: 9 work units."""
    return write_corpus(tmp_path_factory.mktemp("small"), files=2, docs_per_file=20, row_group=8)


def args(out: Path, tok: Path, *more) -> list:
    return ["--out", out, "--tokenizer", tok, "--seq-len", SEQ_LEN, "--workers", 1, "--on-error", "skip", *more]


# ---------------------------------------------------------------- resuming with other settings


@pytest.fixture(scope="module")
def prepared(small, tokenizer, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "out"
    assert prep(small, *args(out, tokenizer))[0] == 0
    return out


@pytest.mark.parametrize("change", ["seq_len", "tokenizer"])
def test_a_resume_without_prep_json_refuses_units_made_with_other_settings(change, prepared, small, tokenizer,
                                                                         tmp_path):
    out = tmp_path / "out"
    shutil.copytree(prepared, out)
    (out / "prep.json").unlink()
    (out / "stats.json").unlink()
    if change == "seq_len":
        run_args, expect = args(out, tokenizer, "--seq-len", 2 * SEQ_LEN), [f"seq_len={SEQ_LEN}", f"seq_len={2 * SEQ_LEN}"]
    else:
        other = tmp_path / "other.json"
        assert prep("train-tokenizer", small, "--vocab-size", 300, "--out", other)[0] == 0
        run_args, expect = args(out, other), ["tokenizer"]
    line = one_error(*prep_cli(small, *run_args))
    assert "units/000000.json" in line and all(e in line for e in expect), line
    assert not (out / "prep.json").exists()  # nothing written that a later run would trust

    # The original settings still resume it, to the very same bytes.
    assert prep(small, *args(out, tokenizer))[0] == 0
    assert tree_bytes(out) == tree_bytes(prepared)


def test_a_resume_with_prep_json_and_another_seq_len_is_refused(prepared, small, tokenizer, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(prepared, out)
    code, err = prep(small, *args(out, tokenizer, "--seq-len", 2 * SEQ_LEN), capsys=capsys)
    line = one_error(code, err)
    assert "prep.json" in line and f"seq_len={SEQ_LEN}" in line, line
    assert tree_bytes(out) == tree_bytes(prepared)


def test_units_recording_no_settings_are_refused_once_prep_json_is_gone(prepared, small, tokenizer, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(prepared, out)
    for path in (out / "units").glob("*.json"):  # as an older gpn-scale wrote them
        stats = json.loads(path.read_text())
        stats.pop("settings", None)
        path.write_text(json.dumps(stats))
    # Under an intact prep.json (checked against this run) they are trusted ...
    assert prep(small, *args(out, tokenizer))[0] == 0
    # ... without it nothing says what made them.
    (out / "prep.json").unlink()
    line = one_error(*prep_cli(small, *args(out, tokenizer)))
    assert "units/000000.json" in line and "records no settings" in line and "new --out" in line, line


# ---------------------------------------------------------------- nothing (usable) to prepare


def test_every_input_unreadable_is_an_error_saying_so(small, tokenizer, tmp_path):
    bad = tmp_path / "in"
    bad.mkdir()
    (bad / "a.parquet").write_bytes(b"not parquet at all")
    (bad / "b.parquet").write_bytes((small / "part-000.parquet").read_bytes()[:500])
    line = one_error(*prep_cli(bad, *args(tmp_path / "out", tokenizer)))
    assert "every input" in line and "2 unreadable files" in line and "a.parquet" in line, line
    assert not (tmp_path / "out" / "prep.json").exists()


def test_every_document_bad_is_an_error_saying_so(tokenizer, tmp_path):
    path = tmp_path / "nulls.parquet"
    pq.write_table(fineweb_table([None, None, None]), path)
    line = one_error(*prep_cli(path, *args(tmp_path / "out", tokenizer)))
    assert "nothing prepared" in line and "3 bad documents" in line and "nulls.parquet" in line, line


def test_an_empty_input_is_refused_unless_allowed_then_gives_an_empty_output_and_a_warning(tokenizer, tmp_path):
    path = tmp_path / "empty.parquet"
    pq.write_table(fineweb_table([]), path)
    out = tmp_path / "out"
    line = one_error(*prep_cli(path, *args(out, tokenizer)))
    assert "train: 0 windows: no document was kept" in line and "--allow-empty" in line, line
    assert not (out / "train" / "index.json").exists() and not (out / "stats.json").exists()
    code, output = prep_cli(path, *args(out, tokenizer), "--allow-empty")  # resumes: the units are kept
    assert code == 0 and "Traceback" not in output, output
    assert any(line.startswith("warning:") and "0 windows" in line for line in output.splitlines()), output
    stats = json.loads((out / "stats.json").read_text())
    assert stats["splits"]["train"] == {"documents": 0, "tokens": 0, "windows": 0, "dropped_tail_tokens": 0}
    assert stats["warnings"] and "train: 0 windows" in stats["warnings"][0]
    assert json.loads((out / "train" / "index.json").read_text())["shards"] == []


def test_seq_len_longer_than_every_unit_is_an_error_naming_tokens_and_seq_len(tokenizer, tmp_path):
    path = tmp_path / "short.parquet"
    pq.write_table(fineweb_table(["A short document.", "Another."]), path)
    line = one_error(*prep_cli(path, *args(tmp_path / "out", tokenizer, "--seq-len", 4096)))
    tokens = json.loads((tmp_path / "out" / "units" / "000000.json").read_text())["splits"]["train"]["tokens"]
    assert f"{tokens} tokens" in line and "--seq-len 4096" in line, line


# ---------------------------------------------------------------- empty documents


def test_empty_documents_are_skipped_and_counted_by_default(tokenizer, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["A document.", "", " ", "Another one.", ""]))
    out = tmp_path / "out"
    code, output = prep_cli(path, "--out", out, "--tokenizer", tokenizer, "--seq-len", 4, "--workers", 1)
    assert code == 0, output
    stats = json.loads((out / "stats.json").read_text())
    assert stats["skipped"]["documents"] == {"empty text": 2}
    assert stats["skipped"]["listed"] == []  # not bad documents: counted, not listed
    assert stats["splits"]["train"]["documents"] == 3  # whitespace is text: kept


# ---------------------------------------------------------------- a damaged committed unit


def test_a_committed_unit_with_a_truncated_shard_is_prepared_again(prepared, small, tokenizer, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(prepared, out)
    shard = sorted((out / "train" / "000001").glob("shard.*"))[0]
    shard.write_bytes(shard.read_bytes()[:-7])
    assert prep("merge", out)[0] == 2  # the merge does not index it

    code, output = prep_cli(small, *args(out, tokenizer))
    assert code == 0, output
    warnings = [line for line in output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and shard.name in warnings[0] and "000001" in warnings[0], output
    assert tree_bytes(out) == tree_bytes(prepared)


# ---------------------------------------------------------------- disk full

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* write() fails with ENOSPC once this process has written ENOSPC_AFTER bytes to files under ENOSPC_DIR. */
ssize_t write(int fd, const void *buf, size_t n) {
    static ssize_t (*real)(int, const void *, size_t);
    static long long used;
    if (!real) real = (ssize_t (*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
    const char *dir = getenv("ENOSPC_DIR"), *after = getenv("ENOSPC_AFTER");
    if (dir && after && fd > 2) {
        char link[64], target[PATH_MAX];
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t len = readlink(link, target, sizeof target - 1);
        if (len > 0) {
            target[len] = 0;
            if (strncmp(target, dir, strlen(dir)) == 0) {
                if (used + (long long)n > atoll(after)) { errno = ENOSPC; return -1; }
                used += n;
            }
        }
    }
    return real(fd, buf, n);
}
"""


class SmallDisk:
    """A directory that runs out of space after `limit` bytes: a size-limited tmpfs where mounting
    is allowed, else an LD_PRELOAD shim failing write() with ENOSPC below Python (C code included)."""

    def __init__(self, root: Path, like: Path):
        """Room for about half of what the tree `like` holds."""
        self.path = root / "disk"
        self.path.mkdir()
        files = [p.stat().st_size for p in like.rglob("*") if p.is_file()]
        limit = sum(-(-size // 4096) for size in files) // 2 * 4096  # a tmpfs counts whole pages
        self.mounted = False
        self.env: dict[str, str] = {}
        if os.environ.get("GPN_TEST_ENOSPC") != "preload" and os.geteuid() == 0 and shutil.which("mount"):
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={limit}", "tmpfs", str(self.path)],
                                  capture_output=True)
            self.mounted = done.returncode == 0
        if not self.mounted:
            cc = shutil.which("cc") or shutil.which("gcc")
            if cc is None:
                pytest.skip("cannot mount a tmpfs and no C compiler for an ENOSPC shim")
            (root / "enospc.c").write_text(textwrap.dedent(SHIM))
            lib = root / "enospc.so"
            subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(root / "enospc.c"), "-ldl"], check=True)
            self.env = {"LD_PRELOAD": str(lib), "ENOSPC_DIR": str(self.path.resolve()),
                        "ENOSPC_AFTER": str(sum(files) // 2)}

    def free_space(self) -> None:
        if self.mounted:
            subprocess.run(["mount", "-o", "remount,size=256m", str(self.path)], check=True)
        self.env = {}

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False)


def test_disk_full_is_one_line_naming_the_path_and_a_rerun_completes(prepared, small, tokenizer, tmp_path, capsys):
    disk = SmallDisk(tmp_path, like=prepared)
    try:
        out = disk.path / "out"
        code, output = prep_cli(small, *args(out, tokenizer), env=disk.env)
        line = one_error(code, output)
        assert "no space left on device" in line and str(disk.path) in line, line
        committed = len(list((out / "units").glob("*.json")))
        assert 0 < committed < len(json.loads((prepared / "prep.json").read_text())["units"]), output

        disk.free_space()
        capsys.readouterr()
        code, err = prep(small, *args(out, tokenizer), capsys=capsys)
        assert code == 0 and f"({committed} already committed)" in err, err
        assert tree_bytes(out) == tree_bytes(prepared)
    finally:
        disk.close()


# ---------------------------------------------------------------- flags and inputs


@pytest.mark.parametrize("flag, value", [("--min-score", "nan"), ("--min-score", "inf"), ("--min-score", "-inf")])
def test_a_non_finite_score_floor_is_refused(small, tokenizer, tmp_path, flag, value):
    """`score >= nan` keeps nothing and would leave an output no rerun can resume."""
    line = one_error(*prep_cli(small, *args(tmp_path / "out", tokenizer, f"{flag}={value}")))
    assert line == f"error: {flag}: got {float(value)}, expected a finite number"
    assert not (tmp_path / "out").exists()


def test_no_input_files_names_every_kind_read(tokenizer, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "notes.txt").write_text("x")
    line = one_error(*prep_cli(tmp_path / "in", *args(tmp_path / "out", tokenizer)))
    assert line == f"error: {tmp_path / 'in'}: matched no .parquet, .jsonl, .jsonl.zst, .jsonl.gz files"
