"""`gpn-scale eval`: held-out PPL and the per-position curve, LAMBADA against a hand computation, and
one-line errors for bad inputs."""

import json
import math

import numpy as np
import pytest
import torch
from support.eval_fixtures import make_prep, make_tokenizer, tiny_model, train
from tokenizers import Tokenizer

from gpn_scale.cli import main
from data_prep.errors import UserError
from gpn_scale.eval.prep_output import check_model_fits, open_prep_output, read_windows
from gpn_scale.eval.lambada import split_last_word
from gpn_scale.storage.native import save_native


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A real tokenizer and prep output, and a GPN+M trained on its train split, saved natively."""
    root = tmp_path_factory.mktemp("eval")
    tok = make_tokenizer(root / "tok.json")
    prep = make_prep(root, tok)
    vocab = json.loads((prep / "stats.json").read_text())["vocab_size"]
    model = train(tiny_model(vocab), read_windows(open_prep_output(prep / "train")), steps=60)
    save_native(model, root / "ckpt")
    return root, tok, prep, model


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_ppl_is_exp_of_the_models_own_mean_loss_over_every_window(setup, tmp_path, capsys):
    root, _, prep, model = setup
    code, out, _ = run(capsys, "eval", root / "ckpt", "--data", prep, "--json", "--batch", 7, "--out", tmp_path / "out")
    assert code == 0
    metrics = json.loads(out)
    windows = read_windows(open_prep_output(prep / "val"))
    with torch.no_grad():
        losses = model(windows, core="naive").token_losses.double()  # one batch, the other core
    assert metrics["windows"] == len(windows) == json.loads((prep / "stats.json").read_text())["splits"]["val"]["windows"]
    assert metrics["tokens"] == windows.numel()
    assert metrics["ppl"] == pytest.approx(math.exp(losses.mean().item()), rel=1e-5)
    assert metrics["ppl"] < 100  # trained: far below the 300-token vocabulary
    curve = np.loadtxt(tmp_path / "out" / "loss_by_position.csv", delimiter=",", skiprows=1)
    assert curve[:, 0].tolist() == list(range(1, windows.shape[1] + 1))
    np.testing.assert_allclose(curve[:, 1], losses.mean(0).numpy(), atol=2e-6)
    assert curve[0, 1] > curve[-8:, 1].mean()  # position 1 is predicted from the empty state


def test_windows_flag_takes_the_first_n_and_split_dir_works(setup, tmp_path, capsys):
    root, _, prep, model = setup
    code, out, _ = run(capsys, "eval", root / "ckpt", "--data", prep / "val", "--windows", 5, "--json", "--out",
                       tmp_path / "out")
    windows = read_windows(open_prep_output(prep / "val"))[:5]
    with torch.no_grad():
        expected = math.exp(model(windows).loss.item())
    assert code == 0 and json.loads(out)["windows"] == 5
    assert json.loads(out)["ppl"] == pytest.approx(expected, rel=1e-5)


LAMBADA_TEXTS = [
    "the cat sat on the mat and the dog sat on the log",
    "seven small ships sailed past the lighthouse at",
    "river stones roll slowly under the cold water of the valley",
    "a naive café serves crème brûlée to the  ünïcode",  # two spaces before the last word
    "the dog sat on the cat",
]


def lambada_by_hand(model, tok_path) -> tuple[list[int], list[float]]:
    tok = Tokenizer.from_file(str(tok_path))
    hits, ces = [], []
    for text in LAMBADA_TEXTS:
        context, word = text.rsplit(" ", 1)  # by hand: the last word and everything before its space
        ctx = tok.encode(context, add_special_tokens=False).ids
        tgt = tok.encode(" " + word, add_special_tokens=False).ids
        with torch.no_grad():  # one example at a time, no padding; CE from the logits by hand
            logits = model(torch.tensor([ctx + tgt]), return_logits=True).logits[0].double()
        logp = torch.log_softmax(logits[len(ctx):], -1)
        ces.append(-logp[torch.arange(len(tgt)), torch.tensor(tgt)].mean().item())
        hits.append(int(logits[len(ctx)].argmax()) == tgt[0])
    return hits, ces


def test_lambada_matches_a_hand_computation(setup, tmp_path, capsys):
    root, tok_path, _, model = setup
    path = tmp_path / "lambada.jsonl"
    path.write_text("\n".join(json.dumps({"text": t, "extra": 1}) for t in LAMBADA_TEXTS) + "\n\n")
    code, out, _ = run(capsys, "eval", root / "ckpt", "--lambada", path, "--tokenizer", tok_path, "--json",
                       "--batch", 2, "--out", tmp_path / "out")
    assert code == 0
    metrics = json.loads(out)

    hits, ces = lambada_by_hand(model, tok_path)
    assert metrics["lambada_examples"] == len(LAMBADA_TEXTS)
    assert metrics["lambada_acc"] == pytest.approx(sum(hits) / len(hits))
    assert 0 < metrics["lambada_acc"] < 1  # the trained model gets the corpus' sentences, not the odd one
    assert metrics["lambada_ppl"] == pytest.approx(math.exp(sum(ces) / len(ces)), rel=1e-5)


def test_split_last_word():
    assert split_last_word("a b  c \n") == ("a b ", " c")
    assert split_last_word("one") is None
    assert split_last_word("  one") is None


@pytest.mark.parametrize("content, message", [
    ('{"text": "a b"}\n{"txt": "a b"}\n', "line 2: expected an object with a string \"text\""),
    ('{"text": "a b"}\nnot json\n', "line 2: not JSON"),
    ('{"text": "lonely"}\n', "example 1: needs a context and a last word"),
])
def test_bad_lambada_lines_give_one_line_errors(setup, tmp_path, capsys, content, message):
    root, tok_path, _, _ = setup
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    code, _, err = run(capsys, "eval", root / "ckpt", "--lambada", path, "--tokenizer", tok_path, "--out",
                       tmp_path / "out")
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_missing_checkpoint_and_foreign_data_give_one_line_errors(setup, tmp_path, capsys):
    root, _, prep, _ = setup
    code, _, err = run(capsys, "eval", tmp_path / "nope", "--data", prep)
    assert code == 2 and err == f"error: {tmp_path / 'nope'}: no such checkpoint\n"

    small = tiny_model(64)  # a model whose vocabulary is smaller than the data's tokenizer
    save_native(small, tmp_path / "small")
    code, _, err = run(capsys, "eval", tmp_path / "small", "--data", prep, "--out", tmp_path / "out")
    assert code == 2 and "tokenizer vocabulary 300 exceeds the model's vocab_size 64" in err and err.count("\n") == 1

    code, _, err = run(capsys, "eval", root / "ckpt", "--data", tmp_path)
    assert code == 2 and "not an MDS directory" in err and err.count("\n") == 1

    for command in ("eval", "analyze"):
        code, _, err = run(capsys, command, root / "ckpt", "--data", prep, "--out", tmp_path, "--windows", "-1")
        assert code == 2 and err == "error: --windows: expected a positive integer, got -1\n"
        code, _, err = run(capsys, command, root / "ckpt", "--data", prep, "--out", tmp_path, "--batch", "0")
        assert code == 2 and err == "error: --batch: expected a positive integer, got 0\n"


def test_token_ids_beyond_the_model_and_another_tokenizer_are_refused(setup, tmp_path):
    from support.mds_fixture import write_windows

    _, _, prep, _ = setup
    data = open_prep_output(write_windows(tmp_path / "mds", 4, 16, vocab=500))  # no stats.json: caught on the ids
    with pytest.raises(UserError, match="token id .* is outside the model's vocabulary"):
        check_model_fits(tiny_model(300), data, read_windows(data))
    with pytest.raises(UserError, match="tokenizer sha256 .* differs from the one the model was trained with"):
        check_model_fits(tiny_model(300), open_prep_output(prep), trained_on="0" * 64)


def test_a_run_records_its_tokenizer_and_refuses_another(setup, tmp_path):
    """A run directory's training record (trainer_state.json under a committed checkpoint) names its
    training data; its prep's tokenizer is found from it, and any other tokenizer is refused."""
    from gpn_scale.eval.codec import Codec
    from gpn_scale.eval.prep_output import choose_tokenizer, training_prep
    from gpn_scale.storage.checkpoints import TRAINER_STATE, tag_for
    from gpn_scale.train import checkpoint_writer as ckpt

    root, tok_path, prep, model = setup
    tag = tmp_path / "run" / "checkpoints" / tag_for(10)
    tag.mkdir(parents=True)
    (tag / TRAINER_STATE).write_text(json.dumps({  # as the trainer writes it; only config.data.train matters here
        "step": 10, "tokens": 0, "loader": {"epoch": 0, "sample_in_epoch": 0, "initial_nodes": 1}, "world_size": 1,
        "zero_stage": 0, "global_batch": 1, "data_seq_len": None,
        "config": {"model": {}, "data": {"train": str(prep / "train")}}}))
    ckpt.write_manifest(tag)
    trained = training_prep(tmp_path / "run")
    assert trained.root == prep and trained.tokenizer_sha256 == Codec(tok_path).sha256

    codec, found = choose_tokenizer("run", None, None, trained, model)
    assert codec.sha256 == trained.tokenizer_sha256 and found == trained.tokenizer_source()
    other = make_tokenizer(tmp_path / "other.json", vocab=280)
    with pytest.raises(UserError, match="other.json: not the tokenizer the model was trained with"):
        choose_tokenizer("run", str(other), None, trained, model)
    assert training_prep(root / "ckpt") is None  # a native checkpoint records no training data


