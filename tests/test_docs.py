"""The docs as tests (issue 52, item 11): README.md and docs/*.md cannot drift from the code.

1. Every fenced shell block (```bash, ```sh, ```console) either runs in the suite on the tiny data or
   is marked as a cluster command, by an HTML comment on the line before its fence
   (docs/writing_docs.md): `<!-- runs in tests/X.py -->` (that test file exists and reads this doc,
   selecting the block by its section or by this marker, or holds each of its commands) or
   `<!-- cluster -->` (GPUs, Slurm, released weights, a real run's folder, or minutes of CPU).
   Either way each command's options are checked: every `--option` of a `pan ...` line is one its
   parser lists in its help (read once per command), and every `--key value` of a command that
   takes config overrides (`python train.py`, `torchrun ... train.py`, `pan check`,
   `pan data precompute`, `pan launch-command`, `sbatch scripts/X.sh`) is a key of the config's
   recipe; `make T` names a Makefile target, `sbatch` a script that exists.
2. Every Python name a doc cites in backticks as `pan.x.y...` imports (the attributes after the module
   exist), and every `pan/x/y.py` path exists.
3. Every figure quoted from `pan check`: a table after `<!-- pan check figures...: ARGS | ARGS -->`
   holds, per value column, the estimate of `pan check ARGS --json` (its `estimate` object, computed
   once per column) to the quoted precision, and its fits / does not fit verdicts.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_lora_memory import released  # noqa: F401  (the fixture of the released miniFLUX's shapes)

from pan import cli
from pan.config.job import _probe_recipe, key_owners, nested_types
from pan.config.loader import field_types
from pan.recipe import all_workflows, get_recipe, recipe_names

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = ("bash", "sh", "console")
MARKER = re.compile(r"<!--\s*(cluster|runs in (tests/[\w/]+\.py))\s*-->")
# `pan CMD` of each way a doc may spell it
MODULES = {"pan.cli": [], "pan.demo": ["demo"], "pan.demo.analyser": ["eval"], "pan.data.synth": ["data", "synth"],
           "pan.data.precompute": ["data", "precompute"], "pan.data.index": ["data", "index"]}
TAKES_CONFIG_KEYS = {("check",), ("data", "precompute"), ("launch-command",), ("train",)}


def rel(doc: Path) -> str:
    return doc.relative_to(REPO).as_posix()


# ------------------------------------------------------------------------------------------------
# The blocks
# ------------------------------------------------------------------------------------------------

@dataclass
class Block:
    doc: Path
    line: int                # of the fence
    marker: str | None       # "cluster", "runs in tests/X.py" or None
    section: str             # the heading the block sits under
    text: str

    def where(self) -> str:
        return f"{rel(self.doc)}:{self.line}"

    def commands(self) -> list[list[str]]:
        """Each command's words: continuation lines joined, comments dropped, `a; b` split, and a
        synopsis's brackets and `...` removed."""
        out = []
        for line in self.text.replace("\\\n", " ").splitlines():
            words = [w.strip("[]") for w in shlex.split(line, comments=True)]
            command: list[str] = []
            for word in words:
                if word.endswith(";"):
                    command.append(word[:-1])
                    out.append(command)
                    command = []
                elif word not in ("", "..."):
                    command.append(word)
            if command:
                out.append(command)
        return [c for c in out if c]


def shell_blocks(doc: Path) -> list[Block]:
    lines = doc.read_text().splitlines()
    blocks, section, i = [], "", 0
    while i < len(lines):
        if lines[i].startswith("#"):
            section = lines[i].lstrip("#").strip()
        fence = re.match(r"^\s*```(\S*)", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if re.match(r"^\s*```\s*$", lines[j]))
        if fence.group(1) in SHELL:
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = MARKER.search(before)
            blocks.append(Block(doc, i + 1, marker and marker.group(1), section, "\n".join(lines[i + 1:end])))
        i = end + 1
    return blocks


# ------------------------------------------------------------------------------------------------
# What each command takes (help read once per command)
# ------------------------------------------------------------------------------------------------

def help_options(text: str) -> set[str]:
    """The `--options` argparse's help lists (the option column of its option lines)."""
    found = set()
    for line in text.splitlines():
        spec = re.split(r"\s{2,}", line.strip())[0]
        if spec.startswith("-"):
            found |= set(re.findall(r"--[\w.-]+", spec))
    return found


def pan_help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):
        cli.main([*argv, "--help"])
    return out.getvalue()


