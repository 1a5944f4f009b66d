"""YAML configs -> validated dataclasses. Unknown keys and wrong types are one-line errors.

Model configs are YAML files (see configs/models/) with a `family` key choosing the model class;
dotted overrides (`d_state=256`) are applied before validation.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import io
import math
import tokenize
import types
import typing
from pathlib import Path

import yaml

from data_prep.errors import UserError, read_text

# The bundled configs/ and launchers/: in a checkout the package's symlinks to the repository's
# own, in a wheel their copies, so a name like `gpn_m_tiny` resolves either way.
BUNDLE_ROOT = Path(__file__).resolve().parent
CONFIG_ROOT = (BUNDLE_ROOT / "configs").resolve()  # in a checkout: the repository's configs/, not the link


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = yaml.safe_load(read_text(path))
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of keys to values at the top level")
    return data


def _check_type(value, annotation, where: str):
    """Returns value (ints widened to float where a float is expected) or raises UserError."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_type(value, option, where)
            except UserError as e:
                errors.append((option, e))
        # the option the value's own kind belongs to (a list for a list, a mapping for a dataclass)
        # says what is wrong inside it; otherwise the first option's error
        matching = [e for option, e in errors if _same_kind(value, option)]
        raise (matching or [e for _, e in errors])[0]
    if dataclasses.is_dataclass(annotation):  # a nested section, e.g. a data source in a list
        if isinstance(value, annotation):  # built already (a section of TrainConfig, or its model's config)
            return value
        if not isinstance(value, dict):
            raise UserError(f"{where}: expected a mapping of {', '.join(sorted(dataclass_keys(annotation)))}, "
                            f"got {type(value).__name__} {value!r}")
        at, _, key = where.rpartition(": ")
        return build_dataclass(annotation, value, at, prefix=f"{key}.")
    if origin is typing.Literal:  # an enumerated key: its allowed values are listed
        options = typing.get_args(annotation)
        if not any(type(value) is type(option) and value == option for option in options):
            raise UserError(f"{where}: expected one of {', '.join(map(str, options))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(annotation)
        return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        number = yaml_number(value)  # YAML 1.1 reads 1e5 (no sign, no dot) as a string
        if number is not None:
            value = number
    if annotation in (int, float, str, bool) and not (
        isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
    ):
        raise UserError(f"{where}: expected {annotation.__name__}, got {type(value).__name__} {value!r}")
    if annotation is float and not math.isfinite(value):  # YAML's .nan / .inf: no setting means them
        raise UserError(f"{where}: expected a finite number, got {value!r}")
    return value


def _same_kind(value, annotation) -> bool:
    if isinstance(value, list):
        return typing.get_origin(annotation) is list
    if isinstance(value, dict):
        return dataclasses.is_dataclass(annotation)
    return False


def yaml_number(text: str) -> float | None:
    """`text` as a float if it spells one in scientific notation, else None."""
    try:
        return float(text) if text.strip().lower().lstrip("+-")[:1].isdigit() else None
    except ValueError:
        return None


OVERRIDE = "command-line override"  # what an error blames when a key=value argument is at fault


def unknown_key(where: str, key: str, known, prefix: str = "") -> UserError:
    """`WHERE: PREFIXkey: unknown key; did you mean PREFIXnearest? expected one of: ...`"""
    nearest = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f"did you mean {prefix}{nearest[0]}? " if nearest else ""
    return UserError(f"{where}: {prefix}{key}: unknown key; {hint}expected one of: {', '.join(sorted(known))}")


def dataclass_keys(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def field_meanings(cls) -> dict[str, str]:
    """What each field of dataclass `cls` means, from the comments of its declaration in the source:
    the comment ending its line, else the comment lines right above it ("" when it has neither).
    The comments stay the one place a key is explained, for readers of the code and of
    `gpn-scale config keys` alike."""
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}  # line number -> the comment's text
    code_lines: set[int] = set()
    quiet = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
        elif token.type not in quiet:
            code_lines.update(range(token.start[0], token.end[0] + 1))
    (class_def,) = [node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)]
    meanings = {}
    for node in class_def.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        above, line = [], node.lineno - 1
        while line in comments and line not in code_lines:
            above.insert(0, comments[line])
            line -= 1
        meanings[node.target.id] = " ".join(trailing or above)
    return meanings


@dataclasses.dataclass(frozen=True)
class KeyInfo:
    """One key of a config as `gpn-scale config keys` lists it."""

    key: str  # dotted: `train.lr`; a field of a list's items: `data.train[].path`
    type: str  # as a YAML writer sees it: `int | null`, `list[int]`; an enumerated key's allowed values: `a | b`
    allowed: tuple | None  # an enumerated key's values, else None
    default: object  # the value a config without the key has (YAML-ready: None, lists, scalars)
    required: bool  # no usable default: a config without the key is refused
    meaning: str