@pytest.mark.parametrize("family", ["transformer", "gdn"])
def test_baselines_get_the_same_ppl_and_lambada_protocol(setup, tmp_path, capsys, family):
    from gpn_scale.config import model_config
    from gpn_scale.models import build_model

    root, tok_path, prep, _ = setup
    vocab = json.loads((prep / "stats.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    model = build_model(model_config(f"{family}_tiny", {"vocab_size": vocab}))
    model = train(model, read_windows(open_prep_output(prep / "train")), steps=40)
    save_native(model, tmp_path / "ckpt")
    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text("\n".join(json.dumps({"text": t}) for t in LAMBADA_TEXTS) + "\n")
    code, out, err = run(capsys, "eval", tmp_path / "ckpt", "--data", prep, "--lambada", lambada, "--tokenizer",
                         tok_path, "--json", "--batch", 3, "--out", tmp_path / "out")
    assert code == 0, err
    metrics = json.loads(out)
    windows = read_windows(open_prep_output(prep / "val"))
    with torch.no_grad():
        losses = model(windows).token_losses.double()
    assert metrics["ppl"] == pytest.approx(math.exp(losses.mean().item()), rel=1e-5)
    hits, ces = lambada_by_hand(model, tok_path)
    assert metrics["lambada_acc"] == pytest.approx(sum(hits) / len(hits))
    assert metrics["lambada_ppl"] == pytest.approx(math.exp(sum(ces) / len(ces)), rel=1e-5)
