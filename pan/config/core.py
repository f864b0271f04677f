"""The pieces every component config is made of: `knob` fields, `ConfigError`, and checks.

A component owns a kw-only dataclass of its keys, beside the code that reads them:

    @dataclass(kw_only=True)
    class FlowConfig:
        SECTION: ClassVar[str] = "diffusion"    # where the key is listed in docs and config.yaml
        flow_snr_type: Literal["uniform", "lognorm"] = knob("lognorm", "how timesteps are drawn")
        flow_lognorm_scale: float = knob(1.0, "std of the logit-normal", gt=0)

        def check(self, job) -> None:           # optional: cross-key rules, raise ConfigError
            ...

Types, `Literal` choices and the numeric bounds given to `knob` are enforced by the loader; `check`
holds the rules that need more than one key. Keys are globally unique across components: section
names in YAML files only group them.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from contextlib import contextmanager
from typing import Any, Callable


class ConfigError(Exception):
    """A config the trainer refuses. `key` names the offending key; the message says what is wrong
    and how to fix it (`fix` may give the fix apart; `split_fix` finds it in the message otherwise)."""

    def __init__(self, key: str | None, message: str, fix: str | None = None):
        self.key = key
        self.message = message
        self.fix = fix
        self.location: str | None = None  # "file.yaml:12", filled in by the loader when known
        super().__init__(message)

    def problems(self) -> list[ConfigError]:
        """The independent problems it stands for (one, or a ConfigErrors' list)."""
        return [self]

    def __str__(self) -> str:
        where = f" ({self.location})" if self.location else ""
        head = f"`{self.key}`{where}: " if self.key else ""
        return head + self.message


class ConfigErrors(ConfigError):
    """Several independent problems of one config, all reported at once: a run refused for one key
    should not be refused again, one launch later, for the next."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = errors
        super().__init__(errors[0].key, errors[0].message)
        self.location = errors[0].location

    def __str__(self) -> str:
        return f"{len(self.errors)} problems:\n" + "\n".join(f"  - {e}" for e in self.errors)

    def problems(self) -> list[ConfigError]:
        return list(self.errors)


class ErrorCollector:
    """Gathers ConfigErrors from independent checks; `raise_any` raises them together."""

    def __init__(self):
        self.errors: list[ConfigError] = []

    def add(self, error: ConfigError) -> None:
        self.errors.append(error)

    @contextmanager
    def gather(self, locate: Callable[[ConfigError], ConfigError] = lambda e: e):
        try:
            yield
        except ConfigErrors as e:
            self.errors.extend(locate(x) for x in e.errors)
        except ConfigError as e:
            self.errors.append(locate(e))

    def unique(self) -> list[ConfigError]:
        """The problems gathered, the same problem reached by two rules (one source of the message,
        two callers) once."""
        return list({(e.key, e.message): e for e in reversed(self.errors)}.values())[::-1]

    def raise_any(self) -> None:
        errors = self.unique()
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ConfigErrors(errors)


def knob(default: Any, help: str, *, ge=None, gt=None, le=None, lt=None, length: int | None = None,
         non_empty: bool = False):
    """A config key: its default, a one-line meaning (shown in docs/config.md) and optional bounds.

    Bounds apply to numbers and to every element of a list of numbers. `length` fixes a list's
    length; `non_empty` rejects "" and [].
    """
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "length": length,
            "non_empty": non_empty}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def check_bounds(key: str, value: Any, meta: dict) -> None:
    """Raise ConfigError if `value` breaks the bounds declared with `knob`."""
    if value is None:
        return
    if meta.get("non_empty") and value in ("", []):
        raise ConfigError(key, "must not be empty.")
    if meta.get("length") is not None and isinstance(value, list) and len(value) != meta["length"]:
        raise ConfigError(key, f"needs exactly {meta['length']} values, got {len(value)}: {value}.")
    items = value if isinstance(value, list) else [value]
    for v in items:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        for name, ok, word in (("ge", lambda b: v >= b, ">="), ("gt", lambda b: v > b, ">"),
                               ("le", lambda b: v <= b, "<="), ("lt", lambda b: v < b, "<")):
            bound = meta.get(name)
            if bound is not None and not ok(bound):
                raise ConfigError(key, f"must be {word} {bound}, got {value}.")


def require(condition: bool, key: str, message: str) -> None:
    """Shorthand for cross-key rules in `check`: raise ConfigError(key, message) unless condition."""
    if not condition:
        raise ConfigError(key, message)


def reject_unused(cfg, job, key: str, in_use: bool, when: str, *, name: str | None = None) -> None:
    """Refuse a key the user set to a non-default value where it would change nothing.

    `name` is the key as the user spells it when it differs from the field (a prefixed copy of a
    component, e.g. a discriminator's optimizer keys)."""
    name = name or key
    default = next(f.default for f in dataclasses.fields(cfg) if f.name == key)
    if not in_use and name in job.explicit_keys and getattr(cfg, key) != default:
        raise ConfigError(name, f"is set to {getattr(cfg, key)!r} but {when}, so it would be "
                                f"ignored. Remove it, or choose the mode it belongs to.")


# Where a fix starts in a message: its first sentence that begins with one of these verbs.
_FIX_VERBS = ("use", "set", "remove", "point", "raise", "lower", "add", "fix", "keep", "pass", "choose",
              "move", "give", "make", "put", "drop", "install", "run", "pick", "delete", "repair",
              "free", "increase", "reduce", "replace", "rename", "change", "shrink", "start", "train")
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z(])|(?<=[:;])\s+(?=[a-z])")


def split_fix(error: ConfigError) -> tuple[str, str]:
    """(what is wrong, how to fix it) of a ConfigError, for a table row: its `fix` when given, else
    the message's sentences from the first one that starts with a fixing verb ("Use ...", "Set ...",
    "Remove ..."); when the message has none, the key to change."""
    head = f"`{error.key}`{f' ({error.location})' if error.location else ''}: " if error.key else ""
    if error.fix:
        return head + error.message, error.fix
    sentences = _SENTENCE.split(error.message)
    for i, sentence in enumerate(sentences[1:], 1):
        if sentence.split(" ", 1)[0].strip("(").lower() in _FIX_VERBS:
            fix = " ".join(sentences[i:])
            said = " ".join(sentences[:i])
            return head + (said[:-1] if said[-1] in ":;," else said.rstrip(".")) + ".", fix[0].lower() + fix[1:]
    return head + error.message, (f"change `{error.key}` (the detail says what it must be)." if error.key
                                  else "change the config as the detail says.")


# Template values that must be replaced before a run: `/path/to/...` or a path starting at `/path/`,
# a `/PATH/` folder anywhere (the original scripts' spelling; in capitals, since a real folder may be
# called `path`), an `<angle bracket>` blank. One rule for every recipe: pan/config/job.py applies it
# to every path key when a config loads.
_PLACEHOLDER_ANY_CASE = re.compile(r"(^|/)path/to(/|$)|^/path(/|$)|<[^<>/]+>", re.IGNORECASE)
_PLACEHOLDER_CAPITALS = re.compile(r"(^|/)PATH(/|$)")


def placeholder_in(value) -> str | None:
    """The first template placeholder among a path value (a string or a list of them), or None."""
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, str) and (_PLACEHOLDER_ANY_CASE.search(v) or _PLACEHOLDER_CAPITALS.search(v)):
            return v
    return None
