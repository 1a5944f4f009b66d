"""Model zoo. Imports only torch (and numpy): benchmark machines have nothing else installed.

Every family takes `model(tokens, state=None, return_logits=False)` and returns a `ModelOutput`
whose `token_losses[b, t]` scores token t given the tokens before it (the first from an empty
context), so losses and perplexities compare across families.
"""

import contextlib

import torch

from gpn_scale.models.gdn import GatedDeltaNet, GDNConfig, GDNState
from gpn_scale.models.gpn import GPN, GPNConfig, GPNState, ModelOutput, StepHooks
from gpn_scale.models.transformer import Transformer, TransformerConfig, TransformerState

MODEL_FAMILIES = {
    "gpn": (GPNConfig, GPN),
    "gpn_m": (GPNConfig, GPN),
    "transformer": (TransformerConfig, Transformer),
    "gdn": (GDNConfig, GatedDeltaNet),
}


def build_model(config) -> torch.nn.Module:
    """A freshly initialised model for a config object (e.g. a `GPNConfig`)."""
    _, model_cls = MODEL_FAMILIES[config.family]
    return model_cls(config)


_INITIALISERS = ("normal_", "trunc_normal_", "uniform_", "zeros_", "ones_", "constant_", "xavier_uniform_",
                 "xavier_normal_", "kaiming_uniform_", "kaiming_normal_")


@contextlib.contextmanager
def _initialisers_skipped():
    """Initialisers as no-ops: on the meta device they only cost time (sizing sweeps build many models)."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITIALISERS}
    try:
        for name in _INITIALISERS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def param_count(config) -> int:
    """Parameters of a config's model, without allocating them (the tied embedding counts once)."""
    with torch.device("meta"), _initialisers_skipped():
        return sum(p.numel() for p in build_model(config).parameters())


__all__ = [
    "GPN", "GPNConfig", "GPNState", "GatedDeltaNet", "GDNConfig", "GDNState", "Transformer", "TransformerConfig",
    "TransformerState", "ModelOutput", "StepHooks", "MODEL_FAMILIES", "build_model", "param_count",
]
