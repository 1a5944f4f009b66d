"""Model zoo. Imports only torch (and numpy): benchmark machines have nothing else installed."""

from gpn_scale.models.gpn import GPN, GPNConfig, GPNState, ModelOutput, StepHooks

MODEL_FAMILIES = {"gpn": (GPNConfig, GPN), "gpn_m": (GPNConfig, GPN)}


def build_model(config) -> "GPN":
    """A freshly initialised model for a config object (e.g. a `GPNConfig`)."""
    _, model_cls = MODEL_FAMILIES[config.family]
    return model_cls(config)


__all__ = ["GPN", "GPNConfig", "GPNState", "ModelOutput", "StepHooks", "MODEL_FAMILIES", "build_model"]
