"""The one CLI, `gpn-scale SUBCOMMAND ...`.

Each subcommand lives beside the code it drives and owns its argument parser: `main(argv)`
returning an exit status. Modules are imported only when their subcommand runs, so
`gpn-scale --help` stays fast and a subcommand pays only for its own dependencies.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import sys

from gpn_scale.storage import leases
from data_prep.errors import UserError

COMMANDS = {
    "model-info": ("gpn_scale.model_info:main", "print a model config's parameter breakdown"),
    "convert": ("gpn_scale.export.convert:main", "convert a reference (paper) checkpoint to a native one"),
    "export": ("gpn_scale.export:main", "export a checkpoint to Hugging Face transformers, the paper's format or native"),
    "prep": ("data_prep.cli:main", "tokenize and pack text into MDS shards"),
    "train": ("gpn_scale.train.engine:main", "train with DeepSpeed ZeRO from MDS shards (resumable)"),
    "config": ("gpn_scale.train.config_view:main", "list the training config's keys: type, default and meaning"),
    "launch": ("gpn_scale.train.launch:main", "print and run the torchrun command for a training run"),
    "sweep": ("gpn_scale.sweep.cli:main", "scaling sweeps: size, run (local or SLURM), collect and fit"),
    "ckpt": ("gpn_scale.train.checkpoint_writer:main", "checkpoint tools: verify, to-universal"),
    "eval": ("gpn_scale.eval.cli:eval_main", "held-out perplexity (by position) and LAMBADA of a checkpoint"),
    "analyze": ("gpn_scale.eval.cli:analyze_main", "state geometry, horizons, memory half-lives and ablations"),
    "generate": ("gpn_scale.eval.cli:generate_main", "sample text from a checkpoint, streamed, O(1) memory"),
    "lm-eval": ("gpn_scale.eval.cli:lm_eval_main", "lm-evaluation-harness tasks on a checkpoint (model `gpn-scale`)"),
    "demo": ("gpn_scale.demo:main", "the README's main job on the embedded corpus"),
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("gpn-scale")
    except PackageNotFoundError:  # run from a checkout that was never pip-installed
        return "unknown (not installed)"


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: gpn-scale [--version] SUBCOMMAND [ARGS...]", "", "subcommands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`gpn-scale SUBCOMMAND --help` for a subcommand's arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"gpn-scale {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown subcommand {name!r}; expected one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    dumps_stacks = name == "train" and not faulthandler.is_enabled()
    if dumps_stacks:  # a rank that dies in native code (an abort in a library's C++) prints every thread's Python stack
        faulthandler.enable(all_threads=True)
    if name == "train":  # before torch and DeepSpeed import: a launcher may stop a trainer still starting up
        from gpn_scale.train import stop

        stop.record()
    try:
        module_name, func_name = COMMANDS[name][0].split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        return int(func(rest) or 0)
    except UserError as e:
        if not e.every_rank or os.environ.get("RANK", "0") == "0":  # under torchrun: once, not once per rank
            print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader stopped early (`| head`): the output ends there, without a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # for the interpreter's own flush at exit
        return 128 + 13  # as a shell reports a command that SIGPIPE ended
    finally:
        leases.release_all()  # the checkpoints the command read: rotation may remove them now
        if name == "train":
            stop.restore()  # run in-process (tests, notebooks): the caller's handlers back
        if dumps_stacks:
            faulthandler.disable()
