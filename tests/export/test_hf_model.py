"""The Hugging Face export as transformers users use models: low-precision loads, nn.Linear /
nn.Embedding modules that PEFT adapts, embedding resizes, gradient checkpointing, a Trainer step,
the start of text, generation through the recurrent cache, and the files beside the weights."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub

import pytest
import torch
from support.eval_fixtures import SENTENCES, make_prep, make_tokenizer, tiny_model, train

from gpn_scale.cli import main
from gpn_scale.eval.codec import Codec
from gpn_scale.eval.prep_output import open_prep_output, read_windows
from gpn_scale.storage.native import save_native

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny GPN+M trained on a prep without BOS and one trained on a prep with BOS, each exported to HF."""
    root = tmp_path_factory.mktemp("hf_model")
    tok = make_tokenizer(root / "tok.json")
    out = {}
    for name, bos in (("plain", False), ("bos", True)):
        prep = make_prep(root / f"data_{name}", tok, bos=bos)
        model = train(tiny_model(Codec(tok).vocab_size, n_layers=2), read_windows(open_prep_output(prep / "train")),
                      steps=30)
        save_native(model, root / name)
        from gpn_scale.export import Source, write_native

        native = root / f"{name}_native"  # framed as its training data (tokenizer.yaml), as a run's export is
        native.mkdir()
        write_native(Source(model, root / name), open_prep_output(prep).tokenizer_source(), native)
        assert main(["export", str(native), "--to", "hf", "--out", str(root / f"{name}_hf")]) == 0
        out[name] = (model, root / f"{name}_hf", read_windows(open_prep_output(prep / "train")))
    return tok, out


def load(path, **kwargs):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kwargs)
    return (loaded[0].eval(), loaded[1]) if isinstance(loaded, tuple) else loaded.eval()


def native_logits(model, tokens: torch.Tensor, bos: int | None = None) -> torch.Tensor:
    """gpn-scale's scores of the next token at the start and after each of `tokens` (B, n + 1, V): its
    logits at position t score token t itself, transformers' the token after input t. `bos`: fed first."""
    first = [] if bos is None else [torch.full((tokens.shape[0], 1), bos)]
    full = torch.cat([*first, tokens, torch.zeros(tokens.shape[0], 1, dtype=torch.long)], 1)
    with torch.no_grad():
        return model(full, return_logits=True, core="naive").logits[:, len(first):]