def type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(option) for option in typing.get_args(annotation))
    if origin is typing.Literal:
        return " | ".join(map(str, typing.get_args(annotation)))
    if origin is list:
        return f"list[{type_name(typing.get_args(annotation)[0])}]"
    if annotation is type(None):
        return "null"
    if dataclasses.is_dataclass(annotation) or annotation is dict:
        return "mapping"
    return annotation.__name__


def _allowed_values(annotation) -> tuple | None:
    """The values of an enumerated (Literal) key, also inside `X | None`."""
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            if _allowed_values(option):
                return _allowed_values(option)
    return None


def _list_item_dataclasses(annotation) -> list[type]:
    """The dataclasses a list of this type holds as items (also a union's list option)."""
    origin = typing.get_origin(annotation)
    if origin is list:
        (item,) = typing.get_args(annotation)
        return [item] if dataclasses.is_dataclass(item) else []
    if origin in (typing.Union, types.UnionType):
        return [cls for option in typing.get_args(annotation) for cls in _list_item_dataclasses(option)]
    return []


def describe_keys(cls, prefix: str = "", required: frozenset = frozenset()) -> list[KeyInfo]:
    """Every key of dataclass `cls` (spelled with `prefix`), in declaration order, from what
    `build_dataclass` validates against: the field's type, its default and its meaning (the comment
    on its declaration). A field holding a dataclass lists that one's keys under `field.`; one
    holding a list of them, under `field[].`, after the list itself. `required`: the dotted keys
    whose default a config must not keep."""
    hints = typing.get_type_hints(cls)
    meanings = field_meanings(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        annotation, key = hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(annotation):
            keys += describe_keys(annotation, f"{key}.", required)
            continue
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory() if has_default else None
        keys.append(KeyInfo(key, type_name(annotation), _allowed_values(annotation), default,
                            key in required or not has_default, meanings[f.name]))
        for item_cls in _list_item_dataclasses(annotation):
            keys += describe_keys(item_cls, f"{key}[].", required)
    return keys


def build_dataclass(cls, data: dict, where: str, prefix: str = "", overridden=frozenset(), override_prefix: str = ""):
    """Instantiate dataclass `cls` from `data`; errors read `WHERE: PREFIXkey: problem`. A key in
    `overridden` came from a key=value argument (spelled with `override_prefix`, e.g. `model.`): its
    errors blame the command-line override instead of `where`."""
    hints = typing.get_type_hints(cls)
    known = dataclass_keys(cls)

    def blame(key: str) -> tuple[str, str]:  # (what is at fault, how it spells the key's prefix)
        return (OVERRIDE, override_prefix + prefix) if key in overridden else (where, prefix)

    unknown = sorted(set(data) - known)
    if unknown:
        at, spelled = blame(unknown[0])
        raise unknown_key(at, unknown[0], known, spelled)
    values = {}
    for k, v in data.items():
        at, spelled = blame(k)
        values[k] = _check_type(v, hints[k], f"{at}: {spelled}{k}")
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:  # __post_init__ checks ("key: problem"), or a missing key
        at, spelled = blame(str(e).split(":", 1)[0])
        raise UserError(f"{at}: {spelled}{e}") from None


def parse_overrides(items: list[str]) -> dict:
    """`a.b=1 c=x` -> {"a": {"b": 1}, "c": "x"}; values are parsed as YAML scalars."""
    out: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"override {item!r}: expected dotted.key=value")
        node = out
        *parents, leaf = key.split(".")
        for depth, p in enumerate(parents):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise UserError(f"{OVERRIDE} {item!r}: {'.'.join(parents[:depth + 1])} is set to a value by another "
                                "override, not a mapping")
        if isinstance(node.get(leaf), dict):
            raise UserError(f"{OVERRIDE} {item!r}: {key} is a mapping that other overrides set fields of")
        try:
            node[leaf] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise UserError(f"override {item!r}: the value is not valid YAML ({str(e).splitlines()[0]})") from None
    return out


def merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for k, v in overrides.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


DEFAULT = "default"  # the origin of a value no layer set: its dataclass's default
OVERRIDDEN = "override"  # the origin of a value a key=value argument set


