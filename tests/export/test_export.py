"""`gpn-scale export`: to Hugging Face transformers (loaded back, offline, and compared with gpn-scale's
logits and greedy generation), to the paper's format (read back by `convert --from-reference`, bit
for bit) and to native from a training run's newest complete checkpoint; and the one-line errors."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub

import numpy as np
import pytest
import torch
from support.eval_fixtures import SENTENCES, corpus_texts, make_prep, make_tokenizer, tiny_model, train

from gpn_scale.storage.checkpoints import load_native, load_trained_model, read_trainer_state
from gpn_scale.cli import main
from gpn_scale.export.convert import load_reference_pickle, reference_name
from data_prep.errors import UserError
from gpn_scale.eval.codec import Codec
from gpn_scale.eval.prep_output import open_prep_output, read_windows
from gpn_scale.eval.generate import generate_tokens
from gpn_scale.storage.native import TokenizerSource, save_native
from support import ROOT

FAMILIES = {"gpn_m_1l": ("gpn_m", 1), "gpn_m_2l": ("gpn_m", 2), "gpn_1l": ("gpn", 1)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A real tokenizer and prep output, and one trained tiny native checkpoint per GPN family."""
    root = tmp_path_factory.mktemp("export")
    tok = make_tokenizer(root / "tok.json")
    prep = make_prep(root / "data", tok)
    windows = read_windows(open_prep_output(prep / "train"))
    vocab = Codec(tok).vocab_size
    models = {}
    for name, (family, layers) in FAMILIES.items():
        model = train(tiny_model(vocab, family, n_layers=layers), windows, steps=30)
        save_native(model, root / name)
        models[name] = model
    return root, tok, prep, models


