"""A real DeepSpeed engine in the test process: one gloo rank, the tiny GPN+M, the trainer's
optimiser, schedule and DeepSpeed config."""

import os

import pytest
import torch

from gpn_scale.config import model_config
from gpn_scale.models import MODEL_FAMILIES, build_model
from gpn_scale.train import optim
from gpn_scale.train.config import load_train_config
from gpn_scale.train.engine import deepspeed_config


def train_config(*overrides):
    return load_train_config("gpn_m_tiny", ["run.dir=unused", "data.train=unused", *overrides])


@pytest.fixture(scope="module")
def one_rank():
    """The process group `gpn-scale train` makes without a launcher, in this process; the
    environment variables it sets are restored afterwards (subprocess tests inherit them)."""
    import deepspeed  # noqa: F401  (the accelerator is chosen on import)

    from gpn_scale.train import distributed

    saved = dict(os.environ)
    distributed.init()
    yield distributed.device()
    torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def tiny_engine(device, *overrides, grad_accum=1, universal=False):
    """A DeepSpeed engine over the tiny GPN+M with the trainer's optimiser, schedule and config,
    and what AdamW receives at each call (a step pre-hook): the squared norm of its gradients and
    its learning rate. ZeRO 1-2 call it once per parameter group, each holding one flat partition."""
    import deepspeed

    cfg = train_config(*overrides)
    torch.manual_seed(0)
    model = build_model(model_config(cfg.model)).to(device)
    optimizer, scheduler = optim.build(MODEL_FAMILIES[model.config.family].param_groups(model), cfg.train)
    seen = []

    def record(opt, args, kwargs):
        grads = [p.grad.double().flatten() for g in opt.param_groups for p in g["params"] if p.grad is not None]
        seen.append((float(torch.linalg.vector_norm(torch.cat(grads))) ** 2, opt.param_groups[0]["lr"]))

    optimizer.register_step_pre_hook(record)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                      config=deepspeed_config(cfg, grad_accum, universal=universal))
    return engine, seen
