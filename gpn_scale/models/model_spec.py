"""What the training engine needs from a model family, declared by the family in its own file
(as torchtitan's model specs): its config and model classes, the parameters ZeRO-3 must gather
with the top-level module, and the optimiser's parameter groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch.nn as nn


class ParamGroups(NamedTuple):
    decay: list[nn.Parameter]  # weight decay applies
    no_decay: list[nn.Parameter]


@dataclass(frozen=True)
class ModelSpec:
    config_cls: type
    model_cls: type  # model_cls(config, initialise=True)
    # Parameters that the model's own forward reads outside its submodules' forward: ZeRO-3 gathers
    # a module's parameters around that module's forward only, so these are registered with the
    # top-level module.
    zero3_external_params: Callable[[nn.Module], list[nn.Parameter]]
    param_groups: Callable[[nn.Module], ParamGroups]
    # whether the state a window ends with can start the next window (train.carry_state): a recurrent
    # state of fixed size, not a cache that grows with the context
    carries_state: bool = True
    # torch.compile the model's forward in place, for a config with `compile: true`; None: the family
    # has no such key (GPN's fused core launches kernels of its own)
    compile_forward: Callable[[nn.Module], None] | None = None


def matrices_decay(model: nn.Module) -> ParamGroups:
    """Weight decay on matrices only; never on norms, biases, A_log or dt_bias (all 1-D)."""
    params = list(model.parameters())
    return ParamGroups([p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2])


def no_external_params(model: nn.Module) -> list[nn.Parameter]:
    """A layered model calls its layers, so ZeRO-3 gathers each layer on its own."""
    return []
