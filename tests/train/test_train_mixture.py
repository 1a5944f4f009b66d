"""Dataset mixtures: `data.train` / `data.val` as lists of sources, through Streaming's own Stream
weights; real MDS data, real DeepSpeed ranks."""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from gpn_scale.storage.mds_datasets import release
from data_prep.errors import UserError
from gpn_scale.train import preflight
from gpn_scale.train.config import DataSource, load_train_config
from gpn_scale.train.batches import ShuffledBatches
from support.mds_fixture import write_windows
from support import ROOT, gpn_scale_command, process_env

CONFIG = ROOT / "configs" / "train" / "gpn_m_tiny.yaml"
SEQ, VOCAB = 32, 512  # VOCAB: the model's (gpn_m_tiny)
DATA_VOCAB = 500  # the sources' tokenizer: smaller than the model's, which the run warns about
SIZES = {"web": 240, "code": 40}  # windows per source: the small one is upsampled by its proportion


def _stats(out: Path, vocab: int = VOCAB, sha256: str = "a" * 64) -> None:
    """The prep's stats.json beside a split, with what the trainer reads of it."""
    (out / "stats.json").write_text(json.dumps({"vocab_size": vocab, "eos_id": 0,
                                                "tokenizer": {"sha256": sha256, "vocab_size": vocab}}))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    for i, (name, n) in enumerate(SIZES.items()):
        write_windows(root / name / "train", n, SEQ, DATA_VOCAB, seed=i)
        write_windows(root / name / "val", 6 + 2 * i, SEQ, DATA_VOCAB, seed=10 + i)
        _stats(root / name, vocab=DATA_VOCAB)
    return root


def mixture(data, **weights) -> list[DataSource]:
    return [DataSource(path=str(data / name / "train"), **{k: v[i] for k, v in weights.items()})
            for i, name in enumerate(SIZES)]


def config(data, **data_section):
    return load_train_config({"model": "gpn_m_tiny", "run": {"dir": str(data / "run")},
                              "data": {"train": str(data / "web" / "train"), **data_section}})


def test_sources_are_named_and_weighted_and_bad_lists_are_one_line(data):
    cfg = config(data, train=[{"path": str(data / "web" / "train"), "proportion": 3},
                              {"path": str(data / "code" / "train"), "proportion": 1}],
                 val=[str(data / "web" / "val"), str(data / "code" / "val")])  # a path alone is a source
    assert [(s.name, s.proportion) for s in cfg.data.train] == [("web", 3.0), ("code", 1.0)]
    assert [s.name for s in cfg.data.val] == ["web", "code"]
    web, code = str(data / "web" / "train"), str(data / "code" / "train")
    refusals = {
        "data.train[1]: all once, but data.train[0] has proportion 0.5":
            dict(train=[{"path": web, "proportion": 0.5}, {"path": code}]),
        "data.train[0].repeat: give one of proportion, repeat or choose, not proportion and repeat":
            dict(train=[{"path": web, "proportion": 0.5, "repeat": 2}]),
        "data.train[0].proportion: expected a finite number > 0, got 0.0":
            dict(train=[{"path": web, "proportion": 0}]),
        "data.train[1].proprtion: unknown key; did you mean data.train[1].proportion?":
            dict(train=[{"path": web, "proportion": 1}, {"path": code, "proprtion": 2}]),
        "data.train: two sources are named 'web'": dict(train=[{"path": web}, {"path": web, "repeat": 2}]),
        "data.val[0]: proportion 1.0: validation scores each source's first windows, unweighted":
            dict(val=[{"path": str(data / "web" / "val"), "proportion": 1}]),
    }
    for expected, section in refusals.items():
        with pytest.raises(UserError) as e:
            config(data, **section)
        assert expected in str(e.value) and "\n" not in str(e.value), (expected, str(e.value))
    with pytest.raises(UserError, match=r"data.train: a mixture of 2 sources with train.carry_state=true"):
        load_train_config({"model": "gpn_m_tiny", "run": {"dir": str(data / "run")}, "train": {"carry_state": True},
                           "data": {"train": [web, code]}})


