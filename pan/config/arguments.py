"""The value types of pan's command-line options (argparse `type=`): each refuses what its option
cannot take while the command line is parsed, before anything is loaded, as argparse's usage error
("argument --height: must be a whole number >= 1, got '0'", exit 2), and says what it takes.

Every type names its `kind`: what tests/test_cli_bad_values.py walks each option of every `pan`
command with (zero and negative numbers, a missing path, a file where a folder is expected and back,
an empty or corrupt file). A `check` given to `input_file` reads the file the way the command will
(an image, the first frame of a video, a CSV's header), so an unreadable one is refused by name too.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any


class ValueType:
    """An argparse type: `convert(text)` gives the value or raises ValueError saying what is wrong.
    `refuses`: example texts it refuses (a number's bounds), which the CLI walk tries."""

    def __init__(self, kind: str, convert: Callable[[str], Any], name: str, refuses: tuple[str, ...] = ()):
        self.kind = kind
        self.convert = convert
        self.__name__ = name  # argparse names a type by it
        self.refuses = refuses

    def __call__(self, text: str) -> Any:
        try:
            return self.convert(text)
        except (ValueError, OSError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    def __repr__(self) -> str:
        return f"ValueType({self.kind!r})"


def _number(text: str, cast: type) -> int | float:
    try:
        value = cast(text)
    except ValueError:
        raise ValueError(f"must be a {'whole number' if cast is int else 'number'}, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {text!r}")
    return value


def whole_number(minimum: int, maximum: int | None = None, *, even: bool = False) -> ValueType:
    """An int >= `minimum` (and <= `maximum`; `even`: a multiple of 2)."""
    bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"

    def convert(text: str) -> int:
        value = _number(text, int)
        if value < minimum or (maximum is not None and value > maximum) or (even and value % 2):
            raise ValueError(f"must be {'an even number ' if even else ''}{bound}, got {text!r}")
        return value
    kind = f"int>={minimum}" if maximum is None else f"int[{minimum},{maximum}]"
    refuses = {str(minimum - 1), "-1"} | ({str(maximum + 1)} if maximum is not None else set())
    refuses = {r for r in refuses if int(r) < minimum or (maximum is not None and int(r) > maximum)}
    if even:
        refuses.add(str(minimum + 1))
    return ValueType(kind, convert, kind, tuple(sorted(refuses, key=int)))


def number(*, above: float | None = None, at_least: float | None = None, at_most: float | None = None,
           below: float | None = None) -> ValueType:
    """A finite float: > `above`, >= `at_least`, <= `at_most`, < `below` (those given)."""
    rules = [(above, lambda v, b: v > b, "> {}", lambda b: (b, b - 1)),
             (at_least, lambda v, b: v >= b, ">= {}", lambda b: (b - 1,)),
             (at_most, lambda v, b: v <= b, "<= {}", lambda b: (b + 1,)),
             (below, lambda v, b: v < b, "< {}", lambda b: (b,))]
    rules = [(bound, test, say.format(bound), bad(bound)) for bound, test, say, bad in rules if bound is not None]

    def convert(text: str) -> float:
        value = _number(text, float)
        if not all(test(value, bound) for bound, test, _, _ in rules):
            raise ValueError(f"must be {' and '.join(say for _, _, say, _ in rules)}, got {text!r}")
        return value
    kind = "float" + "".join(say.replace(" ", "") for _, _, say, _ in rules)
    refuses = ("nan", "inf", *dict.fromkeys(f"{b:g}" for _, _, _, bad in rules for b in bad))
    return ValueType(kind, convert, kind, refuses)


COUNT = whole_number(1)        # how many of something (steps, frames, rows, nodes)
SEED = whole_number(0)         # a random seed
POSITIVE = number(above=0)     # a rate or a size (fps, GiB, a schedule's shift)
FRACTION = number(at_least=0, at_most=1)


def input_file(what: str, check: Callable[[Path], None] | None = None) -> ValueType:
    """An existing file (`what` it must be, for the message); `check(path)` reads it as the command
    will and raises ValueError (or OSError) for one that cannot be used."""
    def convert(text: str) -> Path:
        path = Path(text)
        if not path.exists():
            raise ValueError(f"{text} does not exist: give {what}")
        if not path.is_file():
            raise ValueError(f"{text} is a folder, not a file: give {what}")
        if path.stat().st_size == 0:
            raise ValueError(f"{text} is empty: give {what}")
        if check is not None:
            try:
                check(path)
            except Exception as e:  # noqa: BLE001 - each reader's own errors: the file is not `what`
                raise ValueError(f"{text} cannot be read as {what}: {e}") from None
        return path
    return ValueType("file", convert, "file")


def input_folder(what: str) -> ValueType:
    """An existing folder."""
    def convert(text: str) -> Path:
        path = Path(text)
        if not path.exists():
            raise ValueError(f"{text} does not exist: give {what}")
        if not path.is_dir():
            raise ValueError(f"{text} is a file, not a folder: give {what}")
        return path
    return ValueType("folder", convert, "folder")


def input_path(what: str, kind: str = "path") -> ValueType:
    """An existing file or folder, whose contents the command judges (a checkpoint: `kind`
    "checkpoint")."""
    def convert(text: str) -> Path:
        if not Path(text).exists():
            raise ValueError(f"{text} does not exist: give {what}")
        return Path(text)
    return ValueType(kind, convert, kind)


def _writable_place(path: Path, text: str, what: str) -> None:
    """Refuse a path under an existing file (nothing can be written there)."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{text} lies under {parent}, which is a file: give {what}")
            return


def output_place(what: str) -> Callable[[str], Path]:
    """A path to write a file or a folder at: not under an existing file (a `ValueType`'s convert)."""
    def convert(text: str) -> Path:
        _writable_place(Path(text), text, what)
        return Path(text)
    return convert


def output_file(what: str) -> ValueType:
    """A file to write: not an existing folder, nor under a file."""
    def convert(text: str) -> Path:
        path = Path(text)
        if path.is_dir():
            raise ValueError(f"{text} is a folder: give {what}")
        _writable_place(path, text, what)
        return path
    return ValueType("output file", convert, "output_file")


def output_folder(what: str) -> ValueType:
    """A folder to write into (made when missing): not an existing file, nor under one."""
    def convert(text: str) -> Path:
        path = Path(text)
        if path.exists() and not path.is_dir():
            raise ValueError(f"{text} is a file: give {what}")
        _writable_place(path, text, what)
        return path
    return ValueType("output folder", convert, "output_folder")


def looked_up(kind: str, convert: Callable[[str], Any]) -> ValueType:
    """A name the command looks up (a device, a part): `convert` raises ValueError for an unknown one."""
    return ValueType(kind, convert, kind)


def yaml_mapping(path: Path) -> None:
    """`input_file`'s check of a YAML config file: it parses, to a mapping of sections."""
    import yaml

    loaded = yaml.safe_load(path.read_text(encoding="utf-8-sig"))
    if not isinstance(loaded, dict):
        raise ValueError(f"it holds a YAML {type(loaded).__name__}, not a mapping of sections")