@functools.cache
def command_options(command: tuple[str, ...]) -> frozenset[str]:
    """The options of `pan COMMAND` (`sample`: of every recipe's sampler; `demo`: of every demo)."""
    if command == ("train",):
        return frozenset({"--config"})
    if command == ("sample",):
        from test_cli_bad_values import sampler_parser

        names = [n for n in recipe_names() if get_recipe(n).sample]
        return frozenset().union(*(help_options(sampler_parser(n, []).format_help()) for n in names))
    if command[0] == "demo" and len(command) == 1:
        from pan.demo.main import recipes_with_demos

        return frozenset().union(*(command_options(("demo", r)) for r in recipes_with_demos()))
    if command[0] == "demo":
        return frozenset(help_options(pan_help(["demo", "--recipe", command[1]])) | {"--recipe"})
    return frozenset(help_options(pan_help(list(command))))


@functools.cache
def config_keys(recipe: str | None) -> frozenset[str]:
    """`--key`s of a recipe's config (None: of any recipe); a nested config's as `key.field`."""
    if recipe is None:
        return frozenset().union(*(config_keys(r) for r in recipe_names()))
    job = get_recipe(recipe).job_config
    keys = {"recipe", *key_owners(job)}
    for key, cls in nested_types(job).items():
        keys |= {f"{key}.{name}" for name in field_types(cls)}
    return frozenset(f"--{k}" for k in keys)


def value_of(words: list[str], option: str) -> str | None:
    return words[words.index(option) + 1] if option in words[:-1] else None


def recipe_of(command: tuple[str, ...], words: list[str]) -> str | None:
    """The recipe a command's config overrides go to: its --config file's, or its --workflow's."""
    workflow = value_of(words, "--workflow")
    if workflow in all_workflows():
        return all_workflows()[workflow].recipe
    config = value_of(words, "--config") or next((w for w in words if w.endswith(".yaml")), None)
    if config and (REPO / config).is_file():
        return _probe_recipe(REPO / config) or "pan"
    return None


def option_problems(command: tuple[str, ...], words: list[str]) -> list[str]:
    """The `--options` of `pan COMMAND WORDS` its parser does not list and that are no config key."""
    known = set(command_options(command))
    if command in TAKES_CONFIG_KEYS:  # (their --config is the config loader's)
        known |= config_keys(recipe_of(command, words)) | {"--config"}
    problems = []
    for word in words:
        if not word.startswith("--") or word == "--key":  # (`--key value`: a synopsis's placeholder)
            continue
        name = word.split("=", 1)[0]
        if command == ("launch-command",):
            name = re.sub(r"^--stage[^.]*\.", "--", name)  # a stage's own override
        if name not in known:
            problems.append(f"pan {' '.join(command)}: no option or config key {word}")
    return problems


def pan_command(words: list[str]) -> tuple[tuple[str, ...], list[str]] | None:
    """(the `pan` command, its arguments) of a line that runs one, however spelled; None otherwise."""
    if words[0] == "torchrun":
        rest = words[1:]
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            rest = rest[2:] if "=" not in rest[0] and rest[0] != "--standalone" else rest[1:]
        words = ["python", *rest]
    if words[0] == "pan":
        words = words[1:]
    elif words[0] == "python" and words[1:2] == ["train.py"]:
        words = ["train", *words[2:]]
    elif words[0] == "python" and words[1:2] == ["-m"] and words[2] in MODULES:
        words = [*MODULES[words[2]], *words[3:]]
    else:
        return None
    if not words or words[0] not in cli.COMMANDS:
        return ("?",), words
    if words[0] == "data":
        return tuple(words[:2]), words[2:]
    if words[0] == "demo":
        recipe = value_of(words, "--recipe")
        return (("demo", recipe) if recipe else ("demo",)), words[1:]
    return (words[0],), words[1:]


def command_problems(words: list[str]) -> list[str]:
    """What does not exist of one command line."""
    parsed = pan_command(words)
    if parsed is not None:
        command, args = parsed
        if command == ("?",):
            return [f"{shlex.join(words)}: no such pan command"]
        return option_problems(command, args)
    if words[0] == "make":
        targets = re.findall(r"^([\w.-]+):", (REPO / "Makefile").read_text(), re.MULTILINE)
        return [f"make {t}: no such Makefile target" for t in words[1:] if t not in targets]
    if words[0] == "sbatch":
        script = next((w for w in words[1:] if w.endswith(".sh")), None)
        if script is None or not (REPO / script).is_file():
            return [f"{shlex.join(words)}: no launch script {script}"]
        rest = words[words.index(script) + 1:]
        return option_problems(("train",), rest)
    if words[0] == "python" and words[1:2] == ["-m"]:
        return [] if importlib.util.find_spec(words[2]) else [f"python -m {words[2]}: no such module"]
    if words[0] == "python" and words[1].endswith(".py"):
        return [] if (REPO / words[1]).is_file() else [f"python {words[1]}: no such file"]
    return [f"{shlex.join(words)}: a command this test cannot check (pan, python train.py, torchrun, "
            "sbatch, make)"]


