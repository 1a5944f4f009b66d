"""A checkpoint opened for inference, shared by the eval CLI and the lm-evaluation-harness model:
the device `--device` names checked, the model loaded, and what to ask for where a checkpoint
records no tokenizer."""

from __future__ import annotations

from pathlib import Path

from data_prep.errors import UserError

DATA_OR_TOKENIZER = "--tokenizer FILE or --data PREP_DIR"  # where no tokenizer is recorded with a checkpoint


def check_device(name: str):
    """The torch device `--device` names, once a tensor could be made there (a CUDA device on a
    machine without one, or past the last GPU, is one line here, not a traceback at the first load)."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device: {name!r} is not a torch device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA GPU is available here (torch.cuda.is_available() is false); "
                        "use --device cpu")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:  # no such GPU index, a backend this torch lacks
        raise UserError(f"--device {name}: not usable here ({str(e).splitlines()[0][:160]})") from None
    return device


def load_checkpoint(path: str, device: str = "cpu"):
    from gpn_scale.storage.checkpoints import load_model

    if not Path(path).exists():
        raise UserError(f"{path}: no such checkpoint")
    return load_model(path, check_device(device))
