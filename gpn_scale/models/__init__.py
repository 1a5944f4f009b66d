"""Model zoo. Imports only torch (and numpy) and kernels/: benchmark machines have nothing else installed.

Every family takes `model(tokens, state=None, return_logits=False)` and returns a `ModelOutput`
whose `token_losses[b, t]` scores token t given the tokens before it (the first from an empty
context), so losses and perplexities compare across families. Each family's file declares its
`ModelSpec` (gpn_scale/models/model_spec.py): what the training engine needs from it.
"""

import torch

from gpn_scale.models import gdn, gpn, transformer
from gpn_scale.models.gdn import GatedDeltaNet, GDNConfig, GDNState
from gpn_scale.models.gpn import GPN, GPNConfig, GPNState, ModelOutput, StepHooks
from gpn_scale.models.model_spec import ModelSpec, ParamGroups
from gpn_scale.models.transformer import Transformer, TransformerConfig, TransformerState

MODEL_FAMILIES: dict[str, ModelSpec] = {"gpn": gpn.SPEC, "gpn_m": gpn.SPEC, "transformer": transformer.SPEC, "gdn": gdn.SPEC}
ModelConfig = GPNConfig | TransformerConfig | GDNConfig  # a family's config: what build_model builds


def build_model(config) -> torch.nn.Module:
    """A freshly initialised model for a config object (e.g. a `GPNConfig`)."""
    return MODEL_FAMILIES[config.family].model_cls(config)


def param_count(config) -> int:
    """Parameters of a config's model, without allocating them (the tied embedding counts once):
    built on the meta device, uninitialised (sizing sweeps build many models)."""
    with torch.device("meta"):
        return sum(p.numel() for p in MODEL_FAMILIES[config.family].model_cls(config, initialise=False).parameters())


__all__ = [
    "GPN", "GPNConfig", "GPNState", "GatedDeltaNet", "GDNConfig", "GDNState", "Transformer", "TransformerConfig",
    "TransformerState", "ModelOutput", "StepHooks", "MODEL_FAMILIES", "ModelConfig", "ModelSpec", "ParamGroups",
    "build_model", "param_count",
]