def marker_problems(block: Block) -> list[str]:
    if block.marker is None:
        return ["neither runs in the suite nor is marked: put `<!-- cluster -->` or `<!-- runs in "
                "tests/X.py -->` on the line before the fence (docs/writing_docs.md)"]
    if block.marker == "cluster":
        return []
    test = REPO / block.marker.removeprefix("runs in ")
    if not test.is_file():
        return [f"{block.marker}: no such test file"]
    source = test.read_text()
    if block.doc.name in source and (block.section in source or f"<!-- {block.marker} -->" in source):
        return []  # the test reads the doc itself: this block's section, or the blocks so marked
    missing = [shlex.join(c) for c in block.commands() if shlex.join(c) not in source and " ".join(c) not in source]
    return [f"{block.marker} does not read section {block.section!r} of {block.doc.name}, nor holds {m}"
            for m in missing]


def report(doc: Path, problems: list[str]) -> None:
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_shell_block_runs_or_is_marked_and_names_real_options(doc):
    problems = []
    for block in shell_blocks(doc):
        problems += [f"{block.where()}: {p}" for p in marker_problems(block)]
        for words in block.commands():
            problems += [f"{block.where()}: {p}" for p in command_problems(words)]
    report(doc, problems)


# ------------------------------------------------------------------------------------------------
# Python names
# ------------------------------------------------------------------------------------------------

CITED = re.compile(r"`(pan(?:\.\w+)+(?::\w+)?|pan/[\w/]+\.py(?:::\w+)?)(?:\(\))?`")


