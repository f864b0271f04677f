"""Load a run config: a YAML of free-form sections, then `--key value` overrides on top.

Section names only group keys; every key belongs to exactly one component dataclass of the recipe's
job config. Everything the loader can know is checked here, before any model, data or process group
exists: unknown keys, types, bounds, choices, and each component's cross-key `check`.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from pan.config.core import ConfigError, ErrorCollector, check_bounds

TOP_LEVEL_KEYS = ("recipe",)  # keys that live outside every component


# ----------------------------------------------------------------------------------------------
# Reading YAML with line numbers
# ----------------------------------------------------------------------------------------------

@dataclass
class Entry:
    """One key as the user wrote it: its raw value and where it came from."""
    value: Any
    where: str                   # "config/x.yaml:12" or "command line"
    section: str | None = None   # the YAML section it sat in (None: top level or command line)


def yaml_entries(path: Path, known_keys: set[str]) -> dict[str, list[Entry]]:
    """Flatten a config file into key -> entries (a key may appear in several sections: an error later).

    A top-level mapping is a section unless its name is a key (`transformer_config_overrides`).
    """
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (an editor's "UTF-8 with BOM") is none of it
    except OSError as e:
        raise ConfigError("config", f"cannot read config file {path}: {e.strerror}.") from None
    except UnicodeDecodeError as e:
        raise ConfigError("config", f"{path} is not a UTF-8 text file ({e.reason} at byte {e.start}): give a "
                                    "YAML run config.") from None
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        raise ConfigError("config", f"{path} is not valid YAML: {e}") from None
    out: dict[str, list[Entry]] = {}
    if root is None:
        return out
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError("config", f"{path} must be a mapping of sections (or keys) at the top level.")
    loader = yaml.SafeLoader("")
    for key_node, value_node in root.value:
        name = key_node.value
        where = f"{path}:{key_node.start_mark.line + 1}"
        if isinstance(value_node, yaml.MappingNode) and name not in known_keys:
            for sub_key, sub_value in value_node.value:
                out.setdefault(sub_key.value, []).append(
                    Entry(loader.construct_object(sub_value, deep=True),
                          f"{path}:{sub_key.start_mark.line + 1}", section=name))
        else:
            out.setdefault(name, []).append(Entry(loader.construct_object(value_node, deep=True), where))
    return out


# ----------------------------------------------------------------------------------------------
# Command-line overrides
# ----------------------------------------------------------------------------------------------

def parse_overrides(argv: list[str]) -> tuple[str | None, list[tuple[str, Any]]]:
    """Split `--config X --key value --a.b value --flag` into the config path and (key, value) pairs.

    Values are read as YAML (so `[16, 56, 56]`, `null`, `true` and JSON objects work); a bare
    `--key` followed by another option or nothing means `true`.
    """
    config_path = None
    pairs: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(None, f"unexpected argument {arg!r}: options look like --key value "
                                    "(or --key=value).")
        name, eq, raw = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                raw = argv[i + 1]
                i += 1
            else:
                raw = "true"
        i += 1
        name = name.replace("-", "_")
        if name == "config":
            config_path = raw
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        pairs.append((name, value))
    return config_path, pairs


# ----------------------------------------------------------------------------------------------
# Type coercion
# ----------------------------------------------------------------------------------------------

def _type_name(tp) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (types.UnionType, typing.Union):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if get_origin(tp) is list:
        return f"list[{_type_name(get_args(tp)[0])}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def coerce(key: str, value: Any, tp) -> Any:
    """Return `value` converted to annotation `tp`, or raise ConfigError naming the key."""
    origin = get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(key, value, option)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(key, f"expected {_type_name(tp)}, got {value!r}.")
    if origin is Literal:
        choices = get_args(tp)
        if value in choices and not (isinstance(value, bool) and not any(isinstance(c, bool) for c in choices)):
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(key, f"{value!r} is not one of {', '.join(repr(c) for c in choices)}.{hint}")
    if origin is list:
        (inner,) = get_args(tp)
        if isinstance(value, tuple):
            value = list(value)
        if isinstance(value, str) and "," in value:
            value = [yaml.safe_load(v.strip()) for v in value.split(",")]
        if not isinstance(value, list):
            value = [value] if value is not None and not isinstance(value, dict) else value
            if not isinstance(value, list):
                raise ConfigError(key, f"expected a list of {_type_name(inner)}, got {value!r}.")
        return [coerce(key, v, inner) for v in value]
    if dataclasses.is_dataclass(tp):
        raise ConfigError(key, f"expected a mapping of {tp.__name__} keys, got {value!r}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off"):
            return value.lower() in ("true", "yes", "on")
        raise ConfigError(key, f"expected true or false, got {value!r}.")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value)
                if f.is_integer():
                    return int(f)
            except ValueError:
                pass
        raise ConfigError(key, f"expected an integer, got {value!r}.")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads `1e-5` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(key, f"expected a number, got {value!r}.")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(key, f"expected a string, got {value!r}.")
    if tp is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(key, f"expected a mapping, got {value!r}.")
    raise TypeError(f"config key {key}: unsupported annotation {tp!r}")


def field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def build_dataclass(cls, values: dict[str, Any], prefix: str = "", legacy: dict[str, str] | None = None,
                    warn=None):
    """Construct `cls` from a plain mapping, checking names, types and bounds of every key."""
    legacy = legacy or {}
    types_ = field_types(cls)
    values = dict(values)
    for old, new in legacy.items():
        if old in values:
            if new in values:
                raise ConfigError(prefix + old, f"is the old name of `{new}`, and both are set: keep "
                                                f"only `{new}`.")
            if warn:
                warn(f"`{prefix}{old}` is an old key name; it was read as `{prefix}{new}`. Rename it "
                     "in your config.")
            values[new] = values.pop(old)
    kwargs = {}
    problems = ErrorCollector()
    for name, raw in values.items():
        with problems.gather():
            if name not in types_:
                raise ConfigError(prefix + name, unknown_key_message(name, list(types_), f"{cls.__name__}"))
            kwargs[name] = coerce(prefix + name, raw, types_[name])
    for f in dataclasses.fields(cls):
        if f.name in kwargs:
            with problems.gather():
                check_bounds(prefix + f.name, kwargs[f.name], f.metadata)
    problems.raise_any()
    return cls(**kwargs)


def unknown_key_message(name: str, known: list[str], where: str) -> str:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join('`' + c + '`' for c in close)}?" if close else ""
    return f"unknown key for {where}.{hint} See docs/config.md for every key."
