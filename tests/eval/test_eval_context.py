"""`gpn-scale eval --context N` and `--passkey N`: held-out streams scored window after window with
the state carried (checked against one forward over the whole stream, for every family), the
log-spaced bins and plots, passkey scoring against a forward over prompt and key, and the refusals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from support.eval_fixtures import corpus_texts, make_tokenizer, tiny_model, train
from gpn_scale.cli import main
from gpn_scale.eval.prep_output import open_prep_output, read_windows
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
    windows = read_windows(open_prep_output(prep / "train"))
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
    from gpn_scale.storage.mds_datasets import reading

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
    assert [r["requested"] for r in p["by_distance"]] == [256, 512, 600]
    assert all(r["requested"] - 4 <= r["distance"] <= r["requested"] for r in p["by_distance"])  # whole words of filler
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


def test_passkey_states_its_chance_level(setup, tmp_path, capsys):
    """A uniform guess of the key: one of the 90,000 five-digit keys the prompts draw from."""
    from gpn_scale.eval import long_context

    root, prep, _ = setup
    keys = {k.key for k in make_passkeys(str.split, 300, 200)}  # any encoder: the keys are drawn apart from it
    assert all(len(k) == 5 and k[0] != "0" for k in keys)  # five digits: 10000..99999
    code, stdout, err = run(capsys, "eval", root / "gpn_m", "--data", prep, "--passkey", 300, "--passkey-trials", 1,
                            "--out", tmp_path / "out")
    assert code == 0, err
    chance = json.loads((tmp_path / "out" / "metrics.json").read_text())["passkey"]["chance"]
    assert chance == {"keys": 90_000, "accuracy": pytest.approx(1 / 90_000), "key_logprob": pytest.approx(-11.4076, abs=1e-4)}
    assert chance["key_logprob"] == -math.log(len(long_context.KEYS))
    assert "chance (a uniform guess of 90,000 keys): 1.1e-05, -11.41 nats" in stdout


def test_passkey_filler_ends_at_a_word_before_the_question(setup):
    from gpn_scale.eval.codec import Codec
    from gpn_scale.eval.long_context import FILLER, QUESTION

    _, prep, _ = setup
    codec = Codec(prep / "tokenizer.json")
    question = codec.encode(QUESTION)
    for longest in (300, 333, 517, 600):
        for item in make_passkeys(codec.encode, longest, 1):
            tail = item.prompt[-item.distance:]
            assert tail[-len(question):] == question
            filler = codec.decode(tail[:-len(question)])
            cycle = FILLER * (len(filler) // len(FILLER) + 2)
            assert cycle.startswith(filler) and cycle[len(filler)] == " ", (item.distance, filler[-30:])
            # the real distance: the requested one less at most a word's tokens
            assert 0 <= item.requested - item.distance < max(len(codec.encode(w)) for w in FILLER.split(" ") if w) + 1


def test_a_passkey_distance_shorter_than_the_question_is_refused(setup, tmp_path, capsys):
    root, prep, _ = setup
    code, _, err = run(capsys, "eval", root / "gpn_m", "--data", prep, "--passkey", 3, "--out", tmp_path / "out")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--passkey: 3 tokens is shorter than the question that ends every prompt" in err
    assert not (tmp_path / "out").exists()


def test_passkey_prompts_begin_with_bos_where_the_prep_used_it(setup, tmp_path, capsys):
    """The prep's --bos (stats.json: add_bos, bos_id) began every training document: so does each prompt."""
    from support.eval_fixtures import make_prep
    from gpn_scale.eval.codec import Codec

    root, prep, _ = setup
    bos_prep = make_prep(tmp_path / "bos", root / "tok.json", seq_len=SEQ, bos=True)
    bos = json.loads((bos_prep / "stats.json").read_text())["bos_id"]
    for data, extra in ((bos_prep, 1), (prep, 0)):
        code, stdout, err = run(capsys, "eval", root / "gpn_m", "--passkey", 300, "--passkey-trials", 2, "--data", data,
                                "--json", "--out", tmp_path / f"out{extra}")
        assert code == 0, err
        p = json.loads(stdout)["passkey"]
        items = make_passkeys(Codec(data / "tokenizer.json").encode, 300, 2)  # without BOS: 2 per distance, in order
        assert [r["prompt_tokens"] for r in p["by_distance"]] == [
            max(len(i.prompt) for i in items[k : k + 2]) + extra for k in (0, 2)]
        assert p["bos"] == (bos if extra else None)
    assert all(i.prompt[0] == bos for i in make_passkeys(Codec(bos_prep / "tokenizer.json").encode, 300, 2, bos=bos))


def test_a_context_longer_than_the_streams_is_refused_before_anything_is_loaded(setup, tmp_path, capsys):
    """The streams' layout alone says so: the refusal comes before the checkpoint (here missing) is read."""
    root, prep, _ = setup
    code, _, err = run(capsys, "eval", root / "missing", "--data", prep, "--context", 1 << 20, "--out", tmp_path / "o")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--context: 1048576 tokens, but the streams of" in err


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
    from support.train_runs import train as train_run

    _, prep, _ = setup
    run = tmp_path_factory.mktemp("carried") / "run"
    train_run(prep / "streams", run, 1, "train.carry_state=true", "train.grad_accum=null", "train.global_batch=2",
              "train.micro_batch=2", "train.total_steps=2", "train.save_every=2", "zero.stage=0")
    return run


def test_a_carried_run_finds_its_prep_tokenizer_and_refuses_another(setup, carried_run, tmp_path, capsys):
    """eval --passkey and generate find the tokenizer of the prep the streams came from; held-out data
    made with another tokenizer is refused, as for a run on shuffled windows."""
    from support.eval_fixtures import make_prep

    root, prep, _ = setup
    code, stdout, err = run(capsys, "eval", carried_run, "--passkey", 300, "--passkey-trials", 1, "--json",
                            "--out", tmp_path / "out")
    assert code == 0, err
    assert [r["requested"] for r in json.loads(stdout)["passkey"]["by_distance"]] == [256, 300]
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
