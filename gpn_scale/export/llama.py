"""`export --to hf` of a Transformer++: a plain `LlamaForCausalLM` directory, no remote code.

    config.json              LlamaConfig's fields ("architectures": ["LlamaForCausalLM"], model_type llama)
    generation_config.json   BOS / EOS / pad ids, for `generate`
    model.safetensors        the weights under Llama's names, float32
    tokenizer.json | tokenizer.model, tokenizer_config.json, special_tokens_map.json
    README.md                the model card

Transformer++ is Llama's architecture (pre-norm RMSNorm blocks, rotate-half RoPE over the whole
head, SwiGLU, no biases, as many key/value heads as query heads) but for one part: position 0 of a
window reads a learned `start` vector, not a token (models/blocks.py). A Llama model starts a text
with a token, so the export makes the start a token: the `start` vector becomes the *input*
embedding of the tokenizer's BOS, the tokenizer puts BOS before every text, and `lm_head` keeps the
trained embedding (untied: `tie_word_embeddings` false), so every token's logit, BOS's included, is
the trained one. The logits of `[BOS] + x` at position t are then gpn-scale's logits of x at t.

That is exact only where BOS never was an input in training: the tokenizer must have a BOS apart
from its EOS (EOS ends every training document), the training data must not have begun documents
with it (prep --bos), and where the prep's unigram counts are readable, BOS must count zero. Any
other case, and any model field or parameter this mapping does not know, is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

from data_prep.errors import UserError

HOW = "export it with --to native"
# TransformerConfig's fields and where each goes; ce_chunk, compile and recompute are how the loss is
# computed and the model trained, not the model.
_FIELDS = ("family", "vocab_size", "d_model", "n_layers", "n_heads", "d_ffn", "rope_theta", "ce_chunk", "compile",
           "recompute")
_LAYER = {"mixer_norm.weight": "input_layernorm.weight", "mixer.q_proj.weight": "self_attn.q_proj.weight",
          "mixer.k_proj.weight": "self_attn.k_proj.weight", "mixer.v_proj.weight": "self_attn.v_proj.weight",
          "mixer.o_proj.weight": "self_attn.o_proj.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
          "mlp.gate_proj.weight": "mlp.gate_proj.weight", "mlp.up_proj.weight": "mlp.up_proj.weight",
          "mlp.down_proj.weight": "mlp.down_proj.weight"}


def check_model(source) -> None:
    """A one-line refusal naming the first model field or parameter Llama has no counterpart for."""
    cfg = source.model.config
    for name in cfg.field_names():
        if name not in _FIELDS:
            raise UserError(f"{source.path}: model.{name}: LlamaForCausalLM has no counterpart for this Transformer++ "
                            f"field, so --to hf cannot write it as Llama; {HOW}")
    for name in source.model.state_dict():
        if name not in _expected(cfg):
            raise UserError(f"{source.path}: parameter {name}: LlamaForCausalLM has no counterpart for it, so --to hf "
                            f"cannot write this Transformer++ as Llama; {HOW}")


def check_tokenizer(source, tokenizer) -> None:
    """What can be refused only with the tokenizer in hand, before anything is written: BOS must
    never have been an input in training (`start_token`), the run's prep's counts read where there."""
    from gpn_scale.eval.prep_output import training_prep

    start_token(source, tokenizer, None if source.checkpoint is None else training_prep(source.checkpoint))


def _expected(cfg) -> set[str]:
    return {"embedding", "start", "norm.weight"} | {f"layers.{i}.{k}" for i in range(cfg.n_layers) for k in _LAYER}


def start_token(source, tokenizer, prep=None) -> int:
    """The id of the token whose input embedding becomes the `start` vector: the tokenizer's BOS,
    refused in one line where it was an input in training (see the module's docstring). `prep`:
    the training run's prep output (`gpn_scale.eval.prep_output.PrepOutput`), whose unigram counts are
    checked where readable."""
    import numpy as np

    from gpn_scale.export.hf import special_ids

    why = "--to hf writes a Transformer++ as LlamaForCausalLM with its learned start vector as BOS's input embedding"
    if tokenizer.add_bos:
        raise UserError(f"{source.path}: {why}, but every training document began with BOS (prep --bos), so BOS "
                        f"has an embedding of its own; {HOW}")
    bos, eos = special_ids(tokenizer)
    if bos is None or bos == eos:
        raise UserError(f"{tokenizer.path}: {why}, but the tokenizer has no BOS apart from its EOS (id {eos}), which "
                        f"ends every training document; {HOW}")
    counts = None if prep is None or prep.root is None else prep.root / "unigram.npy"
    if counts is not None and counts.is_file():
        try:
            seen = np.load(counts, allow_pickle=False)
            n = int(seen[bos]) if bos < len(seen) else 0
        except (OSError, ValueError, IndexError) as e:
            raise UserError(f"{counts}: not the prep's unigram counts ({type(e).__name__}: {e})") from None
        if n:
            raise UserError(f"{counts}: {why}, but BOS (id {bos}) occurs {n:,} times in the training data; {HOW}")
    return bos


def llama_weights(model, bos_id: int) -> dict:
    """The Transformer++'s parameters under LlamaForCausalLM's names, float32: `embedding` is
    `lm_head.weight` as it is and `model.embed_tokens.weight` with BOS's row replaced by `start`."""
    import torch

    p = {k: v.detach().to(torch.float32).cpu().contiguous() for k, v in model.state_dict().items()}
    embed = p["embedding"].clone()
    embed[bos_id] = p["start"]
    out = {"model.embed_tokens.weight": embed, "lm_head.weight": p["embedding"], "model.norm.weight": p["norm.weight"]}
    for i in range(model.config.n_layers):
        out.update({f"model.layers.{i}.{theirs}": p[f"layers.{i}.{ours}"] for ours, theirs in _LAYER.items()})
    return out


def llama_config(cfg, specials, max_positions: int | None, version: str) -> dict:
    from gpn_scale.models.ops import RMS_EPS

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ffn,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.d_model // cfg.n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": RMS_EPS,
        "rope_theta": float(cfg.rope_theta),
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,  # lm_head is the trained embedding; BOS's input row is the start vector
        "use_cache": True,
        "bos_token_id": specials.bos_id,
        "eos_token_id": specials.eos_id,
        "pad_token_id": specials.pad_id,
        "dtype": "float32",
        "transformers_version": version,
    }
    if max_positions is not None:  # the training window: RoPE itself has no limit, tools read this one
        config["max_position_embeddings"] = max_positions
    return dict(sorted(config.items(), key=lambda kv: kv[0] != "architectures"))


def write(source, tokenizer, out: Path) -> None:
    from safetensors.torch import save_file

    from gpn_scale.eval.prep_output import training_prep
    from gpn_scale.export.card import llama_card
    from gpn_scale.export.hf import TRANSFORMERS_VERSION, write_tokenizer

    prep = None if source.checkpoint is None else training_prep(source.checkpoint)
    bos = start_token(source, tokenizer, prep)
    window = None if source.trainer_state is None else source.trainer_state.data_seq_len
    specials = write_tokenizer(tokenizer, out, prefix_bos=True, max_length=window)
    assert specials.bos_id == bos
    ids = {"bos_token_id": specials.bos_id, "eos_token_id": specials.eos_id, "pad_token_id": specials.pad_id}
    config = llama_config(source.model.config, specials, window, TRANSFORMERS_VERSION)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "generation_config.json").write_text(json.dumps({**ids, "transformers_version": TRANSFORMERS_VERSION},
                                                           indent=1) + "\n")
    save_file(llama_weights(source.model, bos), out / "model.safetensors", metadata={"format": "pt"})
    (out / "README.md").write_text(llama_card(source, tokenizer, specials, window))
