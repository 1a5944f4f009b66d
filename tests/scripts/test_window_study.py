"""scripts/window_study.py: the stdlib corpus, its facts, the recall prompts, and a smoke run of
the whole study (corpus, tokenizer, preps, a full-window and a carried run, scores, report)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest

from data_prep.embedded import STDLIB_EXCLUDED, stdlib_documents, stdlib_fingerprint
from support import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import window_study  # noqa: E402


def test_the_stdlib_corpus_is_the_library_without_its_tests_and_the_same_twice(tmp_path):
    docs = stdlib_documents()
    paths = [path for _, path, _ in docs]
    assert len(docs) > 300 and sum(len(t) for *_, t in docs) > 5_000_000  # characters: millions of tokens
    assert paths == sorted(paths) and "Lib/json/decoder.py" in paths
    assert not any(STDLIB_EXCLUDED.intersection(p.split("/")[1:-1]) for p in paths)
    assert stdlib_fingerprint(docs) == stdlib_fingerprint(stdlib_documents())
    # another tree is another corpus, with another fingerprint
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.py").write_text("assert True\n")
    (tmp_path / "empty.py").write_text("\n")
    other = stdlib_documents(tmp_path)
    assert [p for _, p, _ in other] == ["Lib/pkg/a.py"] and stdlib_fingerprint(other) != stdlib_fingerprint(docs)


def test_facts_set_a_key_then_recall_it_at_log_uniform_gaps():
    text = "\n".join(f"line {i} " + "x" * 30 for i in range(4000))
    out = window_study.with_facts(text, random.Random(1), (8, 128))
    lines = out.split("\n")
    assert [l for l in lines if not l.startswith("#")] == text.split("\n")  # the text itself is untouched
    assert window_study.without_facts(out) == text  # and the facts come out again whole
    value, recalls, gaps, last = None, 0, [], None
    for i, line in enumerate(lines):
        if line.startswith("# key = "):
            value, last = line.split()[-1], i
            assert value in window_study.VALUES
        elif line.startswith(window_study.QUERY_PREFIX):
            assert line.split()[-1] == value  # a recall names the key's current value
            gaps.append(sum(len(l) + 1 for l in lines[last + 1 : i]) / window_study.CHARS_PER_TOKEN)
            recalls, last = recalls + 1, i
    assert recalls > 100
    # gaps of 8 to 128 tokens, whole lines apart, covering both ends of the log scale
    line = 41 / window_study.CHARS_PER_TOKEN  # a gap ends at the first line start past it (40 characters and "\n")
    assert min(gaps) >= 8 - line and max(gaps) <= 128 + line
    logs = [math.log(g) for g in gaps if g > 0]
    assert min(logs) < math.log(16) and max(logs) > math.log(64)


def test_the_recall_filler_is_the_held_out_text_without_the_corpus_facts(tmp_path):
    from data_prep.embedded import write_documents

    texts = ["\n".join(f"def f{i}_{k}(): return {k}" for k in range(300)) for i in range(4)]
    rng = random.Random(0)
    docs = [(f"u{i}", f"p{i}", window_study.with_facts(t, rng, (8, 64))) for i, t in enumerate(texts)]
    assert all("# key = " in text for *_, text in docs)
    write_documents(tmp_path, docs, "lib", 2, dump="lib")  # the last file (documents 1 and 3) is held out
    filler = window_study.held_out_filler(tmp_path, lambda text: list(text.encode()))
    assert bytes(filler).decode() == texts[1] + "\n" + texts[3] + "\n"


def test_recall_prompts_put_the_value_exactly_d_tokens_before_the_query_value():
    vocab = {}

    def encode(text: str) -> list[int]:  # a word-level stand-in: one token per whitespace-separated piece
        return [vocab.setdefault(w, len(vocab) + 10_000) for w in text.replace("\n", " \n ").split(" ") if w]

    filler = list(range(5000))
    items = window_study.recall_items(encode, filler, [16, 64, 256], trials=5)
    assert [i.distance for i in items] == [16] * 5 + [64] * 5 + [256] * 5
    for item in items:
        (answer,) = item.answer
        full = item.prompt + item.answer
        positions = [k for k, t in enumerate(full) if t == answer]
        assert positions == [len(full) - 1 - item.distance, len(full) - 1]  # the set line's value, d tokens back
    with pytest.raises(SystemExit, match="shorter than the value and the query"):
        window_study.recall_items(encode, filler, [2], trials=1)


@pytest.mark.slow
def test_a_smoke_study_runs_end_to_end(tmp_path):
    out = tmp_path / "study"
    cmd = [sys.executable, str(ROOT / "scripts" / "window_study.py"), str(out), "--window", "64", "--fractions", "1,4",
           "--seeds", "0", "--steps", "3", "--tokens-per-step", "128", "--model", "gpn_m_tiny", "--vocab", "512",
           "--max-files", "48", "--heldout-streams", "2", "--warmup", "1", "--controls", "16"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert [(r["window"], r["carried"], r["streams"]) for r in results] == [(64, False, 2), (16, True, 8), (16, False, 8)]
    for r in results:
        assert r["context"] == 512 and r["bins"][-1]["positions"] == [256, 512]
        assert [x["distance"] for x in r["recall"]] == [16, 32, 64, 128, 256, 512]
        assert all(0 <= x["accuracy"] <= 1 and x["trials"] == window_study.RECALL_TRIALS for x in r["recall"])
        assert math.isfinite(r["heldout_empty"]) and math.isfinite(r["heldout_carried"])
    config = (out / "runs" / "w16_s0" / "config.yaml").read_text()
    assert "carry_state: true" in config and "streams/train" in config
    control = (out / "runs" / "w16_shuffled_s0" / "config.yaml").read_text()
    assert "carry_state: false" in control and "streams/train" not in control
    report = (out / "report.md").read_text()
    assert "| 64 (shuffled, empty state) | 2 |" in report and "| 16 (carried) | 8 |" in report
    assert "| 16 (shuffled, empty state) | 8 |" in report
    assert (out / "window_study.png").stat().st_size > 10_000
    steps = cmd.index("--steps") + 1  # a rerun that would mix its outputs with these is refused before anything runs
    again = subprocess.run([*cmd[:steps], "4", *cmd[steps + 1 :]], capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and again.stderr.strip() == (
        f"window_study: {out / 'study.json'}: this study ran with steps=3, not 4; its outputs would mix: use another OUT")