def test_the_sources_of_a_mixture_share_one_tokenizer_and_window_length(data, tmp_path):
    other = tmp_path / "other"
    write_windows(other / "train", 20, SEQ, DATA_VOCAB)
    _stats(other, vocab=DATA_VOCAB, sha256="b" * 64)
    cfg = config(data, train=[str(data / "web" / "train"), str(other / "train")])
    with pytest.raises(UserError, match=r"data.train\[1\] \(other\): .* was tokenized with another tokenizer than "
                                        r"data.train\[0\] \(web\) .*: tokenizer sha256 bbbbbbbbbbbb\.\.\. against "
                                        r"aaaaaaaaaaaa\.\.\."):
        preflight.check(cfg, "none")
    longer = tmp_path / "longer"
    write_windows(longer / "train", 20, 2 * SEQ, DATA_VOCAB)
    _stats(longer, vocab=DATA_VOCAB)
    cfg = config(data, train=[str(data / "web" / "train"), str(longer / "train")])
    with pytest.raises(UserError, match=rf"data.train\[1\] \(longer\): windows of {2 * SEQ} tokens, "
                                        rf"data.train\[0\] \(web\)'s have {SEQ}"):
        preflight.check(cfg, "none")
    with pytest.raises(UserError, match=r"data.train\[1\] \(nowhere\): .*no MDS index.json"):
        preflight.check(config(data, train=[str(data / "web" / "train"), str(tmp_path / "nowhere")]), "none")


def test_the_model_vocabulary_against_the_tokenizers(data, tmp_path):
    """Smaller than the data's vocabulary: refused with both numbers. Larger: a warning with both."""
    big = tmp_path / "big"
    write_windows(big / "train", 20, SEQ, VOCAB)
    _stats(big, vocab=VOCAB + 100)
    with pytest.raises(UserError, match=rf"a vocabulary of {VOCAB + 100} .* more than the model's vocab_size {VOCAB}"):
        preflight.check(config(data, train=str(big / "train")), "none")
    small = tmp_path / "small"
    write_windows(small / "train", 20, SEQ, 371)
    _stats(small, vocab=371)
    warned = []
    preflight.check(config(data, train=str(small / "train")), "none", warn=warned.append)
    assert len(warned) == 1 and f"model.vocab_size {VOCAB} is larger than the vocabulary of 371" in warned[0]
    same = tmp_path / "same"
    write_windows(same / "train", 20, SEQ, VOCAB)
    _stats(same, vocab=VOCAB)
    warned.clear()
    preflight.check(config(data, train=str(same / "train")), "none", warn=warned.append)
    assert warned == []  # the same size: nothing to say


def _epoch(batches: ShuffledBatches) -> list[int]:
    ids = []
    while len(ids) < len(batches) - batches.micro_batch + 1:
        ids += next(batches)["sample_id"].tolist()
    return ids


@pytest.mark.parametrize("weights", [{"proportion": (3, 1)}, {"repeat": (0.5, 2.0)}, {"choose": (100, 100)}])
def test_an_epoch_draws_each_source_as_weighted_and_resumed_batches_go_on_alike(data, weights):
    planned = {"proportion": [210, 70], "repeat": [120, 80], "choose": [100, 100]}[next(iter(weights))]
    batches = ShuffledBatches(mixture(data, **weights), None, 4, 1, shuffle=True, seed=3, num_canonical_nodes=1)
    try:
        assert [drawn for _, _, drawn in batches.epoch_plan()] == planned
        ids = _epoch(batches)
        assert batches.count_sources(ids) == planned  # the whole epoch, exactly as planned
        assert batches.record_mix(batches.count_sources(ids[:40])) == pytest.approx(
            {"web": batches.count_sources(ids[:40])[0] / 40, "code": batches.count_sources(ids[:40])[1] / 40})
    finally:
        release(batches.dataset)
    again = ShuffledBatches(mixture(data, **weights), None, 4, 1, shuffle=True, seed=3, num_canonical_nodes=1)
    resumed = ShuffledBatches(mixture(data, **weights), None, 4, 1, shuffle=True, seed=3, num_canonical_nodes=1)
    try:
        first = [next(again)["sample_id"].tolist() for _ in range(5)]
        resumed.load_state_dict(again.state_dict())
        assert sum(first, []) == ids[:20]  # the same seed: the same order
        assert [next(resumed)["sample_id"].tolist() for _ in range(5)] == [next(again)["sample_id"].tolist()
                                                                          for _ in range(5)]
    finally:
        release(again.dataset)
        release(resumed.dataset)


