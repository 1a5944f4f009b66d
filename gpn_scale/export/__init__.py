"""`gpn-scale export CKPT --to hf|reference|native --out DIR`: a model out of gpn-scale, into the
tools its users have (docs/export.md).

CKPT is anything `gpn_scale.storage.checkpoints.load_model` reads: a native checkpoint, a training
checkpoint, or a run directory (its newest complete checkpoint: one that verifies against its
manifest). The export is written into a temporary directory beside DIR and renamed to DIR only
once complete; an existing non-empty DIR is refused, never overwritten (`data_prep.outputs`).

- `hf`: Hugging Face transformers (`gpn_scale/export/hf.py`): config.json, model.safetensors, the
  self-contained modeling file, tokenizer files; a Transformer++ as a plain `LlamaForCausalLM`, no
  modeling file (`gpn_scale/export/llama.py`).
- `reference`: the paper's `checkpoint.pkl` (parameters, the AdamW state in the paper's optax
  structure, step, data position) and JSON config (`gpn_scale/export/paper_format.py`); the paper's
  trainer resumes from it and `gpn-scale convert --from-reference` reads it back bit-exactly.
- `native`: model.safetensors + model.yaml + the tokenizer, all listed in manifest.json.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from data_prep.errors import UserError
from gpn_scale.storage.native import TokenizerSource
from data_prep.outputs import check_new, new_directory

FORMATS = ("hf", "reference", "native")


@dataclass(frozen=True)
class Source:
    """What is exported: the model (float32, CPU), where it came from, and for a training checkpoint
    its directory and trainer_state.json (step, tokens, loader position, the run's config)."""

    model: object  # torch.nn.Module
    path: Path
    trainer_state: object | None = None  # gpn_scale.storage.checkpoints.TrainerState
    checkpoint: Path | None = None  # the training checkpoint (`.../checkpoints/step_N`), verified

    @property
    def family(self) -> str:
        return self.model.config.family

    @property
    def step(self) -> int | None:
        return None if self.trainer_state is None else self.trainer_state.step


def load_source(path: str | Path) -> Source:
    from gpn_scale.storage import checkpoints

    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such checkpoint or run directory")
    if (path / checkpoints.WEIGHTS).is_file():
        return Source(checkpoints.load_native(path).eval(), path)
    tag = checkpoints.training_checkpoint(path, warn=lambda line: print(line, file=sys.stderr))  # verified
    if tag is None:
        raise UserError(f"{path}: not a native checkpoint, and no complete training checkpoint there")
    model = checkpoints.load_trained_model(tag)  # the same, leased checkpoint (not hashed again)
    return Source(model.eval(), path, checkpoints.read_trainer_state(tag), tag)


def find_tokenizer(source: Source, given: str | None) -> TokenizerSource:
    """--tokenizer, else the tokenizer of the data the run was trained on, else the one a native
    export put beside its weights, framed (BOS, EOS) as the training data was where that is
    recorded (`gpn_scale.eval.prep_output.choose_tokenizer`). A tokenizer other than the training data's
    is refused."""
    from gpn_scale.eval.prep_output import choose_tokenizer, training_prep

    return choose_tokenizer(source.path, given, None, training_prep(source.path), source.model)[1]


def write_native(source: Source, tokenizer: TokenizerSource, out: Path) -> None:
    from gpn_scale.storage.manifest import write_manifest
    from gpn_scale.storage.native import CONFIG, WEIGHTS, save_native, write_tokenizer

    save_native(source.model, out)
    names = write_tokenizer(tokenizer, out)
    write_manifest(out, [WEIGHTS, CONFIG, *names])  # the tokenizer is verified with the weights


def export(checkpoint: str | Path, to: str, out: str | Path, tokenizer: str | None = None,
           batch_size: int | None = None) -> Path:
    """Export CKPT as `to` into the new directory `out`; returns it. `batch_size`: `--to reference`'s
    windows per batch of the paper's loader (default: the run's global batch)."""
    if to not in FORMATS:
        raise UserError(f"--to: expected one of {', '.join(FORMATS)}, got {to!r}")
    if batch_size is not None and to != "reference":
        raise UserError(f"--batch-size: only for --to reference (the paper's loader), not --to {to}")
    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size: expected a number of windows >= 1, got {batch_size}")
    out = Path(out)
    check_new(out, "--out", "export")  # before the checkpoint is read: a refusal costs nothing
    source = load_source(checkpoint)
    llama = to == "hf" and source.family == "transformer"  # a Transformer++ leaves as LlamaForCausalLM
    if to == "hf":
        from gpn_scale.export import hf, llama as to_llama

        (to_llama.check_model if llama else hf.check_exportable)(source)
    elif to == "reference":
        from gpn_scale.export import paper_format

        paper_format.check_exportable(source)
    tok = find_tokenizer(source, tokenizer) if to in ("hf", "native") else None
    if llama:
        to_llama.check_tokenizer(source, tok)  # a refusal before anything is written
    with new_directory(out, "--out", "export") as staging:
        if llama:
            to_llama.write(source, tok, staging)
        elif to == "hf":
            hf.write(source, tok, staging)
        elif to == "reference":
            paper_format.write(source, staging, batch_size)
        else:
            write_native(source, tok, staging)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="gpn-scale export", description="export a checkpoint to Hugging Face "
                                 "transformers, the paper's reference format, or a native checkpoint")
    ap.add_argument("checkpoint", metavar="RUN_OR_CKPT",
                    help="a run directory (its newest complete checkpoint), a training checkpoint or a native one")
    ap.add_argument("--to", required=True, choices=FORMATS,
                    help="hf: a transformers model directory; reference: the paper's checkpoint.pkl + config.json; "
                         "native: safetensors + YAML + tokenizer + manifest")
    ap.add_argument("--out", required=True, metavar="DIR", help="directory to create (must not exist, or be empty)")
    ap.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json or sentencepiece .model for hf and native "
                    "(default: the one of the run's training data, or the one in a native export)")
    ap.add_argument("--batch-size", type=int, metavar="WINDOWS",
                    help="reference: windows per batch the paper's trainer will run with; data_position counts "
                         "its batches (default: the run's train.global_batch)")
    args = ap.parse_args(argv)
    out = export(args.checkpoint, args.to, args.out, args.tokenizer, args.batch_size)
    print(f"wrote {out} ({args.to})")
    return 0