@dataclasses.dataclass
class Origins:
    """Where each value of a config merged from layers (a YAML file, then key=value overrides) came
    from: the last layer that set it, as `merge` lets the last one win. A value is a leaf of the
    layers' nested mappings (a list is one value: its origin is the whole list's); a key no layer set
    has its default."""

    by_key: dict[str, str] = dataclasses.field(default_factory=dict)  # dotted key -> a file's path or OVERRIDDEN

    def add(self, layer: dict, origin: str, prefix: str = "") -> None:
        """Records `layer`, set by `origin`, as merged over the layers added before it (its keys
        spelled with `prefix`, e.g. `model.`)."""
        for key, value in layer.items():
            dotted = prefix + key
            if isinstance(value, dict):  # merged into what is there, key by key
                self.by_key.pop(dotted, None)
                self.add(value, origin, f"{dotted}.")
            else:  # replaces what is there, all of a mapping's values included
                self.by_key = {k: v for k, v in self.by_key.items() if not k.startswith(f"{dotted}.")}
                self.by_key[dotted] = origin

    def of(self, key: str) -> str:
        return self.by_key.get(key, DEFAULT)


def resolve_config_path(path: str | Path, kind: str) -> Path:
    """A path as given, or a bare name looked up in configs/<kind>/ (`gpn_m_tiny` -> configs/models/gpn_m_tiny.yaml).
    A name found in neither place is refused in one line with the nearest bundled name
    (`did you mean gpn_m_tiny?`), or the bundled names when none is near."""
    p = Path(path)
    if p.exists():
        return p
    if p.parent != Path("."):  # a path with directories means that file, not a bundled one
        raise UserError(f"{path}: no such config file")
    candidate = CONFIG_ROOT / kind / (p.name if p.suffix else f"{p.name}.yaml")
    if candidate.exists():
        return candidate
    raise UserError(f"{path}: no such config file (nor {candidate}); {_nearest_bundled(p, kind)}")


def bundled_names(kind: str) -> list[str]:
    """The names of the bundled configs of a kind (`train`, `models`, `sweeps`): configs/<kind>/*.yaml."""
    return sorted(f.stem for f in (CONFIG_ROOT / kind).glob("*.yaml"))


def _nearest_bundled(name: Path, kind: str) -> str:
    names = bundled_names(kind)
    if not names:
        return f"no bundled configs in {CONFIG_ROOT / kind}"
    stem = name.stem if name.suffix in (".yaml", ".yml") else name.name
    nearest = difflib.get_close_matches(stem, names, n=1, cutoff=0.6)
    if nearest:
        return f"did you mean {nearest[0]}?"
    return f"the bundled {kind} configs are: {', '.join(names)}"


def model_config(source: str | Path | dict, overrides: dict | None = None, where: str | None = None,
                 override_prefix: str | None = None):
    """A validated model config object from a YAML path, a configs/models name, or a dict. With
    `override_prefix` (e.g. `model.`), `overrides` came from the command line, spelled with that prefix,
    and an unknown key among them is blamed on the override rather than on the file. A renamed key
    (the family config's RENAMED) is refused in one line naming its new name."""
    from gpn_scale.models import MODEL_FAMILIES

    if isinstance(source, dict):
        data, where = dict(source), where or "model"
    else:
        path = resolve_config_path(source, "models")
        data, where = read_yaml(path), where or str(path)
    data = merge(data, overrides or {})
    family = data.get("family")
    if family not in MODEL_FAMILIES:
        raise UserError(f"{where}: family: expected one of {', '.join(MODEL_FAMILIES)}, got {family!r}")
    config_cls = MODEL_FAMILIES[family].config_cls
    for key in sorted(data.keys() & _renamed(config_cls)):  # given by a user; a saved config's: saved_model_keys
        at, spelled = (OVERRIDE, override_prefix or "") if key in (overrides or {}) else (where, "")
        raise UserError(f"{at}: {spelled}{key}: renamed; use {spelled}{_renamed(config_cls)[key]}")
    overridden = frozenset(overrides or {}) if override_prefix is not None else frozenset()
    unknown = sorted(overridden - dataclass_keys(config_cls))
    if unknown:
        raise unknown_key(OVERRIDE, unknown[0], dataclass_keys(config_cls), override_prefix)
    return build_dataclass(config_cls, data, where, overridden=overridden, override_prefix=override_prefix or "")


def _renamed(config_cls) -> dict[str, str]:
    """A model family's renamed keys, old -> new (the config class's RENAMED; most families have none)."""
    return getattr(config_cls, "RENAMED", {})


def saved_model_keys(data: dict) -> dict:
    """A model config this system wrote (a checkpoint's trainer_state.json, a native model.yaml, a sweep's
    point.json) with its keys under their names now: one written before a key was renamed still loads,
    where a config a user gives with the old name is refused (model_config). Unknown families are left
    to model_config to refuse."""
    from gpn_scale.models import MODEL_FAMILIES

    family = data.get("family")
    spec = MODEL_FAMILIES.get(family) if isinstance(family, str) else None
    renamed = _renamed(spec.config_cls) if spec is not None else {}
    return {renamed.get(key, key): value for key, value in data.items()}