def _train(data, run_dir, nproc, *overrides, resume=None):
    sources = ", ".join(f"{{path: {data / name / 'train'}, proportion: {p}}}" for name, p in zip(SIZES, (0.7, 0.3)))
    cmd = [*gpn_scale_command(nproc), "train", str(CONFIG), f"run.dir={run_dir}", f"data.train=[{sources}]",
           f"data.val=[{data / 'web' / 'val'}, {data / 'code' / 'val'}]", "data.log_sample_ids=true",
           "train.total_steps=6", "train.save_every=2", "train.keep_last=3", "train.grad_accum=null",
           "train.global_batch=8", "train.micro_batch=2", "eval.every=2", "eval.batches=2", *overrides]
    proc = subprocess.run(cmd + (["--resume", resume] if resume else []), capture_output=True, text=True, timeout=600,
                          env=process_env())
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_mixture_trains_resumes_on_another_world_size_and_logs_its_mix_and_each_sources_loss(data, tmp_path):
    ref = tmp_path / "ref"
    proc = _train(data, ref, 2)
    assert "data: a mixture of 2 sources; samples per epoch: web 196 of its 240 (proportion 0.7), code 84 of its " \
           "40 (proportion 0.3)" in proc.stdout
    warning = [line for line in proc.stderr.splitlines() if "model.vocab_size" in line]
    assert len(warning) == 1 and f"model.vocab_size {VOCAB} is larger than the vocabulary of {DATA_VOCAB}" in warning[0]
    # The run at its step-2 checkpoint, resumed on 1 rank: the same global order, the same losses
    # (up to the summation order of 2 ranks against 1), the realised mix counted on from the checkpoint.
    run = tmp_path / "run"
    shutil.copytree(ref, run, ignore=lambda d, names: [n for n in names if Path(d).name == "checkpoints"
                                                       and n != "step_00000002"])
    _train(data, run, 1, resume="auto")
    samples = [json.loads(line)["samples"] for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples == [json.loads(line)["samples"] for line in (ref / "samples.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in _records(run) if "loss" in r}
    ref_steps = {r["step"]: r for r in _records(ref) if "loss" in r}
    assert sorted(steps) == list(range(1, 7))
    offset = SIZES["web"]  # Streaming numbers the sources' samples one after the other
    read = np.zeros(2)
    for step, ids in enumerate(samples, start=1):
        read += [sum(i < offset for i in ids), sum(i >= offset for i in ids)]
        assert steps[step]["loss"] == pytest.approx(ref_steps[step]["loss"], rel=1e-5)
        assert (steps[step]["mix/web"], steps[step]["mix/code"]) == pytest.approx(tuple(read / read.sum())), step
    assert read.sum() == 6 * 8 and 0 < read[1] < read[0]
    for r in (r for r in _records(run) if "val_loss" in r):  # each source's first 4 windows, and all of them
        per_source = [r["val_loss/web"], r["val_loss/code"]]
        assert r["val_tokens"] == 2 * 4 * SEQ and r["val_loss"] == pytest.approx(sum(per_source) / 2)
        assert per_source[0] != per_source[1]