def name_problem(name: str) -> str | None:
    """Why a cited `pan.a.b.c` / `pan.a:b` / `pan/a/b.py[::c]` does not exist (None when it does)."""
    if name.startswith("pan/"):
        path, _, attr = name.partition("::")
        if not (REPO / path).is_file():
            return f"{path}: no such file"
        name = path.removesuffix(".py").replace("/", ".") + (f".{attr}" if attr else "")
    parts = name.replace(":", ".").split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(module_name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            break
    else:
        return f"{name}: no such module"
    target = importlib.import_module(module_name)
    for attr in parts[cut:]:
        if not hasattr(target, attr):
            return f"{name}: {'.'.join(parts[:parts.index(attr)])} has no {attr}"
        target = getattr(target, attr)
    return None


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_cited_pan_name_exists(doc):
    text = doc.read_text()
    problems = []
    for match in CITED.finditer(text):
        problem = name_problem(match.group(1))
        if problem:
            problems.append(f"{rel(doc)}:{text.count(chr(10), 0, match.start()) + 1}: {problem}")
    report(doc, problems)


def test_the_checks_find_what_does_not_exist():
    """The checks' own test: each kind of drift is found."""
    assert name_problem("pan.checkpoint.adapters.lora_model")            # a function that moved
    assert name_problem("pan/no_such_module.py") and not name_problem("pan/recipe.py::Recipe")
    assert not name_problem("pan.lora.runs.lora_model") and not name_problem("pan.recipe:get_recipe")
    assert command_problems(["pan", "check", "--config", "config/tiny_cpu.yaml", "--no_such_key", "1"])
    assert command_problems(["pan", "sample", "--checkpoint", "x", "--no-such-option"])
    assert command_problems(["python", "train.py", "--config", "config/tiny_cpu.yaml", "--lpips_ckpt", "x"])
    assert not command_problems(["torchrun", "--nproc_per_node", "8", "train.py", "--config", "config/tiny_cpu.yaml",
                                 "--cp_size", "2", "--transformer_config_overrides.num_layers", "4"])
    assert command_problems(["make", "no-such-target"]) and not command_problems(["make", "demo"])
    block = Block(REPO / "README.md", 1, "runs in tests/test_plot.py", "Install", "pan no-such-command\n")
    assert marker_problems(block) and command_problems(block.commands()[0])
    assert marker_problems(Block(REPO / "README.md", 1, None, "", "make demo"))


# ------------------------------------------------------------------------------------------------
# Figures quoted from `pan check`
# ------------------------------------------------------------------------------------------------

FIGURES = re.compile(r"^<!--\s*pan check figures(?P<shapes>, the released miniFLUX's shapes)?:\s*(?P<args>.*?)\s*-->",
                     re.DOTALL | re.MULTILINE)   # (at a line's start: an example indented in a list is none)
GIB = 2**30


@dataclass
class FigureTable:
    doc: Path
    line: int
    released_shapes: bool
    columns: list[list[str]]        # the `pan check` arguments of each value column
    rows: list[list[str]]           # the table's cells (header and rule left out)


def figure_tables(doc: Path) -> list[FigureTable]:
    text = doc.read_text()
    tables = []
    for match in FIGURES.finditer(text):
        line = text.count("\n", 0, match.end()) + 1
        rows = []
        for row in text[match.end():].lstrip("\n").splitlines():
            if not row.startswith("|"):
                break
            rows.append([cell.strip() for cell in row.strip().strip("|").split("|")])
        columns = [shlex.split(args) for args in match.group("args").split(" | ")]
        tables.append(FigureTable(doc, line, bool(match.group("shapes")), columns, rows[2:]))
    return tables


def quoted_tables() -> list[FigureTable]:
    return [t for doc in DOCS for t in figure_tables(doc)]


def estimate_of(argv: list[str]) -> tuple[dict, float | None]:
    """`pan check ARGV --json`'s `estimate` (the memory plan and step time of its `memory` row),
    and the device memory it was planned for (GiB)."""
    from pan.config import load_job_config
    from pan.preflight import Preflight
    from pan.preflight.command import parse_args

    args, rest = parse_args(argv)
    job = load_job_config(rest, warn=lambda m: None)
    ctx = Preflight(job, args.nodes, args.gpus_per_node, args.sample_rows, device_memory=args.device_memory)
    return ctx.estimate.to_json(), args.device_memory


def cell_problems(cell: str, category: str, estimate: dict, device_gib: float | None) -> list[str]:
    """A quoted figure (`12.34 GiB`, or `-` for none) and verdict against the estimate."""
    value = estimate["total"] if category == "total" else estimate["device"].get(category, 0)
    number = re.search(r"(\d+(?:\.(\d+))?) GiB", cell)
    problems = []
    if number is None:
        if cell.strip("*") != "-" or value:
            problems.append(f"{category}: {cell!r} quotes no figure, pan check says {value / GIB:.2f} GiB")
    elif f"{value / GIB:.{len(number.group(2) or '')}f}" != number.group(1):
        problems.append(f"{category}: quoted {number.group(1)} GiB, pan check says {value / GIB:.2f} GiB")
    if device_gib is not None and "fit" in cell:
        fits = estimate["total"] <= device_gib * GIB
        if ("does not fit" in cell) == fits:
            problems.append(f"{category}: {cell!r}, but pan check plans {estimate['total'] / GIB:.2f} GiB "
                            f"for {device_gib} GiB")
    return problems


@pytest.mark.parametrize("table", quoted_tables(), ids=lambda t: f"{rel(t.doc)}:{t.line}")
def test_quoted_pan_check_figures_are_pan_checks(table, request, tmp_path):
    if table.released_shapes:
        from pyramid_reference import REFERENCE
        from test_lora_memory import argv as released_argv

        if not REFERENCE.is_dir():
            pytest.skip("the released miniFLUX's shapes come with the reference fixtures")
        folder = request.getfixturevalue("released")
    problems, estimates = [], []
    for args in table.columns:
        config = value_of(args, "--config")
        extra = [a for a in args if a not in ("--config", config)]
        argv = (released_argv(folder, tmp_path, re.search(r"_(\d+p)_", config).group(1), *extra)
                if table.released_shapes else args)
        estimates.append(estimate_of(argv))
    # a category one column's estimate lacks (a LoRA run's frozen parameters) is none there
    categories = sorted({"total", *(c for e, _ in estimates for c in e["device"])}, key=len, reverse=True)
    for column, (args, (estimate, device_gib)) in enumerate(zip(table.columns, estimates), start=1):
        for row in table.rows:
            label = row[0].strip("*` ").lower()
            category = next((c for c in categories if label == c or label.startswith(c + " ")), None)
            if category is None:
                problems.append(f"row {row[0]!r} names no category of pan check's estimate ({categories})")
                continue
            problems += [f"column {column} ({shlex.join(args)}): {p}"
                         for p in cell_problems(row[column], category, estimate, device_gib)]
    assert not problems, f"{rel(table.doc)}:{table.line}:\n" + "\n".join(problems)


def test_figure_tables_are_found_and_compared():
    tables = quoted_tables()
    assert any(t.doc.name == "lora.md" and len(t.columns) == 2 for t in tables)
    estimate = {"total": 20.76 * GIB, "device": {"activations": 13.03 * GIB}}
    assert cell_problems("12.01 GiB", "activations", estimate, 24)             # the drift
    assert not cell_problems("13.03 GiB", "activations", estimate, 24)
    assert not cell_problems("**20.76 GiB: fits**", "total", estimate, 24)
    assert cell_problems("**20.76 GiB: does not fit**", "total", estimate, 24)
    assert cell_problems("-", "activations", estimate, 24) and not cell_problems("-", "ema", estimate, 24)

