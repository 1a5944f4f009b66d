"""The model card (README.md) of an HF export: what the model is and how large, how it starts a
text, what it was trained on and for how long, and how it scored. Everything comes from the
checkpoint and its run (trainer_state.json, the prep's stats.json, metrics.jsonl); what the
checkpoint does not record is said to be unrecorded, never filled in."""

from __future__ import annotations

from pathlib import Path

from gpn_scale.storage.jsonl import read_jsonl
from gpn_scale.model_info import parameter_groups


def _training(source) -> list[str]:
    state = source.trainer_state
    if state is None:
        return ["Not recorded: this export was made from a native checkpoint, which keeps the weights and not the run."]
    cfg = state.config
    train = cfg.get("train", {})
    total = train.get("total_steps")
    lines = [f"| checkpoint step | {state.step:,}" + (f" of {total:,}" if isinstance(total, int) else "") + " |",
             f"| tokens seen | {state.tokens:,} |",
             f"| global batch | {state.global_batch} windows of {state.data_seq_len or '?'} tokens |"]
    for key, label in (("lr", "peak learning rate"), ("warmup_steps", "warm-up steps"), ("min_lr_ratio", "final LR ratio"),
                       ("weight_decay", "weight decay"), ("beta1", "Adam beta1"), ("beta2", "Adam beta2"),
                       ("grad_clip", "gradient clipping (global norm)")):
        if key in train:
            lines.append(f"| {label} | {train[key]} |")
    if "precision" in cfg:
        lines.append(f"| precision | {cfg['precision']} |")
    lines.append(f"| ZeRO stage, ranks | {state.zero_stage}, {state.world_size} |")
    data = cfg.get("data", {}).get("train")
    out = ["| | |", "|---|---|", *lines, ""]
    if isinstance(data, list):  # a mixture: its sources and their weights (each a prep output of its own)
        parts = [f"`{s.get('path')}` ({_weight(s)})" for s in data if isinstance(s, dict)]
        out.append(f"Training data: a mixture of {len(parts)} `gpn-scale prep` outputs: {', '.join(parts)}.")
    elif data:
        out.append(f"Training data: `{data}` (a `gpn-scale prep` output)" + _data_stats(source) + ".")
    return out


def _weight(saved_source: dict) -> str:
    for key in ("proportion", "repeat", "choose"):
        if saved_source.get(key) is not None:
            return f"{key} {saved_source[key]}"
    return "all samples once per epoch"


def _data_stats(source) -> str:
    from gpn_scale.eval.prep_output import training_prep

    prep = training_prep(source.checkpoint)
    if prep is None or prep.stats is None:
        return ", no longer readable at export"
    stats = prep.stats
    split = stats.get("splits", {}).get("train", {})
    parts = [f"{split['documents']:,} documents, {split['tokens']:,} tokens" if split else None,
             f"{stats['tokenizer']['kind']} tokenizer of {stats['vocab_size']:,} tokens",
             "each document BOS ... EOS" if stats.get("add_bos") else "each document followed by EOS"]
    return ": " + "; ".join(p for p in parts if p)


def _evaluation(source) -> list[str]:
    if source.checkpoint is None:
        return ["Not recorded with a native checkpoint; `gpn-scale eval` and `gpn-scale lm-eval` measure it."]
    run_dir = source.checkpoint.parent.parent
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl")
               if "val_loss" in r and isinstance(r.get("step"), int) and r["step"] <= source.step]
    if not records:
        return ["The run recorded no validation loss up to this step; `gpn-scale eval` and `gpn-scale lm-eval` "
                "measure it."]
    last = records[-1]
    return ["Held-out loss the run measured during training (mean cross-entropy over every position of the "
            "validation windows):", "", "| step | validation loss (nats) | PPL | tokens |", "|---|---|---|---|",
            f"| {last['step']:,} | {last['val_loss']:.4f} | {last.get('val_ppl', float('nan')):.3f} | "
            f"{last.get('val_tokens', 0):,} |"]