def test_hf_modules_are_linear_and_embedding_and_every_weight_is_mapped(setup):
    model, path, _ = setup[1]["plain"]
    hf, info = load(path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weight
    assert isinstance(hf.get_input_embeddings(), torch.nn.Embedding) and hf.get_input_embeddings() is hf.model.embed_tokens
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # tied, as the native model's decoder reads `embedding`
    linears = {n for n, m in hf.named_modules() if type(m) is torch.nn.Linear}
    assert {"model.layers.1.mlp.up_proj", "model.layers.0.memory_read.query_proj", "model.memory_write.key_proj",
            "model.input_proj", "decoder_proj", "lm_head"} <= linears
    # every native number is somewhere in the HF model, once (the SwiGLU's W1 split in two)
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_loads_run_with_float32_state_within_the_dtypes_tolerance(setup, dtype):
    """from_pretrained(dtype=...), .to(dtype) and .half()/.bfloat16() run; the state and M stay float32; the
    logits are no further from float32 than gpn-scale's own mixed-precision forward, within 2.5x."""
    model, path, windows = setup[1]["plain"]
    tokens = windows[:2, :24]
    with torch.no_grad():
        ref = load(path)(tokens).logits
        with torch.autocast("cpu", dtype=dtype):  # training's arithmetic: GEMMs in dtype, state and M float32
            mixed = native_logits(model, tokens)[:, 1:]
    native_err = (mixed - ref).abs().max().item()
    for hf in (load(path, dtype=dtype), load(path).to(dtype), load(path).half() if dtype == torch.float16
               else load(path).bfloat16()):
        assert hf.dtype == dtype and hf.model.layers[0].mlp.up_proj.weight.dtype == dtype
        with torch.no_grad():
            out = hf(tokens)
        assert out.logits.dtype == torch.float32 and all(s.dtype == torch.float32 for s in out.state)
        err = (out.logits - ref).abs().max().item()
        assert 0 < err <= 2.5 * native_err, (err, native_err)
        generated = hf.generate(tokens[:1, :8], max_new_tokens=4, do_sample=False)
        assert generated.shape == (1, 12)


def test_lora_trains_only_the_adapters_and_the_adapted_loop_equals_the_merged_one(setup):
    """PEFT finds the nn.Linear modules; a step changes the adapters only; the adapted model (its projections
    called module by module in the loop) gives the logits of the same adapters merged into the weights
    (the fused loop)."""
    peft = pytest.importorskip("peft")
    _, path, windows = setup[1]["plain"]
    hf = load(path)
    lora = peft.get_peft_model(hf, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["up_proj", "down_proj", "query_proj", "key_proj", "ground_gate"]))
    before = {n: p.detach().clone() for n, p in lora.named_parameters()}
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    lora.train()
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    batch = windows[:4, :16]
    loss0 = lora(input_ids=batch, labels=batch).loss
    loss0.backward()
    opt.step()
    changed = {n for n, p in lora.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable and {n for n in changed if "lora_B" in n}
    lora.eval()
    with torch.no_grad():
        adapted = lora(input_ids=batch).logits
        assert lora(input_ids=batch, labels=batch).loss < loss0
        merged = lora.merge_and_unload()
        assert type(merged.model.layers[0].mlp.up_proj) is torch.nn.Linear
        torch.testing.assert_close(merged(batch).logits, adapted, rtol=0, atol=1e-4)
        assert (merged(batch).logits - load(path)(batch).logits).abs().max() > 1e-3  # the adapters did something


def test_embeddings_resize_and_set(setup):
    _, path, windows = setup[1]["plain"]
    hf = load(path)
    tokens = windows[:2, :12]
    with torch.no_grad():
        before = hf(tokens).logits
    V = hf.config.vocab_size
    hf.resize_token_embeddings(V + 8)
    assert hf.config.vocab_size == V + 8 and hf.lm_head.weight is hf.model.embed_tokens.weight
    with torch.no_grad():
        after = hf(tokens).logits
    assert after.shape[-1] == V + 8
    torch.testing.assert_close(after[..., :V], before, rtol=0, atol=1e-5)
    new = torch.nn.Embedding(V + 8, hf.config.d_emb)
    hf.set_input_embeddings(new)
    assert hf.get_input_embeddings() is new


def test_gradient_checkpointing_recomputes_time_segments_with_the_same_gradients(setup):
    _, path, windows = setup[1]["plain"]
    batch = windows[:3, :20]
    grads = {}
    for checkpointing in (False, True):
        hf = load(path)
        hf.config.checkpoint_segment = 6
        if checkpointing:
            hf.gradient_checkpointing_enable()
        steps = []
        hf.model._step = (lambda step: lambda *a: steps.append(1) or step(*a))(hf.model._step)
        hf.train()
        hf(input_ids=batch, labels=batch).loss.backward()
        grads[checkpointing] = {n: p.grad for n, p in hf.named_parameters()}
        # every step once, and again in the backward when segments are recomputed (and the start once)
        assert len(steps) == (2 * 20 if checkpointing else 20)
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_one_trainer_step(setup, tmp_path):
    from transformers import Trainer, TrainingArguments

    _, path, windows = setup[1]["plain"]
    hf = load(path)
    before = {n: p.detach().clone() for n, p in hf.named_parameters()}
    data = [{"input_ids": w[:16], "labels": w[:16]} for w in windows[:8]]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4,
                             learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
                             gradient_checkpointing=True, dataloader_num_workers=0)
    result = Trainer(model=hf, args=args, train_dataset=data).train()
    assert result.global_step == 1 and torch.isfinite(torch.tensor(result.training_loss))
    assert all(not torch.equal(p, before[n]) for n, p in hf.named_parameters() if n.endswith("up_proj.weight"))


