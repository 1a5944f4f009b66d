"""Generation: determinism, the sampled distributions against the model's forward, constant memory
in the generated length, streamed text, and batch scoring."""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from support.eval_fixtures import SENTENCES, make_tokenizer, tiny_model

from gpn_scale.cli import main
from gpn_scale.eval.codec import Codec, IncrementalDecoder
from gpn_scale.eval.generate import generate_tokens, sampling_probs, score_texts
from gpn_scale.storage.native import save_native
from support import ROOT


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    tok = make_tokenizer(root / "tok.json")
    model = tiny_model(Codec(tok).vocab_size).eval()
    save_native(model, root / "ckpt")
    return root, tok, model


def generate_cli(capsys, root, tok, *extra):
    code = main(["generate", str(root / "ckpt"), "--tokenizer", str(tok), "--prompt", "the cat sat",
                 "--max-new-tokens", "24", *map(str, extra)])
    assert code == 0
    return capsys.readouterr().out


def test_same_seed_same_text_other_seed_other_text(setup, capsys):
    root, tok, _ = setup
    first = generate_cli(capsys, root, tok, "--seed", 3)
    assert first == generate_cli(capsys, root, tok, "--seed", 3)
    assert first != generate_cli(capsys, root, tok, "--seed", 4)
    assert first.startswith("the cat sat")


def test_streamed_text_is_the_decoded_tokens(setup, capsys):
    root, tok, model = setup
    codec = Codec(tok)
    out = generate_cli(capsys, root, tok, "--seed", 5, "--top-p", 0.9)
    tokens = [t for t, _ in generate_tokens(model, codec.encode("the cat sat"), 24, 1.0, 0.9, seed=5)]
    assert out == "the cat sat" + codec.decode(tokens) + "\n"


def test_incremental_decoding_reassembles_multibyte_text():
    with tempfile.TemporaryDirectory() as d:
        codec = Codec(make_tokenizer(Path(d) / "t.json"))
    text = "naïve café — 東京 🚀 " + SENTENCES[1]
    ids = codec.encode(text)
    decoder = IncrementalDecoder(codec)
    pieces = [decoder.push(t) for t in ids]
    assert "".join(pieces) == codec.decode(ids) == text
    assert "" in pieces  # a character split over byte tokens waited for its last byte


