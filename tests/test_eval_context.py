"""`gpn-scale eval --context N` and `--passkey N`: held-out streams scored window after window with
the state carried (checked against one forward over the whole stream, for every family), the
log-spaced bins and plots, passkey scoring against a forward over prompt and key, and the refusals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from eval_fixtures import corpus_texts, make_tokenizer, tiny_model, train
from gpn_scale.cli import main
from gpn_scale.eval.data import open_data, read_windows
from gpn_scale.eval.long_context import PositionBins, make_passkeys, score_passkey
from gpn_scale.storage.native import save_native

SEQ, CONTEXT = 32, 512


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A real prep output with streams, and a trained GPN+M, a GDN and a Transformer saved natively."""
    from gpn_scale.models import GDNConfig, TransformerConfig, build_model

    root = tmp_path_factory.mktemp("context")
    tok = make_tokenizer(root / "tok.json")
    for name, seed in (("train", 0), ("val", 1)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_texts(80, seed)))
    prep = root / "prep"
    assert main(["prep", str(root / "train.jsonl"), str(root / "val.jsonl"), "--val-files", str(root / "val.jsonl"),
                 "--out", str(prep), "--tokenizer", str(tok), "--seq-len", str(SEQ), "--workers", "1",
                 "--streams", "2", "--val-streams", "2"]) == 0
    vocab = json.loads((prep / "stats.json").read_text())["vocab_size"]
    windows = read_windows(open_data(prep / "train"))
    torch.manual_seed(0)
    models = {
        "gpn_m": tiny_model(vocab),
        "gdn": build_model(GDNConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, d_key=8, d_val=8, d_ffn=48,
                                     chunk_size=8)),
        "transformer": build_model(TransformerConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, d_ffn=48)),
    }
    for name, model in models.items():
        save_native(train(model, windows, steps=30), root / name)
    return root, prep, models


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def val_streams(prep) -> torch.Tensor:
    """Each val stream's first CONTEXT tokens, read by hand: sample k * S + i is window k of stream i."""
    from gpn_scale.data.streams import reading

    S = json.loads((prep / "streams" / "val" / "streams.json").read_text())["streams"]
    with reading(local=str(prep / "streams" / "val"), batch_size=1, shuffle=False) as ds:
        return torch.stack([torch.cat([torch.from_numpy(ds[k * S + i]["tokens"].astype(np.int64))
                                       for k in range(CONTEXT // SEQ)]) for i in range(S)])


@pytest.mark.parametrize("family", ["gpn_m", "gdn", "transformer"])
def test_carried_context_scores_the_whole_stream(setup, tmp_path, capsys, family):
    root, prep, models = setup
    out = tmp_path / "out"
    code, stdout, err = run(capsys, "eval", root / family, "--data", prep, "--context", CONTEXT, "--batch", 1,
                            "--json", "--out", out)
    assert code == 0, err
    c = json.loads(stdout)["context"]
    with torch.no_grad():  # one forward over each whole stream: what the carried windows must add up to
        whole = models[family](val_streams(prep)).token_losses.double().mean(0).numpy()
    curve = np.loadtxt(out / "context_loss_by_position.csv", delimiter=",", skiprows=1)
    assert curve[:, 0].tolist() == list(range(1, CONTEXT + 1))
    np.testing.assert_allclose(curve[:, 1], whole, atol=1e-4)
    assert c["tokens"] == CONTEXT and c["streams"] == 2 and c["window"] == SEQ
    assert [b["positions"] for b in c["bins"]] == [[1, 1], [2, 3], [4, 7], [8, 15], [16, 31], [32, 63], [64, 127],
                                                  [128, 255], [256, 512]]
    for b in c["bins"]:
        lo, hi = b["positions"]
        assert b["loss"] == pytest.approx(whole[lo - 1 : hi].mean(), abs=1e-4)
    assert (out / "context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("family", ["gpn_m", "gdn"])
def test_reset_on_eos_reads_each_document_from_the_empty_state(setup, tmp_path, capsys, family):
    root, prep, models = setup
    code, stdout, err = run(capsys, "eval", root / family, "--data", prep, "--context", CONTEXT, "--batch", 2,
                            "--reset-on-eos", "--json", "--out", tmp_path / "out")
    assert code == 0, err
    c = json.loads(stdout)["context"]
    assert c["reset_on_eos"] is True
    curve = np.loadtxt(tmp_path / "out" / "context_loss_by_position.csv", delimiter=",", skiprows=1)[:, 1]
    eos = json.loads((prep / "stats.json").read_text())["eos_id"]
    streams, per_doc = val_streams(prep), []
    with torch.no_grad():  # each document on its own, from the empty state: what the resets must give
        for row in streams:
            ends = [0] + [t + 1 for t in range(len(row)) if row[t] == eos]
            docs = [row[a:b] for a, b in zip(ends, ends[1:] + [len(row)]) if b > a]
            assert len(docs) > 2  # the streams hold several documents
            per_doc.append(torch.cat([models[family](d[None]).token_losses[0] for d in docs]).double())
    np.testing.assert_allclose(curve, torch.stack(per_doc).mean(0).numpy(), atol=1e-4)
    with torch.no_grad():
        carried = models[family](streams).token_losses.double().mean(0).numpy()
    assert np.abs(carried - curve).max() > 1e-2  # without the resets, documents read their predecessors' state


def test_position_bins_are_log_spaced_to_the_end():
    bins = PositionBins.of(np.arange(1, 101, dtype=float))
    assert list(zip(bins.starts, bins.stops)) == [(1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 64), (64, 101)]
    assert bins.loss[-1] == pytest.approx(np.mean(np.arange(64, 101)))


def test_passkey_scores_the_key_as_a_forward_over_prompt_and_key(setup, tmp_path, capsys):
    root, prep, models = setup
    out = tmp_path / "out"
    code, stdout, err = run(capsys, "eval", root / "gpn_m", "--data", prep, "--passkey", 600, "--passkey-trials", 2,
                            "--json", "--out", out)
    assert code == 0, err
    p = json.loads(stdout)["passkey"]
    assert [r["distance"] for r in p["by_distance"]] == [256, 512, 600]
    assert all(r["trials"] == 2 and 0 <= r["accuracy"] <= 1 and r["mean_key_logprob"] < 0 for r in p["by_distance"])
    assert (out / "passkey.png").is_file()

    from gpn_scale.eval.codec import Codec

    codec, model = Codec(prep / "tokenizer.json"), models["gpn_m"]
    items = make_passkeys(codec.encode, 600, 2)
    assert [codec.decode(i.answer).strip() for i in items] == [i.key for i in items] and len({i.key for i in items}) > 1
    item = items[-1]
    correct, logprob = score_passkey(model, item, chunk=SEQ)
    with torch.no_grad():
        o = model(torch.tensor(item.prompt + item.answer)[None], return_logits=True)
    n = len(item.answer)
    assert logprob == pytest.approx(-o.token_losses[0, -n:].double().sum().item(), rel=1e-4)
    assert correct == bool((o.logits[0, -n:].argmax(-1) == torch.tensor(item.answer)).all())
    assert math.isfinite(logprob)


@pytest.mark.parametrize("args, message", [
    (["--context", 100], "--context: 100 is not a multiple of the streams' window of 32 tokens"),
    (["--context", 1 << 20], "--context: 1048576 tokens, but the streams of"),
    (["--streams", 2], "--streams: counts the streams of --context"),
    (["--context", 0], "--context: expected a positive integer, got 0"),
    (["--reset-on-eos"], "--reset-on-eos: resets the state in the streams of --context"),
])
def test_bad_context_arguments_are_one_line(setup, tmp_path, capsys, args, message):
    root, prep, _ = setup
    code, _, err = run(capsys, "eval", root / "gpn_m", "--data", prep, *args, "--out", tmp_path / "out")
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def test_context_needs_streams(setup, tmp_path, capsys):
    root, prep, _ = setup
    code, _, err = run(capsys, "eval", root / "gpn_m", "--data", prep / "val", "--context", 64, "--out", tmp_path / "o")
    assert code == 2 and "holds no streams" in err and len(err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def carried_run(setup, tmp_path_factory):
    """A real 1-rank carried-state run (train.carry_state) on the prep's streams: its data.train is
    OUT/streams/train, two levels below the prep's stats.json and tokenizer."""
    from test_train import train as train_run

    _, prep, _ = setup
    run = tmp_path_factory.mktemp("carried") / "run"
    train_run(prep / "streams", run, 1, "train.carry_state=true", "train.grad_accum=null", "train.global_batch=2",
              "train.micro_batch=2", "train.total_steps=2", "train.save_every=2", "zero.stage=0")
    return run


def test_a_carried_run_finds_its_prep_tokenizer_and_refuses_another(setup, carried_run, tmp_path, capsys):
    """eval --passkey and generate find the tokenizer of the prep the streams came from; held-out data
    made with another tokenizer is refused, as for a run on shuffled windows."""
    from eval_fixtures import make_prep

    root, prep, _ = setup
    code, stdout, err = run(capsys, "eval", carried_run, "--passkey", 300, "--passkey-trials", 1, "--json",
                            "--out", tmp_path / "out")
    assert code == 0, err
    assert [r["distance"] for r in json.loads(stdout)["passkey"]["by_distance"]] == [256, 300]
    code, stdout, err = run(capsys, "generate", carried_run, "--prompt", "the cat", "--max-new-tokens", 3)
    assert code == 0 and stdout.startswith("the cat"), err
    other = make_prep(tmp_path / "other", make_tokenizer(tmp_path / "other.json", vocab=280))
    capsys.readouterr()  # the prep's report
    code, _, err = run(capsys, "eval", carried_run, "--data", other, "--out", tmp_path / "o2")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "differs from the one the model was trained with" in err


def test_a_transformer_refuses_to_reset(setup, tmp_path, capsys):
    root, prep, _ = setup
    code, _, err = run(capsys, "eval", root / "transformer", "--data", prep, "--context", 64, "--reset-on-eos",
                       "--out", tmp_path / "o")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--reset-on-eos: the transformer family has no recurrent state to reset" in err
    assert not (tmp_path / "o").exists()
