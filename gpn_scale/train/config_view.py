"""The training config as users look at it: `gpn-scale config keys [SECTION]` lists every key with
its type, default and meaning, and `gpn-scale train CONFIG ... --print-config` prints a resolved
config with the origin of each value.

Both read what the validator reads: the dataclasses of gpn_scale/train/config.py and the model
families' config classes, whose declarations' comments say what each key means (gpn_scale/config.py:
describe_keys).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import textwrap

import yaml

from gpn_scale.config import OVERRIDDEN, KeyInfo, Origins, describe_keys, unknown_key
from data_prep.errors import UserError
from data_prep.helptext import HelpFormatter
from gpn_scale.train.config import REQUIRED, ResolvedConfig, TrainConfig


def training_keys() -> list[KeyInfo]:
    """Every key of a training YAML; the model's own keys are model_keys(family)'s."""
    keys = describe_keys(TrainConfig, required=frozenset(REQUIRED))
    # A YAML gives the model as a name, a path or a mapping; the dataclass holds the mapping it resolves to.
    return [dataclasses.replace(k, type="str | mapping") if k.key == "model" else k for k in keys]


def model_keys(family: str) -> list[KeyInfo]:
    """The keys of a model config of `family`, spelled `model.KEY` as a training config's overrides spell them."""
    from gpn_scale.models import MODEL_FAMILIES

    # model_config refuses a config without a family before the rest is checked: it has no default
    return describe_keys(MODEL_FAMILIES[family].config_cls, "model.", required=frozenset({"model.family"}))


def keys_in(section: str | None) -> list[KeyInfo]:
    """The keys `gpn-scale config keys SECTION` lists: all of a training config's (no SECTION), those
    under a section or one key (`train`, `train.lr`), or a model family's (`model.gpn_m`)."""
    from gpn_scale.models import MODEL_FAMILIES

    if section is None:
        return training_keys()
    families = [f"model.{family}" for family in MODEL_FAMILIES]
    if section.startswith("model."):
        if section not in families:
            raise unknown_key("config keys", section, families)
        return model_keys(section.removeprefix("model."))
    keys = training_keys()
    chosen = [k for k in keys if k.key == section or k.key.startswith((f"{section}.", f"{section}[]."))]
    if not chosen:
        tops = sorted({k.key.split(".")[0] for k in keys})
        nearest = ([k.key for k in keys if k.key.rsplit(".", 1)[-1] == section]  # a key without its section
                   or difflib.get_close_matches(section, [k.key for k in keys] + tops + families, n=1, cutoff=0.6))
        hint = f"did you mean {nearest[0]}? " if nearest else ""
        raise UserError(f"config keys: {section}: no such key or section; {hint}expected a section or a key "
                        f"({', '.join(tops)}, or one of their keys: train.lr), or {' / '.join(families)}")
    return chosen


def yaml_flow(value) -> str:
    """`value` as YAML on one line (`0.0006`, `null`, `[2, 4]`, `{path: d, proportion: 0.5}`)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf, sort_keys=False).rstrip("\n")
    return text.removesuffix("\n...")  # the end-of-document mark YAML puts after a lone scalar


def keys_text(keys: list[KeyInfo]) -> str:
    """Each key as `key: type = default` (or `(required)`), its meaning indented below."""
    out = []
    for k in keys:
        out.append(f"{k.key}: {k.type}" + (" (required)" if k.required else f" = {yaml_flow(k.default)}"))
        out.append(textwrap.fill(k.meaning, width=100, initial_indent="    ", subsequent_indent="    "))
    return "\n".join(out)


def config_text(resolved: ResolvedConfig) -> str:
    """The resolved config as YAML, every value followed by `# ORIGIN`: the YAML file that set it,
    `override`, or `default`; the model's mapping headed by where its name or path was given."""
    named = resolved.model_named_in
    headers = {} if named is None else {"model": "chosen by override" if named == OVERRIDDEN else f"chosen in {named}"}
    return "\n".join(_commented_yaml(resolved.config.to_dict(), resolved.origins, headers))


def _commented_yaml(mapping: dict, origins: Origins, headers: dict[str, str], prefix: str = "",
                    indent: str = "") -> list[str]:
    """`mapping`'s lines, its values' origins lined up in one column per mapping; a list is one value."""
    values = {k: f"{indent}{k}: {yaml_flow(v)}" for k, v in mapping.items() if not (isinstance(v, dict) and v)}
    width = max(map(len, values.values()), default=0)
    lines = []
    for key, value in mapping.items():
        dotted = prefix + key
        if key in values:
            lines.append(f"{values[key]:<{width}}  # {origins.of(dotted)}")
            continue
        lines.append(f"{indent}{key}:" + (f"  # {headers[dotted]}" if dotted in headers else ""))
        lines += _commented_yaml(value, origins, headers, f"{dotted}.", indent + "  ")
    return lines


def config_json(resolved: ResolvedConfig) -> dict:
    """--print-config --json: the resolved config, every value's origin by its dotted key, and where
    the model's name or path was given (null for an inline mapping)."""
    config = resolved.config.to_dict()
    return {"config": config, "origins": {key: resolved.origins.of(key) for key in _value_keys(config)},
            "model_chosen_in": resolved.model_named_in}


def _value_keys(mapping: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in mapping.items():
        keys += _value_keys(value, f"{prefix}{key}.") if isinstance(value, dict) and value else [prefix + key]
    return keys


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, prog="gpn-scale config",
                                 description="The training config's keys.")
    sub = ap.add_subparsers(dest="verb", required=True)
    keys = sub.add_parser("keys", formatter_class=HelpFormatter,
                          help="list the training config's keys: type, default (or required) and meaning",
                          description="Every key a training YAML (or a key=value override) may set, from the "
                                      "dataclasses the config is validated against. The model's keys depend on "
                                      "its family: `gpn-scale config keys model.FAMILY`.")
    keys.add_argument("section", nargs="?",
                      help="only these keys: a section (train), one key (train.lr), or a model family's keys "
                           "(model.gpn_m, model.gpn, model.transformer, model.gdn)")
    keys.add_argument("--json", action="store_true",
                      help="print a JSON list of {key, type, allowed, default, required, meaning}, alone on stdout")
    args = ap.parse_args(argv)
    listed = keys_in(args.section)
    print(json.dumps([dataclasses.asdict(k) for k in listed], indent=1) if args.json else keys_text(listed))
    return 0


def print_config(resolved: ResolvedConfig, as_json: bool) -> None:
    """`gpn-scale train ... --print-config [--json]`: what it prints is the whole of stdout."""
    print(json.dumps(config_json(resolved), indent=1) if as_json else config_text(resolved))
