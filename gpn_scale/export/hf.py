"""`export --to hf`: a directory that Hugging Face transformers loads offline with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` and `AutoTokenizer.from_pretrained(DIR)`.

    config.json            the model fields, `auto_map` to the modeling file, BOS / EOS ids
    model.safetensors      the weights under their native names, float32
    modeling_gpn.py        this package's `modeling_gpn.py`, copied: plain PyTorch, no gpn-scale import
    tokenizer.json | tokenizer.model, tokenizer_config.json, special_tokens_map.json

Only GPN and GPN+M: the modeling file implements their recurrence. Transformer++ and GDN are
refused rather than exported with a second, untested implementation of each.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gpn_scale.errors import UserError

MODELING = "modeling_gpn.py"
_FIELDS = ("family", "vocab_size", "d_state", "d_emb", "d_ffn", "n_layers", "n_heads", "d_key", "d_val",
           "use_decoder_bias")
TRANSFORMERS_VERSION = "4.57"  # the version the modeling file is tested with (pyproject's [hf] extra)


def check_exportable(source) -> None:
    if source.family not in ("gpn", "gpn_m"):
        raise UserError(f"{source.path}: --to hf exports GPN and GPN+M only (the exported modeling file implements "
                        f"their recurrence, not a {source.family} model's layers); export it with --to native")


def write(source, tokenizer, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    specials = write_tokenizer(tokenizer, out)
    cfg = source.model.config
    config = {
        "architectures": ["GPNForCausalLM"],
        "model_type": "gpn",
        "auto_map": {"AutoConfig": "modeling_gpn.GPNConfig", "AutoModelForCausalLM": "modeling_gpn.GPNForCausalLM"},
        **{k: getattr(cfg, k) for k in _FIELDS},
        "bos_token_id": specials.get("bos_id"),
        "eos_token_id": specials.get("eos_id"),
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
        "transformers_version": TRANSFORMERS_VERSION,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    tensors = {k: v.detach().to(torch.float32).contiguous().cpu() for k, v in source.model.state_dict().items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})  # transformers requires "pt"
    shutil.copyfile(Path(__file__).with_name(MODELING), out / MODELING)


def write_tokenizer(tokenizer, out: Path) -> dict:
    """Tokenizer files for `AutoTokenizer`; returns the special tokens' ids (bos_id, eos_id)."""
    from data_prep.tokenizer import Tokenizer

    if tokenizer.eos_id is None:  # nothing recorded: EOS (required) and BOS found by their usual names, as prep does
        info = Tokenizer(str(tokenizer.path)).info
        eos_id, bos_id = info.eos_id, info.bos_id
    else:  # the ids the training data used (prep's --eos-token / --bos-token may name others)
        eos_id, bos_id = tokenizer.eos_id, tokenizer.bos_id
    config = {"clean_up_tokenization_spaces": False,
              "model_max_length": 1 << 30,  # a recurrent model: no context limit
              "model_input_names": ["input_ids", "attention_mask"]}  # no token_type_ids: `generate(**tok(text))` works
    if tokenizer.path.suffix == ".model":  # sentencepiece
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(tokenizer.path))
        token = sp.id_to_piece
        shutil.copyfile(tokenizer.path, out / "tokenizer.model")
        # legacy: text is passed to sentencepiece as it is, as gpn-scale encodes it
        config.update(tokenizer_class="LlamaTokenizer", legacy=True, add_bos_token=tokenizer.add_bos,
                      add_eos_token=False, sp_model_kwargs={})
        if sp.unk_id() >= 0:
            config["unk_token"] = sp.id_to_piece(sp.unk_id())
    else:
        from tokenizers import Tokenizer as HFTokenizer, processors

        tok = HFTokenizer.from_file(str(tokenizer.path))
        token = tok.id_to_token
        # AutoTokenizer adds special tokens by default: exactly BOS when the training data began with one
        # (a post-processor does it), else none, as gpn-scale encodes (tokenizers like LLaMA's add BOS).
        probe = "a b"
        adds = tok.encode(probe).ids != tok.encode(probe, add_special_tokens=False).ids
        template = None
        if tokenizer.add_bos:
            bos = token(bos_id)
            template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                     special_tokens=[(bos, bos_id)])
        elif adds:
            template = processors.TemplateProcessing(single="$A", pair="$A $B")
        if template is None:
            shutil.copyfile(tokenizer.path, out / "tokenizer.json")
        else:
            keep = tok.post_processor if tok.post_processor is not None and not adds else None  # e.g. ByteLevel offsets
            tok.post_processor = template if keep is None else processors.Sequence([keep, template])
            tok.save(str(out / "tokenizer.json"))
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    specials = {"eos_token": token(eos_id)}
    if bos_id is not None:
        specials["bos_token"] = token(bos_id)
    config.update(specials)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=1) + "\n")
    return {"eos_id": eos_id, "bos_id": bos_id}