@pytest.mark.parametrize("name", ["plain", "bos"])
def test_the_start_of_text_is_the_initial_state_and_bos_stands_for_it(setup, name):
    """start_state empty: the first token is scored from the empty state; bos: from the state after BOS, as
    the training documents began. A leading BOS changes nothing, a BOS inside a text starts it again, and
    the tokenizer adds none, so `tok(text)` scores and generates as gpn-scale does."""
    from transformers import AutoTokenizer

    model, path, windows = setup[1][name]
    hf, tok = load(path), AutoTokenizer.from_pretrained(path)
    bos = hf.config.bos_token_id
    assert hf.config.start_state == ("bos" if name == "bos" else "empty") and tok.bos_token_id == bos
    ids = tok(SENTENCES[2], return_tensors="pt").input_ids
    assert ids[0].tolist() == Codec(setup[0]).encode(SENTENCES[2])
    with torch.no_grad():
        plain = hf(ids).logits
        initial = hf(ids[:, :0].new_full((1, 1), bos)).logits  # the prediction at the start
        with_bos = hf(torch.cat([ids.new_full((1, 1), bos), ids], 1)).logits
        again = hf(torch.cat([ids, ids.new_full((1, 1), bos), ids], 1)).logits
    ours = native_logits(model, ids, bos if name == "bos" else None)
    torch.testing.assert_close(plain, ours[:, 1:], rtol=0, atol=1e-5)
    torch.testing.assert_close(initial, ours[:, :1], rtol=0, atol=1e-5)
    # Windows of other lengths run GEMMs of other shapes, whose sums may round apart: float32's tolerance.
    torch.testing.assert_close(with_bos, torch.cat([initial, plain], 1), rtol=1.3e-6, atol=1e-6)
    n = ids.shape[1]
    torch.testing.assert_close(again[:, n + 1:], plain, rtol=1.3e-6, atol=1e-6)
    if name == "plain":  # without BOS in training, BOS's embedding plays no part as an input (only as a score)
        hf.model.embed_tokens.weight.data[bos] += 10.0
        others = torch.arange(hf.config.vocab_size) != bos
        with torch.no_grad():
            moved = hf(torch.cat([ids.new_full((1, 1), bos), ids], 1)).logits
        torch.testing.assert_close(moved[..., others], with_bos[..., others], rtol=1.3e-6, atol=1e-6)


def test_generate_builds_the_fused_weights_once_and_feeds_one_token_a_step(setup):
    _, path, windows = setup[1]["plain"]
    hf = load(path)
    builds, lengths = [], []
    hf.model._build_maps = (lambda build: lambda: builds.append(1) or build())(hf.model._build_maps)
    hf.register_forward_hook(lambda m, args, kwargs, out: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    prompt = windows[:1, :10]
    hf.generate(prompt, max_new_tokens=12, do_sample=False)
    assert lengths == [10] + [1] * 11 and len(builds) == 1
    hf.generate(prompt, max_new_tokens=3, do_sample=False)
    assert len(builds) == 1  # the weights did not change: nothing rebuilt
    with torch.no_grad():
        hf.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    hf.generate(prompt, max_new_tokens=3, do_sample=False)
    assert len(builds) == 2  # they did


def test_export_carries_pad_generation_config_and_a_model_card(setup, recwarn, caplog):
    from transformers import GenerationConfig

    model, path, windows = setup[1]["bos"]
    config = json.loads((path / "config.json").read_text())
    generation = GenerationConfig.from_pretrained(path)
    assert config["pad_token_id"] == config["eos_token_id"] == generation.pad_token_id == generation.eos_token_id
    assert generation.bos_token_id == config["bos_token_id"]
    hf = load(path)
    with caplog.at_level("WARNING"):
        hf.generate(windows[:1, :6], max_new_tokens=3, do_sample=False)
    assert "pad_token_id" not in caplog.text and not [w for w in recwarn if "pad_token_id" in str(w.message)]
    # The tokenizer's whole output (input_ids and attention_mask), as docs/export.md says: no warning at all.
    caplog.clear()
    recwarn.clear()
    with caplog.at_level("WARNING"):
        hf.generate(input_ids=windows[:1, :6], attention_mask=torch.ones(1, 6, dtype=torch.long), max_new_tokens=3,
                    do_sample=False)
    assert "attention" not in caplog.text and not [w for w in recwarn if "attention" in str(w.message)], caplog.text
    card = (path / "README.md").read_text()
    total = sum(p.numel() for p in model.parameters())
    assert card.startswith("---\nlibrary_name: transformers\n") and f"| parameters | {total:,} |" in card
    assert "| predict layers | 2 |" in card and "state after BOS" in card
    assert "native checkpoint" in card  # this one records no run: said so, not invented