def test_incremental_decoding_equals_the_whole_decode_of_any_token_sequence():
    """Sampled text is often not valid UTF-8 (a character's bytes cut off or out of order); what is
    streamed must still be exactly the decode of the whole sequence, replacement characters included."""
    with tempfile.TemporaryDirectory() as d:
        codec = Codec(make_tokenizer(Path(d) / "t.json"))
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        ids = torch.randint(0, codec.vocab_size, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        decoder = IncrementalDecoder(codec)
        text = "".join(decoder.push(t) for t in ids) + decoder.flush()
        assert text == codec.decode(ids), ids


def test_first_and_second_distributions_equal_the_forward_logits(setup):
    _, tok, model = setup
    prompt = Codec(tok).encode("the dog sat on")
    steps = generate_tokens(model, prompt, 2, temperature=1.0, top_p=1.0, seed=0)
    (t1, p1), (_, p2) = next(steps), next(steps)
    with torch.no_grad():  # logits[:, t] are the distribution of token t given the ones before it
        logits = model(torch.tensor([prompt + [t1, 7]]), return_logits=True).logits[0].double()
    torch.testing.assert_close(p1, torch.softmax(logits[len(prompt)], -1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(p2, torch.softmax(logits[len(prompt) + 1], -1), atol=1e-6, rtol=1e-5)


def test_sampling_probs_temperature_and_top_p_by_hand():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(sampling_probs(logits), torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64))
    # top-p 0.7: 0.5 alone falls short, 0.5 + 0.3 reaches it; the rest is cut and the kept mass renormalised
    torch.testing.assert_close(sampling_probs(logits, top_p=0.7), torch.tensor([0.625, 0.375, 0, 0], dtype=torch.float64))
    assert sampling_probs(logits, temperature=0).tolist() == [1, 0, 0, 0]
    hot = sampling_probs(logits, temperature=2.0)  # p^(1/2), renormalised
    ref = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64).sqrt()
    torch.testing.assert_close(hot, ref / ref.sum())


def test_score_texts_equals_one_forward_per_text(setup):
    _, tok, model = setup
    codec = Codec(tok)
    texts = [SENTENCES[0], "x", SENTENCES[2] + " " + SENTENCES[3], SENTENCES[1]]
    scores = score_texts(model, codec.encode, texts, batch=3)
    for text, s in zip(texts, scores):
        ids = codec.encode(text)
        with torch.no_grad():
            losses = model(torch.tensor([ids])).token_losses.double()
        assert s["tokens"] == len(ids)
        assert s["loss_sum"] == pytest.approx(losses.sum().item(), rel=1e-5)
        assert s["loss_mean"] == pytest.approx(losses.mean().item(), rel=1e-5)


PEAK = textwrap.dedent("""
    import io, json, resource, sys
    from contextlib import redirect_stdout
    from gpn_scale.cli import main
    peaks = []
    for n in (64, 64, 1024):  # the first run warms the allocator up; then 64 vs 1024 tokens
        with redirect_stdout(io.StringIO()):
            assert main(["generate", sys.argv[1], "--tokenizer", sys.argv[2], "--prompt", "the cat",
                         "--max-new-tokens", str(n)]) == 0
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux
    print(json.dumps(peaks))
""")


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_generated_length(tmp_path):
    """A bigger model than the others (one M is 256 KiB): keeping any per-token state, or an autograd
    graph, for 1024 tokens would add well over the 16 MiB allowed."""
    tok = make_tokenizer(tmp_path / "tok.json")
    model = tiny_model(Codec(tok).vocab_size, d_state=256, d_emb=64, d_ffn=512, n_heads=4, d_key=64, d_val=256)
    save_native(model, tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "ckpt"), str(tok)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, after_64, after_1024 = json.loads(proc.stdout.strip().splitlines()[-1])
    assert after_1024 - after_64 < 16 * 1024, (after_64, after_1024)


def test_bad_generate_inputs_give_one_line_errors(setup, tmp_path, capsys):
    root, tok, _ = setup
    code = main(["generate", str(tmp_path / "missing"), "--prompt", "x", "--tokenizer", str(tok)])
    err = capsys.readouterr().err
    assert code == 2 and err == f"error: {tmp_path / 'missing'}: no such checkpoint\n"
    code = main(["generate", str(root / "ckpt"), "--prompt", "x"])  # a native checkpoint records no tokenizer
    err = capsys.readouterr().err
    assert code == 2 and "no tokenizer recorded with it; pass --tokenizer" in err and err.count("\n") == 1
    code = main(["generate", str(root / "ckpt"), "--prompt", "x", "--tokenizer", str(tok), "--device", "abacus"])
    err = capsys.readouterr().err
    assert code == 2 and err == "error: --device: 'abacus' is not a torch device\n"
    save_native(tiny_model(100), tmp_path / "small")
    code = main(["generate", str(tmp_path / "small"), "--prompt", "x", "--tokenizer", str(tok)])
    err = capsys.readouterr().err
    assert code == 2 and "exceeds the model's vocab_size 100" in err and err.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    (["--temperature", "nan"], "--temperature: expected a finite number >= 0 (0: greedy), got nan"),
    (["--temperature", "-1"], "--temperature: expected a finite number >= 0 (0: greedy), got -1.0"),
    (["--top-p", "nan"], "--top-p: expected a number in (0, 1], got nan"),
    (["--max-new-tokens", "-2"], "--max-new-tokens: expected >= 0, got -2"),
])
def test_bad_sampling_settings_give_one_line_errors(setup, capsys, args, message):
    root, tok, _ = setup
    code = main(["generate", str(root / "ckpt"), "--prompt", "x", "--tokenizer", str(tok), *args])
    assert code == 2 and capsys.readouterr().err == f"error: {message}\n"


def test_a_prompt_that_is_not_utf8_is_a_one_line_error(setup):
    root, tok, _ = setup
    proc = subprocess.run([sys.executable, "-m", "gpn_scale", "generate", str(root / "ckpt"), "--prompt", b"caf\xe9",
                           "--tokenizer", str(tok)], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and proc.stderr == "error: --prompt: not valid UTF-8 text\n", proc.stderr[-2000:]
