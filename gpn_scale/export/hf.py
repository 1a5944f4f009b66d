"""`export --to hf`: a directory that Hugging Face transformers loads offline with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` and `AutoTokenizer.from_pretrained(DIR)`.
This file writes GPN and GPN+M; a Transformer++ leaves as a plain `LlamaForCausalLM` (no remote
code: `gpn_scale/export/llama.py`).

    config.json              the model fields, `auto_map` to the modeling file, BOS / EOS / pad ids, start_state
    generation_config.json   the same ids, for `generate`
    model.safetensors        the weights under the HF model's names, as nn.Linear / nn.Embedding weights, float32
    modeling_gpn.py          this package's `modeling_gpn.py`, copied: plain PyTorch, no gpn-scale import
    tokenizer.json | tokenizer.model, tokenizer_config.json, special_tokens_map.json
    README.md                the model card: config, parameter count, training data and steps, evaluation

Start of text (docs/export.md): the model starts from its initial state, the empty state or (when
the training data began every document with BOS) the state after BOS; the BOS token stands for
it wherever it appears, and the tokenizer adds no special token. A tokenizer without a BOS token
lets EOS stand for the start (as GPT-2's `<|endoftext|>` does).

The modeling file implements the GPN recurrence only. GDN has no transformers architecture to
leave as, and is refused rather than exported with a second, untested implementation of it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from data_prep.errors import UserError

MODELING = "modeling_gpn.py"
_FIELDS = ("family", "vocab_size", "d_state", "d_emb", "d_ffn", "n_layers", "n_heads", "d_key", "d_val",
           "use_decoder_bias")
TRANSFORMERS_VERSION = "4.57"  # the version the modeling file is tested with (pyproject's [hf] extra)


@dataclass(frozen=True)
class Specials:
    """The export's special tokens. bos_id: the token that stands for the start of text (the
    tokenizer's BOS, else its EOS); start_state: "bos" when every training document began with
    BOS (the initial state is the state after it), else "empty"."""

    bos_id: int
    eos_id: int
    start_state: str

    @property
    def pad_id(self) -> int:
        return self.eos_id  # padding is masked (attention_mask) or after the scored tokens: any id serves


def check_exportable(source) -> None:
    """GPN and GPN+M; a Transformer++ goes to `llama.py` (export/__init__.py), anything else is refused."""
    if source.family not in ("gpn", "gpn_m"):
        raise UserError(f"{source.path}: --to hf exports GPN and GPN+M (with their modeling file) and Transformer++ "
                        f"(as LlamaForCausalLM) only, not a {source.family} model (no transformers architecture has "
                        f"its layers); export it with --to native")


def hf_weights(model) -> dict:
    """A native GPN's parameters under the HF model's names (`modeling_gpn.py`), float32; matrices
    transposed to nn.Linear's `out x in`, the SwiGLU's W1 split into gate_proj and up_proj. The
    tied lm_head is not stored: transformers ties it to model.embed_tokens."""
    import torch

    cfg = model.config
    p = {k: v.detach().to(torch.float32).cpu() for k, v in model.state_dict().items()}
    t = lambda name: p[name].t().contiguous()  # noqa: E731
    out = {"model.embed_tokens.weight": p["embedding"], "model.input_norm.weight": p["fuse_norm_w"],
           "model.input_proj.weight": t("fuse_proj_k"), "model.ground_norm.weight": p["fg_norm_w"],
           "model.ground_gate.weight": t("fg_gate_k"), "model.ground_gate.bias": p["fg_gate_b"],
           "decoder_norm.weight": p["decode_norm_w"], "decoder_proj.weight": t("decode_proj_k")}
    if cfg.use_decoder_bias:
        out["decoder_proj.bias"] = p["decode_bias"]
    if cfg.memory:
        w = "model.memory_write."
        out.update({w + "norm.weight": p["write_norm_w"], w + "key_proj.weight": t("write_W_k_k"),
                    w + "key_proj.bias": p["write_W_k_b"], w + "value_proj.weight": t("write_W_v_k"),
                    w + "beta_proj.weight": t("write_W_beta_k"), w + "decay_proj.weight": t("write_W_a_k"),
                    w + "decay_proj.bias": p["write_dt_bias"], w + "A_log": p["write_A_log"]})
    F = cfg.d_ffn
    for i in range(cfg.n_layers):
        n, h = f"layers.{i}.", f"model.layers.{i}."
        w1 = p[n + "ffn_w1_k"]
        out.update({h + "residual_norm.weight": p[n + "pg_norm_w"], h + "residual_gate.weight": t(n + "pg_gate_k"),
                    h + "residual_gate.bias": p[n + "pg_gate_b"], h + "mlp_norm.weight": p[n + "ffn_norm_w"],
                    h + "mlp.gate_proj.weight": w1[:, :F].t().contiguous(),
                    h + "mlp.up_proj.weight": w1[:, F:].t().contiguous(), h + "mlp.down_proj.weight": t(n + "ffn_w2_k")})
        if cfg.memory:
            r = h + "memory_read."
            out.update({r + "norm.weight": p[n + "read_norm_w"], r + "query_proj.weight": t(n + "read_W_q_k"),
                        r + "query_proj.bias": p[n + "read_W_q_b"], r + "out_gate_proj.weight": t(n + "read_W_gate_k"),
                        r + "out_norm.weight": p[n + "read_out_norm_w"], r + "out_proj.weight": t(n + "read_W_o_k")})
    return out


def write(source, tokenizer, out: Path) -> None:
    from safetensors.torch import save_file

    specials = write_tokenizer(tokenizer, out)
    cfg = source.model.config
    ids = {"bos_token_id": specials.bos_id, "eos_token_id": specials.eos_id, "pad_token_id": specials.pad_id}
    config = {
        "architectures": ["GPNForCausalLM"],
        "model_type": "gpn",
        "auto_map": {"AutoConfig": "modeling_gpn.GPNConfig", "AutoModel": "modeling_gpn.GPNModel",
                     "AutoModelForCausalLM": "modeling_gpn.GPNForCausalLM"},
        **{k: getattr(cfg, k) for k in _FIELDS},
        "start_state": specials.start_state,
        **ids,
        "dtype": "float32",
        "tie_word_embeddings": True,
        "transformers_version": TRANSFORMERS_VERSION,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "generation_config.json").write_text(json.dumps({**ids, "transformers_version": TRANSFORMERS_VERSION},
                                                           indent=1) + "\n")
    save_file(hf_weights(source.model), out / "model.safetensors", metadata={"format": "pt"})  # transformers requires "pt"
    shutil.copyfile(Path(__file__).with_name(MODELING), out / MODELING)
    from gpn_scale.export.card import model_card

    (out / "README.md").write_text(model_card(source, tokenizer, specials))


def special_ids(tokenizer) -> tuple[int | None, int]:
    """(BOS id or None, EOS id): those the training data used where recorded, else found by their
    usual names, as prep finds them."""
    from data_prep.tokenizer import Tokenizer

    if tokenizer.eos_id is None:  # nothing recorded: EOS (required) and BOS found by their usual names, as prep does
        info = Tokenizer(str(tokenizer.path)).info
        return info.bos_id, info.eos_id
    return tokenizer.bos_id, tokenizer.eos_id  # the ids the training data used (prep's --eos-token / --bos-token)


def write_tokenizer(tokenizer, out: Path, prefix_bos: bool = False, max_length: int | None = None) -> Specials:
    """Tokenizer files for `AutoTokenizer`; returns the special tokens. By default it adds no special
    token to text (a GPN starts from its initial state); `prefix_bos`: it puts BOS before every text
    and nothing else, as Llama's tokenizers do (the exported Transformer++'s start of text).
    `max_length`: `model_max_length`, by default unlimited (a recurrent model has no context limit)."""
    bos_id, eos_id = special_ids(tokenizer)
    specials = Specials(bos_id if bos_id is not None else eos_id, eos_id, "bos" if tokenizer.add_bos else "empty")
    config = {"clean_up_tokenization_spaces": False,
              "model_max_length": max_length or 1 << 30,
              "padding_side": "left",  # padded positions leave the state as it is: left padding generates
              "model_input_names": ["input_ids", "attention_mask"]}  # no token_type_ids: `generate(**tok(text))` works
    if tokenizer.path.suffix == ".model":  # sentencepiece
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(tokenizer.path))
        token = sp.id_to_piece
        shutil.copyfile(tokenizer.path, out / "tokenizer.model")
        # legacy: text is passed to sentencepiece as it is, as gpn-scale encodes it
        config.update(tokenizer_class="LlamaTokenizer", legacy=True, add_bos_token=prefix_bos, add_eos_token=False,
                      sp_model_kwargs={})
        if sp.unk_id() >= 0:
            config["unk_token"] = sp.id_to_piece(sp.unk_id())
    else:
        from tokenizers import Tokenizer as HFTokenizer, processors

        tok = HFTokenizer.from_file(str(tokenizer.path))
        token = tok.id_to_token
        # AutoTokenizer adds special tokens by default; the start of text is the model's initial state,
        # so none is added (tokenizers like LLaMA's add BOS: their post-processor is replaced), or BOS alone.
        probe = "a b"
        if prefix_bos:
            bos = tok.id_to_token(specials.bos_id)
            tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                               special_tokens=[(bos, specials.bos_id)])
            tok.save(str(out / "tokenizer.json"))
        elif tok.encode(probe).ids != tok.encode(probe, add_special_tokens=False).ids:
            tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
            tok.save(str(out / "tokenizer.json"))
        else:
            shutil.copyfile(tokenizer.path, out / "tokenizer.json")
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    names = {"bos_token": token(specials.bos_id), "eos_token": token(eos_id), "pad_token": token(specials.pad_id)}
    config.update(names)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(names, indent=1) + "\n")
    return specials