def model_card(source, tokenizer, specials) -> str:
    model = source.model
    cfg = model.config
    name = "GPN+M" if cfg.memory else "GPN"
    groups = parameter_groups(model)
    total = sum(groups.values())
    memory = f"{cfg.n_heads} heads of {cfg.d_key} x {cfg.d_val}" if cfg.memory else "none"
    start = ("the state after BOS: every training document began with it" if specials.start_state == "bos"
             else "the empty state, as every training window began")
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation", "tags: [gpn, recurrent, gpn-scale]", "---",
        "", f"# {name}, {cfg.n_layers} predict layer(s), {total / 1e6:.2f}M parameters", "",
        f"A Grounded Prediction Network{' with matrix memory' if cfg.memory else ''}: one wide recurrent state "
        "revisited every token (predict, score, ground), exported by gpn-scale from "
        f"`{Path(source.path).name}`. Fixed-size state, constant time and memory per generated token.",
        "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
        'model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)  # dtype=torch.bfloat16 works too',
        "tok = AutoTokenizer.from_pretrained(PATH)",
        'out = model.generate(**tok("The river", return_tensors="pt"), max_new_tokens=50, do_sample=False)', "```",
        "", "## Model", "", "| | |", "|---|---|",
        f"| family | {cfg.family} |", f"| state width d | {cfg.d_state} |", f"| embedding width | {cfg.d_emb} |",
        f"| MLP width | {cfg.d_ffn} |", f"| predict layers | {cfg.n_layers} |", f"| memory | {memory} |",
        f"| vocabulary | {cfg.vocab_size:,} |",
        *(f"| parameters: {group} | {n:,} |" for group, n in groups.items()), f"| parameters | {total:,} |",
        "", f"Start of text: {start}. The BOS token (id {specials.bos_id}) stands for it wherever it appears; the "
        f"tokenizer adds no special token. EOS: id {specials.eos_id}.",
        "", "## Training", "", *_training(source), "", "## Evaluation", "", *_evaluation(source), "",
    ]
    return "\n".join(lines)


def llama_card(source, tokenizer, specials, window: int | None) -> str:
    """The model card of a Transformer++ exported as a plain `LlamaForCausalLM` (export/llama.py)."""
    model = source.model
    cfg = model.config
    groups = parameter_groups(model)
    total = sum(groups.values())
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation", "tags: [llama, transformer, gpn-scale]",
        "---", "", f"# Transformer++, {cfg.n_layers} layers, {total / 1e6:.2f}M parameters", "",
        "The attention baseline of gpn-scale (pre-norm RMSNorm blocks, rotary position embeddings, SwiGLU MLPs, "
        f"no biases), exported by gpn-scale from `{Path(source.path).name}` as a plain `LlamaForCausalLM`: "
        "no remote code.", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
        "model = AutoModelForCausalLM.from_pretrained(PATH)  # dtype=torch.bfloat16 works too",
        "tok = AutoTokenizer.from_pretrained(PATH)",
        'out = model.generate(**tok("The river", return_tensors="pt"), max_new_tokens=50, do_sample=False)', "```",
        "", "## Model", "", "| | |", "|---|---|",
        f"| width | {cfg.d_model} |", f"| layers | {cfg.n_layers} |",
        f"| attention heads | {cfg.n_heads} of {cfg.d_model // cfg.n_heads} (as many key/value heads) |",
        f"| MLP width (SwiGLU) | {cfg.d_ffn} |", f"| RoPE theta | {cfg.rope_theta:g} |",
        f"| vocabulary | {cfg.vocab_size:,} |",
        f"| training window | {f'{window:,} tokens' if window else 'not recorded (a native checkpoint)'} |",
        *(f"| parameters: {group} | {n:,} |" for group, n in groups.items()), f"| parameters | {total:,} |",
        "", f"Start of text: the tokenizer puts BOS (id {specials.bos_id}) before every text. In gpn-scale the first "
        "position of every training window read a learned start vector, not a token; here it is BOS's input "
        "embedding, and `lm_head` keeps the trained embedding (`tie_word_embeddings: false`; gpn-scale ties them, so "
        "the file holds the embedding twice). The logits of BOS followed by a text are gpn-scale's logits of the text: "
        "position t scores the text's token t. BOS was no input in training: a BOS inside a text reads the start "
        f"vector too. EOS: id {specials.eos_id}.",
        "", "## Training", "", *_training(source), "", "## Evaluation", "", *_evaluation(source), "",
    ]
    return "\n".join(lines)