def run(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def export_hf(capsys, root, name, tok):
    out = root / f"{name}_hf"
    if not out.exists():
        code, _, err = run(capsys, "export", root / name, "--to", "hf", "--out", out, "--tokenizer", tok)
        assert code == 0, err
    return out


def load_hf(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval(), AutoTokenizer.from_pretrained(path)


def gpn_next_token_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """gpn-scale's logits at position t score token t; transformers' score the token after t."""
    placeholder = torch.zeros(tokens.shape[0], 1, dtype=torch.long)
    with torch.no_grad():
        return model(torch.cat([tokens, placeholder], 1), return_logits=True).logits[:, 1:]


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_export_loads_offline_and_gives_gpn_scales_logits(setup, capsys, name):
    root, tok, _, models = setup
    path = export_hf(capsys, root, name, tok)
    assert "gpn_scale" not in (path / "modeling_gpn.py").read_text().replace("gpn-scale", "")  # self-contained
    hf, hf_tok = load_hf(path)
    assert type(hf).__name__ == "GPNForCausalLM" and hf.dtype == torch.float32
    codec = Codec(tok)
    texts = [SENTENCES[0], SENTENCES[2] + " " + SENTENCES[3]]
    for text in texts:
        assert hf_tok(text).input_ids == codec.encode(text)
        assert hf_tok.decode(codec.encode(text)) == codec.decode(codec.encode(text))
    tokens = torch.tensor([codec.encode(texts[1])[:16], codec.encode(texts[0])[:16]])
    with torch.no_grad():
        theirs = hf(tokens).logits
        # a stream cut in two pieces, the state of the first carried into the second
        first = hf(tokens[:, :7])
        second = hf(tokens[:, 7:], state=first.state).logits
    ours = gpn_next_token_logits(models[name], tokens)
    assert theirs.dtype == torch.float32 and theirs.shape == ours.shape
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat([first.logits, second], 1), theirs, rtol=0, atol=1e-6)
    with torch.no_grad():  # labels = inputs, scored from position 1 on: gpn-scale's mean loss over the same positions
        loss = hf(tokens, labels=tokens).loss
        ref = models[name](tokens).token_losses[:, 1:].mean()
    assert float(loss) == pytest.approx(float(ref), abs=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_greedy_generate_equals_gpn_scale_generate_one_token_per_step(setup, capsys, name):
    root, tok, _, models = setup
    hf, hf_tok = load_hf(export_hf(capsys, root, name, tok))
    codec, n = Codec(tok), 24
    prompt = hf_tok("the cat sat", return_tensors="pt")
    seen = []  # (input length, the state's shapes) of every forward
    hf.register_forward_hook(lambda m, args, kwargs, out: seen.append(
        (kwargs["input_ids"].shape[1], [tuple(t.shape) for t in out.state])), with_kwargs=True)
    out = hf.generate(**prompt, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    generated = out[0, prompt.input_ids.shape[1]:].tolist()
    expected = [t for t, _ in generate_tokens(models[name], codec.encode("the cat sat"), n, temperature=0)]
    assert generated == expected
    lengths = [length for length, _ in seen]
    assert lengths == [prompt.input_ids.shape[1]] + [1] * (n - 1)  # the prompt once, then one new token a step
    assert len({tuple(shapes) for _, shapes in seen}) == 1  # the cache does not grow
    with pytest.raises(ValueError, match="beam search is not supported"):  # it would not reorder the state
        hf.generate(**prompt, max_new_tokens=2, num_beams=2)
    # what `gpn-scale generate --temperature 0` prints: the prompt and the same tokens, decoded
    code, printed, err = run(capsys, "generate", root / name, "--tokenizer", tok, "--prompt", "the cat sat",
                             "--max-new-tokens", n, "--temperature", 0)
    assert code == 0, err
    assert printed == "the cat sat" + hf_tok.decode(generated) + "\n"


def test_hf_left_padded_batch_generates_as_each_prompt_alone(setup, capsys):
    root, tok, _, _ = setup
    hf, hf_tok = load_hf(export_hf(capsys, root, "gpn_m_1l", tok))
    hf_tok.pad_token, hf_tok.padding_side = hf_tok.eos_token, "left"
    prompts = ["the dog sat on the log and", "seven ships"]
    batch = hf_tok(prompts, return_tensors="pt", padding=True)
    assert not bool(batch.attention_mask.all())  # the second prompt is padded
    out = hf.generate(**batch, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    for row, text in enumerate(prompts):
        alone = hf_tok(text, return_tensors="pt")
        single = hf.generate(**alone, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[row, -8:].tolist() == single[0, -8:].tolist()


def test_hf_tokenizer_adds_no_special_token_and_names_the_start_of_text(tmp_path):
    """With or without BOS in the training data, `tok(text)` is the text's ids alone (the start is the
    model's initial state); BOS is named (the harness's prefix), pad is EOS, start_state says which start."""
    from transformers import AutoTokenizer

    from gpn_scale.export.hf import Specials, write_tokenizer

    tok = make_tokenizer(tmp_path / "tok.json")
    codec = Codec(tok)
    (bos,), (eos,) = codec.encode("<|startoftext|>"), codec.encode("<|endoftext|>")  # trained tokenizers' names
    for add_bos, start in ((True, "bos"), (False, "empty")):
        out = tmp_path / start
        out.mkdir()
        assert write_tokenizer(TokenizerSource(tok, add_bos=add_bos), out) == Specials(bos, eos, start)
        hf_tok = AutoTokenizer.from_pretrained(out)
        assert hf_tok(SENTENCES[1]).input_ids == codec.encode(SENTENCES[1])
        assert (hf_tok.bos_token, hf_tok.eos_token, hf_tok.pad_token) == ("<|startoftext|>", "<|endoftext|>",
                                                                          "<|endoftext|>")
        assert hf_tok.padding_side == "left"


def test_hf_tokenizer_without_bos_lets_eos_stand_for_the_start(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    from gpn_scale.export.hf import Specials, write_tokenizer

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(corpus_texts(), trainers.BpeTrainer(vocab_size=280, special_tokens=["<|endoftext|>"]))
    raw.save(str(tmp_path / "tok.json"))
    out = tmp_path / "hf"
    out.mkdir()
    assert write_tokenizer(TokenizerSource(tmp_path / "tok.json"), out) == Specials(0, 0, "empty")
    hf_tok = AutoTokenizer.from_pretrained(out)
    assert hf_tok.bos_token == hf_tok.eos_token == "<|endoftext|>"


def test_hf_sentencepiece_tokenizer(tmp_path):
    """The slow tokenizer is sentencepiece itself: exactly gpn-scale's ids; the fast one transformers
    converts from it agrees on ordinary text (not on runs of spaces, which sentencepiece collapses)."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from gpn_scale.export.hf import write_tokenizer

    (tmp_path / "corpus.txt").write_text("\n".join(corpus_texts()))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=60, minloglevel=2)
    codec = Codec(tmp_path / "sp.model")
    out = tmp_path / "hf"
    out.mkdir()
    write_tokenizer(TokenizerSource(tmp_path / "sp.model", add_bos=False), out)
    slow, fast = AutoTokenizer.from_pretrained(out, use_fast=False), AutoTokenizer.from_pretrained(out)
    for text in SENTENCES + ["  two  spaces", "Hello world!"]:
        assert slow(text).input_ids == codec.encode(text), text
    for text in SENTENCES:
        assert fast(text).input_ids == codec.encode(text), text


def test_reference_export_round_trips_bit_exactly_through_convert(setup, capsys, tmp_path):
    root, _, _, models = setup
    for name in FAMILIES:
        ref, back = tmp_path / f"{name}_ref", tmp_path / f"{name}_back"
        code, _, err = run(capsys, "export", root / name, "--to", "reference", "--out", ref)
        assert code == 0, err
        payload = load_reference_pickle(ref)  # as `convert` reads it: optax's classes stand-ins, no optax needed
        assert set(payload) == {"step", "data_position", "params", "opt_state"}
        assert all(v.dtype.name == "float32" for v in payload["params"].values())
        model_fields = json.loads((ref / "config.json").read_text())["model"]
        assert ("n_heads" in model_fields) == (FAMILIES[name][0] == "gpn_m")
        code, _, err = run(capsys, "convert", "--from-reference", ref, "--config", ref / "config.json", "--out", back)
        assert code == 0, err
        original, converted = models[name], load_native(back)
        for field in ("family", "vocab_size", "d_state", "d_emb", "d_ffn", "n_layers", "n_heads", "d_key", "d_val",
                      "use_decoder_bias"):
            if field not in ("n_heads", "d_key", "d_val") or original.config.memory:
                assert getattr(converted.config, field) == getattr(original.config, field), field
        a, b = original.state_dict(), converted.state_dict()
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key


def paper_resume(ref: Path, train: dict, batch: np.ndarray, tmp: Path, batch_size: int | None = None
                 ) -> tuple[dict, dict]:
    """The paper's trainer (tests/support/reference_trainer.py, a process of its own) resumed from an `--to reference`
    export and one step on `batch`, or, with `batch_size`, on the batch its loader reads next from the
    windows `batch`: (what it restored and the step's loss, the parameters after the step)."""
    import importlib.util

    if importlib.util.find_spec("jax") is None or importlib.util.find_spec("optax") is None:
        pytest.skip("the paper's stack (jax, optax: the [reference] extra) is not installed")
    (tmp / "train.json").write_text(json.dumps(train))
    np.save(tmp / "batch.npy", batch)
    # XLA's cheapest code generation: the compile of one tiny step is most of the run, the numbers are the same
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0")
    given = ["--batch", str(tmp / "batch.npy")] if batch_size is None else [
        "--data", str(tmp / "batch.npy"), "--batch-size", str(batch_size)]
    proc = subprocess.run([sys.executable, "-m", "support.reference_trainer", str(ref), "--train",
                           str(tmp / "train.json"), *given, "--out", str(tmp / "result")],
                          env=env, cwd=ROOT / "tests", capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(tmp / "result.npz") as params:
        return json.loads((tmp / "result.json").read_text()), dict(params)


OPTAX_CLASSES = ["optax._src.base.EmptyState", "optax._src.transform.ScaleByAdamState",
                 "optax.transforms._masking.MaskedState", "optax._src.transform.ScaleByScheduleState"]
PAPER_TRAIN = dict(lr=6e-4, warmup_steps=100, total_steps=10000, min_lr_ratio=0.1, beta1=0.9, beta2=0.95,
                   weight_decay=0.1, grad_clip=1.0)


def test_reference_export_of_a_native_checkpoint_resumes_in_the_papers_trainer(setup, capsys, tmp_path):
    """No optimiser state in a native checkpoint: the paper's chain state with zero moments and count 0,
    which its loader restores (optax's classes, the structure `init` gives) and trains from."""
    root, _, prep, models = setup
    code, _, err = run(capsys, "export", root / "gpn_m_2l", "--to", "reference", "--out", tmp_path / "ref")
    assert code == 0, err
    windows = read_windows(open_prep_output(prep / "train"), 2)[:, :12]
    info, _ = paper_resume(tmp_path / "ref", PAPER_TRAIN, windows.numpy(), tmp_path)
    restored, after = info["restored"], info["after"]
    assert restored["structure_matches"] and restored["classes"] == OPTAX_CLASSES
    assert restored["counts"] == [0, 0] and restored["mu_zero"] and (restored["step"], restored["data_position"]) == (0, 0)
    with torch.no_grad():
        ours = float(models["gpn_m_2l"](windows).loss)
    assert after["loss"] == pytest.approx(ours, rel=1e-5)  # the paper's loss is ours
    assert (after["step"], after["count"]) == (1, 1) and after["all_moved"]


def test_other_families_are_refused_or_exported_native(setup, capsys, tmp_path):
    """GDN has no transformers form (Transformer++ leaves as Llama: below); neither has the paper's format."""
    from gpn_scale.config import model_config
    from gpn_scale.models import build_model

    _, tok, _, _ = setup
    refused = {"gdn": (("hf", "--to hf exports GPN and GPN[+]M .* and Transformer[+][+] [(]as LlamaForCausalLM[)] "
                               "only, not a gdn model"), ("reference", "the paper's format holds GPN")),
               "transformer": (("reference", "the paper's format holds GPN"),)}
    for family, cases in refused.items():
        save_native(build_model(model_config(f"{family}_tiny", {"vocab_size": 300})), tmp_path / family)
        for to, why in cases:
            code, _, err = run(capsys, "export", tmp_path / family, "--to", to, "--out", tmp_path / f"{family}_{to}",
                               "--tokenizer", tok)
            assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
            assert re_search(why, err) and family in err
            assert not (tmp_path / f"{family}_{to}").exists()
        code, _, err = run(capsys, "export", tmp_path / family, "--to", "native", "--out", tmp_path / f"{family}_n",
                           "--tokenizer", tok)
        assert code == 0, err
        assert load_native(tmp_path / f"{family}_n").config.family == family
        assert (tmp_path / f"{family}_n" / "tokenizer.json").read_bytes() == Path(tok).read_bytes()


# ---- Transformer++ as a plain LlamaForCausalLM ---------------------------------------------------


@pytest.fixture(scope="module")
def transformer(setup):
    """configs/models/transformer_tiny.yaml (vocabulary 512, padded beyond the tokenizer's 300), a few
    Adam steps on the prep's windows, saved native beside the GPN models."""
    from gpn_scale.config import model_config
    from gpn_scale.models import build_model

    root, _, prep, _ = setup
    torch.manual_seed(0)
    model = train(build_model(model_config("transformer_tiny")), read_windows(open_prep_output(prep / "train")), steps=30)
    save_native(model, root / "transformer")
    return model


def test_transformer_exports_as_plain_llama_with_gpn_scales_logits(setup, transformer, capsys):
    """No remote code: transformers' own LlamaForCausalLM. Its tokenizer puts BOS first, BOS's input
    embedding is gpn-scale's learned start vector, so the logits of [BOS] + x are gpn-scale's of x."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    root, tok, _, _ = setup
    path = export_hf(capsys, root, "transformer", tok)
    assert sorted(p.name for p in path.iterdir()) == [
        "README.md", "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((path / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["LlamaForCausalLM"], "llama")
    assert "auto_map" not in config and config["tie_word_embeddings"] is False
    hf = AutoModelForCausalLM.from_pretrained(path).eval()  # no trust_remote_code
    hf_tok = AutoTokenizer.from_pretrained(path)
    assert type(hf) is LlamaForCausalLM and hf.dtype == torch.float32
    codec = Codec(tok)
    (bos,) = codec.encode("<|startoftext|>")
    assert hf.config.bos_token_id == hf_tok.bos_token_id == bos and hf.config.vocab_size == 512
    texts = [SENTENCES[2] + " " + SENTENCES[3], SENTENCES[0] + " " + SENTENCES[1]]
    for text in texts:
        assert hf_tok(text).input_ids == [bos] + codec.encode(text)
        assert hf_tok.decode(hf_tok(text).input_ids, skip_special_tokens=True) == codec.decode(codec.encode(text))
    tokens = torch.tensor([codec.encode(t)[:20] for t in texts])
    inputs = torch.cat([torch.full((2, 1), bos), tokens], 1)
    with torch.no_grad():
        theirs = hf(inputs).logits[:, :-1]
        ours = transformer(tokens, return_logits=True)
        loss = hf(inputs, labels=inputs).loss  # scores inputs[1:]: every token of the text
    assert theirs.dtype == torch.float32 and theirs.shape == ours.logits.shape == (2, 20, 512)
    torch.testing.assert_close(theirs, ours.logits, rtol=0, atol=1e-5)
    assert float(loss) == pytest.approx(float(ours.loss), abs=1e-5)
    # greedy generation through transformers' KV cache: gpn-scale's tokens
    n = 16
    prompt = hf_tok("the cat sat", return_tensors="pt")
    out = hf.generate(**prompt, max_new_tokens=n, do_sample=False, eos_token_id=None)
    expected = [t for t, _ in generate_tokens(transformer, codec.encode("the cat sat"), n, temperature=0)]
    assert out[0, prompt.input_ids.shape[1]:].tolist() == expected
    card = (path / "README.md").read_text()
    assert "LlamaForCausalLM" in card and "trust_remote_code" not in card and f"BOS (id {bos})" in card


def test_transformer_llama_export_refuses_what_llama_cannot_hold(setup, transformer, capsys, tmp_path):
    """BOS must never have been an input in training (it carries the start vector), and the model must
    have no field or parameter that Llama lacks: otherwise one line, nothing written."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from gpn_scale.eval.prep_output import PrepOutput
    from gpn_scale.export import Source, llama, write_native
    from gpn_scale.models.blocks import RMSNorm
    from gpn_scale.models.transformer import TransformerConfig

    root, tok, _, _ = setup
    with_bos = tmp_path / "with_bos"  # trained on documents that began with BOS (prep --bos)
    with_bos.mkdir()
    (bos,) = Codec(tok).encode("<|startoftext|>")
    write_native(Source(transformer, root / "transformer"), TokenizerSource(tok, True, bos, 0), with_bos)
    only_eos = Tokenizer(models.BPE())  # a GPT-2-like tokenizer: EOS alone
    only_eos.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    only_eos.train_from_iterator(corpus_texts(), trainers.BpeTrainer(vocab_size=280, special_tokens=["<|endoftext|>"]))
    only_eos.save(str(tmp_path / "eos.json"))
    cases = [([with_bos], "every training document began with BOS (prep --bos)"),
             ([root / "transformer", "--tokenizer", tmp_path / "eos.json"],
              "eos.json: --to hf writes a Transformer++ as LlamaForCausalLM with its learned start vector as BOS's "
              "input embedding, but the tokenizer has no BOS apart from its EOS (id 0)")]
    for i, (argv, message) in enumerate(cases):
        code, _, err = run(capsys, "export", *argv, "--to", "hf", "--out", tmp_path / f"o{i}")
        assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
        assert message in err and err.rstrip().endswith("export it with --to native"), err
        assert not (tmp_path / f"o{i}").exists()

    # the prep's unigram counts say BOS was in the training data (e.g. its text spelled the token)
    counts = np.zeros(300, np.int64)
    counts[bos] = 3
    np.save(tmp_path / "unigram.npy", counts)
    source = Source(transformer, root / "transformer")
    with pytest.raises(UserError, match=f"unigram.npy: .* BOS [(]id {bos}[)] occurs 3 times in the training data"):
        llama.start_token(source, TokenizerSource(tok), PrepOutput(tmp_path, None, tmp_path))
    counts[bos] = 0
    np.save(tmp_path / "unigram.npy", counts)
    assert llama.start_token(source, TokenizerSource(tok), PrepOutput(tmp_path, None, tmp_path)) == bos

    # a part Llama has no counterpart for: a config field, a parameter
    from dataclasses import make_dataclass

    extended = make_dataclass("Extended", [("qk_norm", bool, True)], bases=(TransformerConfig,))
    model = build_tiny_transformer(extended)
    with pytest.raises(UserError, match="model.qk_norm: LlamaForCausalLM has no counterpart"):
        llama.check_model(Source(model, tmp_path / "m"))
    model = build_tiny_transformer(TransformerConfig)
    model.layers[0].mixer.q_norm = RMSNorm(16)
    with pytest.raises(UserError, match="parameter layers.0.mixer.q_norm.weight: LlamaForCausalLM has no counterpart"):
        llama.check_model(Source(model, tmp_path / "m"))


def build_tiny_transformer(config_cls):
    from gpn_scale.models.transformer import Transformer

    return Transformer(config_cls(vocab_size=300, d_model=64, n_layers=1, n_heads=4, d_ffn=128))


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


def test_a_native_export_serves_generate_with_its_own_tokenizer(setup, capsys, tmp_path):
    root, tok, _, _ = setup
    out = tmp_path / "native"
    code, _, err = run(capsys, "export", root / "gpn_m_1l", "--to", "native", "--out", out, "--tokenizer", tok)
    assert code == 0, err
    prompt = ["--prompt", "the cat", "--max-new-tokens", "6", "--temperature", "0", "--ignore-eos"]
    code, beside, err = run(capsys, "generate", out, *prompt)  # the tokenizer found beside the weights
    assert code == 0, err
    code, named, err = run(capsys, "generate", root / "gpn_m_1l", *prompt, "--tokenizer", tok)
    assert code == 0, err
    assert beside == named and beside.strip()
    code, _, err = run(capsys, "generate", root / "gpn_m_1l", *prompt)  # a plain native checkpoint has none
    assert code == 2 and "no tokenizer recorded with it" in err


def test_a_native_export_frames_prompts_as_the_training_data_did(setup, capsys, tmp_path):
    """A model trained on documents that began with BOS: its native export records that (and the
    EOS), so eval, generate, a native re-export and an hf export of it frame text as `--data PREP`
    does for the plain checkpoint."""
    from gpn_scale.export import Source, write_native
    from gpn_scale.storage.native import read_tokenizer

    root, tok, _, models = setup
    prep = make_prep(tmp_path / "data", tok, bos=True)
    framing = open_prep_output(prep).tokenizer_source()
    stats = json.loads((prep / "stats.json").read_text())
    assert (framing.add_bos, framing.bos_id, framing.eos_id) == (True, stats["bos_id"], stats["eos_id"])
    out = tmp_path / "native"
    out.mkdir()
    write_native(Source(models["gpn_m_1l"], root / "gpn_m_1l", None), framing, out)  # what a run trained on prep exports
    assert read_tokenizer(out) == replace(framing, path=out / "tokenizer.json")
    code, _, err = run(capsys, "export", out, "--to", "native", "--out", tmp_path / "again")
    assert code == 0, err
    assert read_tokenizer(tmp_path / "again") == replace(framing, path=tmp_path / "again" / "tokenizer.json")

    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text("".join(json.dumps({"text": t}) + "\n" for t in SENTENCES))
    scores = {}
    for name, checkpoint, data in (("export", out, []), ("plain", root / "gpn_m_1l", ["--data", prep])):
        code, _, err = run(capsys, "eval", checkpoint, "--lambada", lambada, *data, "--out", tmp_path / name)
        assert code == 0, err
        scores[name] = (tmp_path / name / "lambada_examples.jsonl").read_text()
    assert scores["export"] == scores["plain"]
    prompt = ["--prompt", "the cat", "--max-new-tokens", "8", "--temperature", "0"]
    code, text, err = run(capsys, "generate", out, *prompt)
    assert code == 0 and text.strip(), err
    assert (code, text, err) == run(capsys, "generate", root / "gpn_m_1l", *prompt, "--data", prep)

    # --tokenizer: the record's framing holds for that very tokenizer file (a copy of it), not for another
    from gpn_scale.eval.prep_output import choose_tokenizer

    shutil.copyfile(tok, tmp_path / "copy.json")
    model = models["gpn_m_1l"]
    assert choose_tokenizer(out, str(tmp_path / "copy.json"), None, None, model)[1] == replace(
        framing, path=tmp_path / "copy.json")
    other = make_tokenizer(tmp_path / "other.json", vocab=280)
    assert choose_tokenizer(out, str(other), None, None, model)[1] == TokenizerSource(other)

    code, _, err = run(capsys, "export", out, "--to", "hf", "--out", tmp_path / "hf")
    assert code == 0, err
    _, hf_tok = load_hf(tmp_path / "hf")
    assert hf_tok(SENTENCES[0]).input_ids == Codec(tok).encode(SENTENCES[0])  # the BOS is in the initial state
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (framing.bos_id, framing.eos_id)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["start_state"], config["bos_token_id"]) == ("bos", framing.bos_id)

    # An export written before tokenizer.yaml existed: its tokenizer file alone, no BOS
    from gpn_scale.storage.manifest import write_manifest
    from gpn_scale.storage.native import CONFIG, WEIGHTS

    old = tmp_path / "old"
    shutil.copytree(out, old)
    (old / "tokenizer.yaml").unlink()
    write_manifest(old, [WEIGHTS, CONFIG, "tokenizer.json"])
    assert read_tokenizer(old) == TokenizerSource(old / "tokenizer.json")
    code, text, err = run(capsys, "generate", old, *prompt)
    assert code == 0 and err == ""
    assert (code, text, err) == run(capsys, "generate", root / "gpn_m_1l", *prompt, "--tokenizer", tok)


def test_hf_tokenizer_takes_the_recorded_eos_over_the_usual_names(tmp_path):
    """prep --eos-token X: the export's EOS is X, not the tokenizer's <|endoftext|>; no BOS recorded: X stands
    for the start of text too."""
    from transformers import AutoTokenizer

    from gpn_scale.export.hf import Specials, write_tokenizer

    tok = make_tokenizer(tmp_path / "tok.json")
    (start,) = Codec(tok).encode("<|startoftext|>")
    assert write_tokenizer(TokenizerSource(tok, eos_id=start), tmp_path) == Specials(start, start, "empty")
    hf_tok = AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tok.eos_token == hf_tok.bos_token == "<|startoftext|>"


@pytest.mark.parametrize("info, message", [
    ("file: vocab.txt\nadd_bos: false\n", "file: expected one of tokenizer.json, tokenizer.model, got 'vocab.txt'"),
    ("file: tokenizer.json\nadd_bos: 'yes'\n", "add_bos: expected true or false, got 'yes'"),
    ("file: tokenizer.json\nadd_bos: false\neos_id: -1\n", "eos_id: expected a token id"),
    ("file: tokenizer.json\nadd_bos: true\nbos_id: null\n", "add_bos is true but bos_id is null"),
    ("file: tokenizer.json\nadd_bos: false\nbos: 1\n", "bos: unknown key"),
    ("file: tokenizer.json\nadd_bos: false\n1: x\n", "1: unknown key"),
    ("file: tokenizer.json\nadd_bos: f\xe9\n".encode("latin-1"), "not UTF-8 text"),
    ("[1, 2]\n", "expected a mapping"),
    ("file: [\n", "not valid YAML"),
])
def test_a_bad_tokenizer_record_is_one_line_naming_the_field(setup, tmp_path, info, message):
    from gpn_scale.storage.native import TOKENIZER_INFO, read_tokenizer

    _, tok, _, _ = setup
    shutil.copyfile(tok, tmp_path / "tokenizer.json")
    (tmp_path / TOKENIZER_INFO).write_bytes(info if isinstance(info, bytes) else info.encode())
    with pytest.raises(UserError) as e:
        read_tokenizer(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / TOKENIZER_INFO}: ") and message in str(e.value)
    assert len(str(e.value).splitlines()) == 1


def test_bad_inputs_are_one_line_errors_and_write_nothing(setup, capsys, tmp_path):
    root, tok, _, _ = setup
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    big = make_tokenizer(tmp_path / "big.json", vocab=400)
    tiny = tmp_path / "tiny"
    save_native(tiny_model(280), tiny)  # a vocabulary smaller than the tokenizers'
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    cases = [
        (["export", tmp_path / "nope", "--to", "hf", "--out", tmp_path / "o1"], "nope: no such checkpoint"),
        (["export", root / "gpn_m_1l", "--to", "hf", "--out", tmp_path / "o2"], "no tokenizer recorded with it"),
        (["export", root / "gpn_m_1l", "--to", "native", "--out", taken, "--tokenizer", tok],
         "taken: is not empty; export writes a new directory and overwrites nothing"),
        (["export", tiny, "--to", "hf", "--out", tmp_path / "o3", "--tokenizer", big],
         "exceeds the model's vocab_size 280"),
        (["export", root / "gpn_m_1l", "--to", "hf", "--out", tmp_path / "o4", "--tokenizer", tmp_path / "no.json"],
         "no.json: cannot read tokenizer"),
        (["export", tmp_path / "empty_run", "--to", "reference", "--out", tmp_path / "o5"],
         "no complete training checkpoint there"),
    ]
    for argv, message in cases:
        code, out, err = run(capsys, *argv)
        assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
        assert message in err, err
    assert (taken / "keep.txt").read_text() == "mine" and sorted(p.name for p in taken.iterdir()) == ["keep.txt"]
    assert not any(p.name.startswith((".o", "o")) for p in tmp_path.iterdir())  # no partial export left behind
    with pytest.raises(SystemExit):  # argparse: an unknown format
        main(["export", str(root / "gpn_m_1l"), "--to", "onnx", "--out", str(tmp_path / "o6")])


# ---- from a training run (DeepSpeed, one process) ------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(setup, tmp_path_factory):
    """A 5-step run of the tiny GPN+M on the prep output (ZeRO-2), checkpointed at steps 2, 4 and 5, its
    validation loss measured every 2 steps, the samples of every step recorded."""
    _, _, prep, _ = setup
    run_dir = tmp_path_factory.mktemp("run") / "run"
    cmd = [sys.executable, "-m", "gpn_scale", "train", str(ROOT / "configs" / "train" / "gpn_m_tiny.yaml"),
           f"run.dir={run_dir}", f"data.train={prep / 'train'}", f"data.val={prep / 'val'}", "train.total_steps=5",
           "train.save_every=2", "eval.every=2", "data.log_sample_ids=true"]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


@pytest.mark.slow
def test_native_export_of_a_run_takes_its_newest_complete_checkpoint(setup, trained_run, capsys, tmp_path):
    from gpn_scale.storage.native import read_tokenizer

    _, tok, prep, _ = setup
    ckpts = trained_run / "checkpoints"
    assert all((ckpts / f"step_0000000{n}").is_dir() for n in (2, 4, 5))
    code, _, err = run(capsys, "export", trained_run, "--to", "native", "--out", tmp_path / "native")
    assert code == 0, err
    exported, newest = load_native(tmp_path / "native"), load_trained_model(ckpts / "step_00000005")
    for key, value in newest.state_dict().items():
        assert torch.equal(exported.state_dict()[key], value), key
    assert (tmp_path / "native" / "tokenizer.json").read_bytes() == (prep / "tokenizer.json").read_bytes()
    assert {"tokenizer.json", "tokenizer.yaml"} <= json.loads((tmp_path / "native" / "manifest.json").read_text())["files"].keys()
    stats = json.loads((prep / "stats.json").read_text())  # prep without BOS: the record says so, with its EOS
    recorded = read_tokenizer(tmp_path / "native")
    assert (recorded.add_bos, recorded.bos_id, recorded.eos_id) == (False, stats["bos_id"], stats["eos_id"])

    # The newest checkpoint corrupted: skipped with a warning, the one before it exported.
    broken = tmp_path / "broken"
    shutil.copytree(trained_run, broken)
    state = next((broken / "checkpoints" / "step_00000005").glob("*model_states.pt"))
    state.write_bytes(state.read_bytes()[:-100])
    code, _, err = run(capsys, "export", broken, "--to", "reference", "--out", tmp_path / "ref")
    assert code == 0, err
    assert "step_00000005 skipped" in err
    payload = load_reference_pickle(tmp_path / "ref")
    assert payload["step"] == 4
    older = load_trained_model(ckpts / "step_00000004")

    for key, value in older.state_dict().items():
        assert torch.equal(torch.from_numpy(payload["params"][reference_name(key, older.config)]), value), key

    # --to hf from the run: the run's own tokenizer is found; another one is refused.
    code, _, err = run(capsys, "export", trained_run, "--to", "hf", "--out", tmp_path / "hf")
    assert code == 0, err
    card = (tmp_path / "hf" / "README.md").read_text()  # the model card tells the run
    metrics = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    last_eval = [m for m in metrics if "val_loss" in m][-1]
    tokens = read_trainer_state(ckpts / "step_00000005").tokens
    assert "| checkpoint step | 5 of 5 |" in card and f"| tokens seen | {tokens:,} |" in card
    assert f"| {last_eval['step']:,} | {last_eval['val_loss']:.4f} |" in card and f"`{prep / 'train'}`" in card
    hf, hf_tok = load_hf(tmp_path / "hf")
    tokens = torch.tensor([Codec(tok).encode(SENTENCES[3])])
    torch.testing.assert_close(hf(tokens).logits.detach(), gpn_next_token_logits(newest, tokens), rtol=0, atol=1e-5)
    other = make_tokenizer(tmp_path / "other.json", vocab=280)
    code, _, err = run(capsys, "export", trained_run, "--to", "hf", "--out", tmp_path / "hf2", "--tokenizer", other)
    assert code == 2 and "other.json: not the tokenizer the model was trained with" in err


@pytest.mark.slow
def test_reference_export_resumes_in_the_papers_trainer_as_the_run_went_on(setup, trained_run, capsys, tmp_path):
    """Step 4 exported with its AdamW state mapped into the paper's chain state: the paper's loader
    restores it, and, given the windows in the order the run read them, reads next the batch the run's
    step 5 read (data_position is a batch index: 4), and its training step on it gives the run's step-5
    weights (gpn-scale's own uninterrupted step: DeepSpeed's clipped AdamW)."""
    _, _, prep, _ = setup
    ckpts = trained_run / "checkpoints"
    code, _, err = run(capsys, "export", ckpts / "step_00000004", "--to", "reference", "--out", tmp_path / "ref")
    assert code == 0, err
    state = read_trainer_state(ckpts / "step_00000004")
    records = [json.loads(line) for line in (trained_run / "samples.jsonl").read_text().splitlines()]
    in_order = [i for step in range(1, 6) for r in records if r["step"] == step for i in r["samples"]]
    assert len(in_order) == 5 * state.global_batch
    windows = read_windows(open_prep_output(prep / "train"))[in_order].numpy()  # the stream as the run read it
    info, params = paper_resume(tmp_path / "ref", state.config["train"], windows, tmp_path, state.global_batch)
    restored, after = info["restored"], info["after"]
    assert restored["structure_matches"] and restored["classes"] == OPTAX_CLASSES
    assert (restored["step"], restored["data_position"], restored["batch_read"]) == (4, 4, 4)
    assert restored["counts"] == [4, 4] and restored["nu_nonzero"]
    (logged,) = [m["loss"] for m in map(json.loads, (trained_run / "metrics.jsonl").read_text().splitlines())
                 if m.get("step") == 5 and "loss" in m]
    assert after["loss"] == pytest.approx(logged, rel=1e-5)  # the same batch, the same loss
    step5 = load_trained_model(ckpts / "step_00000005")
    step4 = load_trained_model(ckpts / "step_00000004")
    for name, p in step5.named_parameters():
        before = step4.get_parameter(name).detach().numpy()
        moved = p.detach().numpy() - before  # the run's own update
        assert np.abs(moved).max() > 0, name
        np.testing.assert_allclose(params[reference_name(name, step5.config)] - before, moved, rtol=1e-3, atol=1e-7,
                                   err_msg=name)


def test_reference_data_position_counts_the_papers_batches():
    """The paper's trainer reads `dataset.batches(batch_size, start=data_position)`: a batch index. Its
    batch may differ from the run's (said in a note); a remainder rounds down (re-read, never skipped)."""
    from gpn_scale.storage.checkpoints import TrainerState
    from gpn_scale.export.paper_format import data_position

    state = TrainerState(step=6, tokens=6 * 16 * 32, loader={}, world_size=2, zero_stage=2, global_batch=16,
                         data_seq_len=32, config={})
    notes = []
    assert data_position(state, None, notes.append) == 6 and notes == []
    assert data_position(state, 32, notes.append) == 3
    assert notes == ["note: the run's batches held 16 windows; data_position 3 counts batches of 32: run the "
                     "paper's trainer with batch_size 32"]
    notes.clear()
    assert data_position(state, 40, notes.append) == 2  # 96 windows: 2 batches of 40, 16 left over
    assert "the paper's trainer starts 16 windows before where the run stopped" in notes[1]
    assert data_position(None, None, notes.append) == 0
    with pytest.raises(UserError, match="--batch-size: expected a number of windows >= 1, got 0"):
        data_position(state, 0)


def test_batch_size_is_for_reference_exports_only(setup, capsys, tmp_path):
    root, _, _, _ = setup
    code, _, err = run(capsys, "export", root / "gpn_m_2l", "--to", "native", "--out", tmp_path / "n", "--batch-size", 8)
    assert code == 2 and err == "error: --batch-size: only for --to reference (the paper's loader), not --to native\n"
    assert not (tmp_path / "n").exists()
