"""Turn a config file plus command-line overrides into a recipe's job config, or refuse it."""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from pathlib import Path
from typing import Any, Callable

import yaml

from pan.config import loader
from pan.config.core import ConfigError, ErrorCollector, placeholder_in
from pan.config.loader import Entry, build_dataclass, field_types, parse_overrides
from pan.logging import get_logger
from pan.recipe import get_recipe, recipe_names

DEFAULT_RECIPE = "pan"
EXIT_CONFIG_ERROR = 2


def load_config_or_exit(argv: list[str], *, use_only: bool = False, under: Path | None = None):
    """Load a job config for a command; on a ConfigError print one paragraph (on the launch's first
    process only: torchrun's RANK) and exit with code 2. Warnings go to stderr the same way.
    `use_only` and `under`: see `load_job_config`."""
    main = os.environ.get("RANK", "0") == "0"
    try:
        return load_job_config(argv, warn=get_logger().warning if main else (lambda msg: None),
                               use_only=use_only, under=under)
    except ConfigError as e:
        if main:
            print(f"pan: config error: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)


def components(job_cls) -> dict[str, type]:
    """attribute name -> component dataclass of a job config class."""
    return {f.name: tp for f, tp in zip(dataclasses.fields(job_cls), field_types(job_cls).values())
            if dataclasses.is_dataclass(tp)}


def key_owners(job_cls) -> dict[str, str]:
    """key -> the component attribute that owns it. Keys must be unique across components."""
    owners: dict[str, str] = {}
    for attr, cls in components(job_cls).items():
        for name in field_types(cls):
            if name in owners:
                raise TypeError(f"config key {name!r} is defined by both {owners[name]} and {attr}")
            owners[name] = attr
    return owners


def nested_types(job_cls) -> dict[str, type]:
    """key -> dataclass, for keys whose value is itself a config (transformer_config_overrides)."""
    out = {}
    for cls in components(job_cls).values():
        for name, tp in field_types(cls).items():
            if dataclasses.is_dataclass(tp):
                out[name] = tp
    return out


def _recipe_of(entries: dict[str, list[Entry]], cli: list[tuple[str, Any]]) -> str:
    name = DEFAULT_RECIPE
    for entry in entries.get("recipe", []):
        name = entry.value
    for key, value in cli:
        if key == "recipe":
            name = value
    return name


def load_job_config(argv: list[str], *, warn: Callable[[str], None] = print, use_only: bool = False,
                    under: Path | None = None, problems: ErrorCollector | None = None):
    """Parse `--config X.yaml --key value ...` into the recipe's job config (validated).

    `use_only`: the config of a trained model to be used (sampled, exported, inspected), not trained:
    the components a run needs only to train (`TRAINING_ONLY`: data, output folder, optimizer,
    parallel layout, ...) are read and typed but not checked, so a run whose training data or
    output folder is gone still samples; everything the model, its encoders and its sampler read
    is checked as for training.

    `under`: a config whose keys the `--config` file's override key by key (an exported model's own
    config, pan/export.py), or the whole config when argv names none.

    `problems`: where the failures of the cross-key rules go instead of being raised, the job being
    returned all the same (a job of typed keys, some of whose rules fail): for a caller that judges
    more of it than the loader does (`pan launch-command`'s layout), to report every problem at once.
    A config whose keys cannot be read or typed still raises."""
    config_path, cli = parse_overrides(argv)
    if config_path is None and under is None:
        raise ConfigError("config", "no config file given: pass --config config/<run>.yaml "
                                    "(for example config/demo_cpu.yaml).")
    files = [Path(p) for p in (under, config_path) if p is not None]
    # The recipe decides which keys exist, so find it before reading the files' sections.
    probes = [probe for probe in map(_probe_recipe, files) if probe]
    recipe_name = _recipe_of({"recipe": [Entry(probes[-1], "")]} if probes else {}, cli)
    if recipe_name not in recipe_names():
        raise ConfigError("recipe", f"unknown recipe {recipe_name!r}; known: {', '.join(recipe_names())}.")
    job_cls = get_recipe(recipe_name).job_config
    known = set(key_owners(job_cls)) | set(loader.TOP_LEVEL_KEYS)
    entries = loader.yaml_entries(files[0], known)
    for override in files[1:]:
        entries = layered(entries, loader.yaml_entries(override, known), nested_types(job_cls))
    return build_job(job_cls, entries, cli, warn=warn, use_only=use_only, rules=problems)


def layered(base: dict[str, list[Entry]], top: dict[str, list[Entry]], nested: dict[str, type]) -> dict[str, list[Entry]]:
    """`base`'s entries with `top`'s on them, key by key (a nested config's keys one by one)."""
    out = dict(base)
    for key, entries in top.items():
        below = base.get(key)
        if key in nested and below and isinstance(below[-1].value, dict) and isinstance(entries[-1].value, dict):
            merged = {**below[-1].value, **entries[-1].value}
            out[key] = [dataclasses.replace(entries[-1], value=merged)]
        else:
            out[key] = entries
    return out


def _probe_recipe(path: Path) -> str | None:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None  # reported properly when the file is read for real
    if not isinstance(data, dict):
        return None
    if "recipe" in data:
        return data["recipe"]
    for value in data.values():
        if isinstance(value, dict) and "recipe" in value:
            return value["recipe"]
    return None


def build_job(job_cls, entries: dict[str, list[Entry]], cli: list[tuple[str, Any]],
              *, warn: Callable[[str], None] = print, use_only: bool = False,
              rules: ErrorCollector | None = None):
    """The job of the entries and overrides, checked; `rules`: see `load_job_config`'s `problems`."""
    owners = key_owners(job_cls)
    nested = nested_types(job_cls)
    comps = components(job_cls)
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    problems = ErrorCollector()  # independent problems are reported together

    for key, found in entries.items():
        if key in loader.TOP_LEVEL_KEYS:
            continue
        first = found[0]
        if key not in owners:
            err = ConfigError(key, _unknown_message(key, owners, nested))
            err.location = first.where
            problems.add(err)
        elif len(found) > 1:
            places = " and ".join(f"section `{e.section or '(top level)'}` ({e.where})" for e in found)
            problems.add(ConfigError(key, f"is set twice, in {places}. Section names only group keys: "
                                          "keep one of them."))
        else:
            values[key] = first.value
            where[key] = first.where

    for key, value in cli:
        if key in loader.TOP_LEVEL_KEYS:
            continue
        with problems.gather():
            _apply_override(key, value, values, where, owners, nested)

    built = {}
    for attr, cls in comps.items():
        with problems.gather(lambda e: _located(e, where)):
            built[attr] = _build_component(cls, {k: v for k, v in values.items() if owners[k] == attr},
                                           nested, owners, warn, where)
    problems.raise_any()

    job = job_cls(**built)
    job.recipe = _recipe_of(entries, cli)
    job.explicit_keys = _changed_keys(job, values, owners)
    if rules is None:
        run_checks(job, where, use_only=use_only)
    else:
        with rules.gather():
            run_checks(job, where, use_only=use_only)
    return job


def _apply_override(key: str, value: Any, values: dict[str, Any], where: dict[str, str],
                    owners: dict[str, str], nested: dict[str, type]) -> None:
    """Apply one `--key value` (or `--nested.key value`) on top of the file's values."""
    head, dot, rest = key.partition(".")
    if head not in owners:
        raise ConfigError(key, "(command line) " + _unknown_message(head, owners, nested))
    if dot:
        if head not in nested:
            raise ConfigError(key, f"`{head}` is not a nested config; pass --{head} <value>.")
        current = dict(values.get(head) or {})
        current[rest] = value
        values[head] = current
    elif head in nested and isinstance(value, dict):
        merged = dict(values.get(head) or {})
        merged.update(value)
        values[head] = merged
    else:
        values[head] = value
    where[head] = "command line"


def _build_component(cls, mine: dict[str, Any], nested, owners, warn, where):
    """One component dataclass from its keys' values (nested configs built first)."""
    problems = ErrorCollector()
    nested_here = {}
    for k in list(mine):
        if k in nested:
            sub = mine.pop(k)
            if sub is None:
                sub = {}
            if not isinstance(sub, dict):
                problems.add(_located(ConfigError(k, f"must be a mapping of {nested[k].__name__} keys, "
                                                     f"got {sub!r}."), where))
                continue
            with problems.gather():
                nested_here[k] = _build_nested(k, nested[k], sub, owners, warn, where)
    with problems.gather(lambda e: _located(e, where)):
        component = build_dataclass(cls, mine)
    problems.raise_any()
    for k, v in nested_here.items():
        setattr(component, k, v)
    return component


def _changed_keys(job, values: dict[str, Any], owners: dict[str, str]) -> set[str]:
    """Keys the user set to something other than their default. Rules such as "this key has no
    effect in this mode" use it, so a resolved config.yaml (which spells out every default) loads."""
    changed = set()
    for key in values:
        component = getattr(job, owners[key])
        f = next(f for f in dataclasses.fields(component) if f.name == key)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if getattr(component, key) != default:
            changed.add(key)
    return changed


def _build_nested(key, cls, sub, owners, warn, where):
    legacy = getattr(cls, "LEGACY_NAMES", {})
    problems = ErrorCollector()
    for name in sub:
        if name in owners and name not in field_types(cls):
            problems.add(_located(ConfigError(f"{key}.{name}", f"`{name}` is a top-level key, not part "
                                              f"of `{key}`: move it out of `{key}` (set it once, beside "
                                              f"`{key}`)."), where, key))
    problems.raise_any()  # (each would also be reported as an unknown key below)
    with problems.gather(lambda e: _located(e, where, key)):
        built = build_dataclass(cls, sub, prefix=f"{key}.", legacy=legacy, warn=warn)
    problems.raise_any()
    return built


def _located(err: ConfigError, where: dict[str, str], key: str | None = None) -> ConfigError:
    if err.location is None:
        err.location = where.get(key or (err.key or "").split(".")[0])
    return err


def run_checks(job, where: dict[str, str] | None = None, *, use_only: bool = False) -> None:
    """Run every component's cross-key `check(job)` (and a nested config's own `check()`); the
    failures of different components are reported together. `use_only`: not those of the
    components only training reads (`TRAINING_ONLY`)."""
    problems = ErrorCollector()
    locate = lambda e: _located(e, where or {})  # noqa: E731
    placeholders = refuse_placeholders(job, problems, locate, use_only=use_only)
    said = list(problems.errors)
    for attr in checked_components(job, use_only):
        component = getattr(job, attr)
        for value in vars(component).values():
            if dataclasses.is_dataclass(value) and hasattr(value, "check"):
                with problems.gather(locate):
                    value.check(job)
        if hasattr(component, "check"):
            with problems.gather(locate):
                component.check(job)
    # A placeholder path is the problem of every rule that tried to read it: said once, as a placeholder.
    problems.errors = said + [e for e in problems.errors[len(said):] if e.key not in placeholders
                              and not any(value in e.message for value in placeholders.values())]
    problems.raise_any()


def checked_components(job, use_only: bool) -> list[str]:
    """The components whose rules apply: all of them, or for a model's use not those only training reads."""
    return [attr for attr, cls in components(type(job)).items()
            if not (use_only and getattr(cls, "TRAINING_ONLY", False))]


def is_path_key(name: str) -> bool:
    return name.endswith(("_path", "_paths", "_dir", "_ckpt", "_checkpoint"))


def path_keys(job, use_only: bool = False) -> dict[str, object]:
    """Every key naming a path (`*_path`, `*_paths`, `*_dir`, `*_ckpt`, `*_checkpoint`) -> its value."""
    found = {}
    for attr in checked_components(job, use_only):
        component = getattr(job, attr)
        for f in dataclasses.fields(component):
            if is_path_key(f.name):
                found[f.name] = getattr(component, f.name)
    return found


def refuse_placeholders(job, problems: ErrorCollector, locate, *, use_only: bool = False) -> dict[str, str]:
    """A template placeholder left in a path key (`/path/to/...`, `/PATH/...`, `<...>`) is refused
    as such, for every recipe; returns key -> the placeholder found."""
    found = {}
    for key, value in path_keys(job, use_only).items():
        left = placeholder_in(value)
        if left is not None:
            found[key] = left
            problems.add(locate(ConfigError(key, f"is still the template's placeholder {left}, a placeholder "
                                                 "you must replace.",
                                            fix=f"set {key} to your own path (in the YAML, or --{key} <path>).")))
    return found


def _unknown_message(key: str, owners: dict[str, str], nested: dict[str, type]) -> str:
    for parent, cls in nested.items():
        names = set(field_types(cls)) | set(getattr(cls, "LEGACY_NAMES", {}))
        if key in names:
            return (f"is an architecture key: put it inside `{parent}` "
                    f"(for example `{parent}: {{{key}: ...}}` or --{parent}.{key} <value>).")
    close = difflib.get_close_matches(key, list(owners), n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join('`' + c + '`' for c in close)}?" if close else ""
    return f"unknown key.{hint} Every key is listed in docs/config.md."


# ----------------------------------------------------------------------------------------------
# The resolved config, written to output_dir/config.yaml
# ----------------------------------------------------------------------------------------------

def job_to_sections(job, use_only: bool = False) -> dict[str, Any]:
    """The fully resolved config as {section: {key: value}}, ready for YAML; `use_only`: without the
    paths of the components only training reads (data, output folder, warm start: what an exported
    model carries, pan/export.py; their other keys stay, as rules of the model's keys read them)."""
    out: dict[str, Any] = {"recipe": job.recipe}
    for attr, cls in components(type(job)).items():
        section = out.setdefault(cls.SECTION, {})
        component = getattr(job, attr)
        training_only = use_only and getattr(cls, "TRAINING_ONLY", False)
        for f in dataclasses.fields(cls):
            if training_only and is_path_key(f.name):
                continue
            value = getattr(component, f.name)
            section[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return out


def dump_job(job) -> str:
    return dump_sections(job_to_sections(job))


def dump_sections(sections: dict[str, Any]) -> str:
    """A run's config.yaml from its resolved sections (`job_to_sections`)."""
    header = ("# Resolved by pan: every key with the value this run used (file, overrides and\n"
              "# renamed keys applied). Reproduce the run with: train.py --config <this file>\n")
    return header + yaml.safe_dump(sections, sort_keys=False, default_flow_style=None, width=100)
