"""No traceback from a value a user types, whatever the command (issue 52, item 4): every option of
every `pan` command, read from the command's own argparse parser, is given each bad value of its
kind (a missing path, a file where a folder is expected and back, an empty or corrupt file, a zero or
negative number, a size the model cannot take, an unknown name or choice), and each answer must be a
refusal: exit 2, a message naming the option, and no traceback.

The kinds come from the option's `type` (pan/config/arguments.py: each `ValueType` names its kind,
and a number the values its bounds refuse, nan and inf among them); a number option of a plain
`int`/`float` is itself a finding (it takes nan, inf and whatever its bounds exclude: only its type
knows them), and a plain string one must refuse an unknown name unless it is free text (a prompt).
`pan sample`'s options are its run's recipe's: they are walked on a real tiny run
(config/tiny_cpu.yaml, 2 steps), and every registered recipe's sampler (from the registry: built in
and plugins) in its parser. The commands run in this process (argparse's SystemExit caught); two go
through the `pan` console script.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from pan import cli
from pan.config import load_job_config
from pan.config.arguments import input_file, looked_up
from pan.recipe import get_recipe, recipe_names, resolve
from pan.data.synth import synth_dataset

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "config" / "tiny_cpu.yaml"
FREE_TEXT = {"--prompt", "--negative-prompt"}   # any text is a prompt
# The files an option reads, by the suffix its command goes by (an image's, a video's, ...).
SUFFIX = {"--image": ".png", "--video": ".mp4", "--csv": ".csv", "--config": ".yaml", "--checkpoint": ".safetensors",
          "--lora": ".safetensors"}


# ------------------------------------------------------------------------------------------------
# The bad values
# ------------------------------------------------------------------------------------------------

@dataclass
class Bad:
    """A folder of bad paths: `missing(s)`, `empty(s)`, `corrupt(s)` (files of suffix s), `folder`
    (an empty one), `file` (a plain text file), `under_file` (a path below a file)."""
    root: Path

    def missing(self, suffix: str = "") -> str:
        return str(self.root / f"no_such_path{suffix}")

    def empty(self, suffix: str) -> str:
        path = self.root / f"empty{suffix or '.dat'}"
        path.touch()
        return str(path)

    def corrupt(self, suffix: str) -> str:
        path = self.root / f"corrupt{suffix or '.dat'}"
        path.write_bytes(b"\x00\x01garbage\xff\xfe not what it claims to be\x00" * 4)
        return str(path)

    @property
    def folder(self) -> str:
        path = self.root / "empty_folder"
        path.mkdir(exist_ok=True)
        return str(path)

    @property
    def file(self) -> str:
        path = self.root / "notes.txt"
        path.write_text("a plain text file\n")
        return str(path)

    @property
    def under_file(self) -> str:
        return str(Path(self.file) / "inside")


def untyped(action: argparse.Action) -> str | None:
    """The finding for an option whose type is not one of pan.config.arguments: a plain int/float
    takes nan, inf and numbers out of its bounds, a plain Path a missing or unreadable file; only a
    typed value knows what its option takes."""
    if action.type in (int, float):
        return (f"{needle(action)}: a plain {action.type.__name__} takes {'nan, inf, ' * (action.type is float)}0 "
                "and negatives, whatever the option's bounds: give it a type of pan.config.arguments (COUNT, "
                "SEED, POSITIVE, whole_number(...), number(...))")
    if action.type is not None and getattr(action.type, "kind", None) is None:
        name = getattr(action.type, "__name__", action.type)
        return f"{needle(action)}: type {name} has no kind: give it a type of pan.config.arguments"
    return None


def bad_values(action: argparse.Action, bad: Bad) -> list[tuple[str, str]] | None:
    """(what, value) of each bad value of the option's kind; None for an option that takes none
    (a flag, help) or free text."""
    if action.nargs == 0 or isinstance(action, argparse._HelpAction):
        return None
    option = max(action.option_strings, key=len) if action.option_strings else ""
    suffix = SUFFIX.get(option, "")
    if action.choices is not None:
        return [("an unknown choice", "no-such-choice")]
    kind = getattr(action.type, "kind", None)
    paths = {
        "file": [("a missing file", bad.missing(suffix)), ("a folder", bad.folder),
                 ("an empty file", bad.empty(suffix)), ("a corrupt file", bad.corrupt(suffix))],
        "config": [("a missing file", bad.missing(".yaml")), ("a folder", bad.folder),
                   ("a corrupt file", bad.corrupt(".yaml"))],
        "folder": [("a missing folder", bad.missing()), ("a file", bad.file)],
        "path": [("a missing path", bad.missing(suffix)), ("an empty folder", bad.folder),
                 ("an empty file", bad.empty(suffix)), ("a corrupt file", bad.corrupt(suffix))],
        "checkpoint": [("a missing path", bad.missing()), ("a plain file", bad.file),
                       ("an empty folder", bad.folder), ("an empty .safetensors", bad.empty(".safetensors")),
                       ("a corrupt .safetensors", bad.corrupt(".safetensors"))],
        "output file": [("an existing folder", bad.folder), ("a path under a file", bad.under_file)],
        "output folder": [("an existing file", bad.file), ("a path under a file", bad.under_file)],
        "pixels": [("zero", "0"), ("a negative size", "-32"), ("a size the model cannot take", "30")],
        "frames": [("zero", "0"), ("a negative count", "-1")],
        "device": [("an unknown device", "no-such-device")],
    }
    if kind in paths:
        return paths[kind]
    refuses = getattr(action.type, "refuses", ())
    if refuses:
        return [(f"{value} (out of bounds)", value) for value in refuses]
    assert kind is None, f"{option or action.dest}: the walk knows no bad values of kind {kind!r}"
    assert action.type is None, f"{option or action.dest}: type {action.type!r} without a kind (pan.config.arguments)"
    if option in FREE_TEXT:
        return None
    return [("an unknown name", "no-such-name")]


# ------------------------------------------------------------------------------------------------
# Running a command
# ------------------------------------------------------------------------------------------------

def run_pan(argv: list[str]) -> tuple[int | str, str]:
    """`pan ARGV` in this process: (exit code, everything it printed); an exception is returned as
    its traceback (the thing that must never happen)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) or e.code is None else 1
        except Exception:  # noqa: BLE001 - the finding itself
            import traceback

            return "raised", out.getvalue() + traceback.format_exc()
    return code, out.getvalue()


def with_value(base: list[str], action: argparse.Action, value: str) -> list[str]:
    """`base` with the option (or positional) set to `value` (its old value, if any, dropped)."""
    values = [value] * (action.nargs if isinstance(action.nargs, int) else 1)
    if not action.option_strings:  # a positional: its place among base's leading positionals
        index = positional_index(action)
        return base[:index] + values + base[index + 1:]
    argv, skip = [], 0
    for i, word in enumerate(base):
        if skip:
            skip -= 1
            continue
        if word in action.option_strings:
            following = base[i + 1:]
            skip = next((n for n, w in enumerate(following) if w.startswith("--")), len(following))
            continue
        argv.append(word)
    return argv + [action.option_strings[-1], *values]


_positionals: dict[int, int] = {}


def positional_index(action: argparse.Action) -> int:
    return _positionals[id(action)]


def needle(action: argparse.Action) -> str:
    """What a message about the option must name."""
    if action.option_strings:
        return max(action.option_strings, key=len)
    return action.metavar if isinstance(action.metavar, str) else action.dest


def walk(prefix: list[str], parser: argparse.ArgumentParser, base: list[str], bad: Bad,
         skip: set[str] = frozenset()) -> list[str]:
    """Every option of `parser` with each of its bad values, in `pan PREFIX BASE` (a valid command);
    the problems found, one line each."""
    problems, count = [], 0
    positionals = [a for a in parser._actions if not a.option_strings]
    for i, action in enumerate(positionals):
        _positionals[id(action)] = i
    for action in parser._actions:
        if action.help == argparse.SUPPRESS and not action.option_strings:
            continue  # a hidden positional (export's out_file) is the same as its option
        if needle(action) in skip:
            continue
        if untyped(action):
            problems.append(f"pan {' '.join(prefix)} {untyped(action)}")
            count += 1
            continue
        for what, value in bad_values(action, bad) or []:
            argv = prefix + with_value(base, action, value)
            code, text = run_pan(argv)
            count += 1
            name = needle(action)
            if code != 2 or name not in text or "Traceback" in text:
                last = text.strip().splitlines()[-3:] if text.strip() else ["(nothing printed)"]
                problems.append(f"pan {' '.join(argv)}  [{name} = {what}] -> exit {code}: " + " | ".join(last))
    assert count, f"pan {' '.join(prefix)}: no option walked"
    return problems


def captured_parser(argv: list[str] | Callable[[], object], wanted) -> argparse.ArgumentParser:
    """The parser a command builds inside `pan ARGV` (or inside `argv()`, a callable) for a command
    without a `build_parser`: the first whose `wanted(parser)` holds, taken when it starts parsing
    (the command goes no further)."""
    class Got(Exception):
        pass

    original = argparse.ArgumentParser.parse_known_args

    def grab(self, args=None, namespace=None):
        if wanted(self):
            raise Got(self)
        return original(self, args, namespace)

    argparse.ArgumentParser.parse_known_args = grab
    try:
        argv() if callable(argv) else cli.main(argv)
    except Got as got:
        return got.args[0]
    finally:
        argparse.ArgumentParser.parse_known_args = original
    raise AssertionError(f"{argv if callable(argv) else 'pan ' + ' '.join(argv)} built no parser that was wanted")


# ------------------------------------------------------------------------------------------------
# The fixtures: a tiny run, its data, the bad paths
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    return synth_dataset(tmp_path_factory.mktemp("data"), num_train=4, num_heldout=1, size=32, num_frames=5)


@pytest.fixture(scope="module")
def run(data, tmp_path_factory) -> Path:
    from pan.trainer import build_trainer  # the run `pan sample`'s options are walked on

    out = tmp_path_factory.mktemp("run")
    job = load_job_config(["--config", str(TINY), "--output_dir", str(out), "--video_csv_paths",
                           str(data["train_csv"]), "--max_steps", "2", "--sample_num_frames", "5",
                           "--sample_height", "32", "--sample_width", "32"], warn=lambda m: None)
    build_trainer(job).fit()
    return out


@pytest.fixture
def bad(tmp_path, monkeypatch) -> Bad:
    monkeypatch.delenv("RANK", raising=False)
    root = tmp_path / "bad"
    root.mkdir()
    return Bad(root)


def loader_config_problems(prefix: list[str], rest: list[str], bad: Bad) -> list[str]:
    """The config loader's --config (train, check, precompute: not an argparse option of theirs)."""
    problems = []
    for what, value in [("a missing file", bad.missing(".yaml")), ("a folder", bad.folder),
                        ("a corrupt file", bad.corrupt(".yaml"))]:
        code, text = run_pan(prefix + ["--config", value] + rest)
        if code != 2 or "config" not in text or "Traceback" in text:
            problems.append(f"pan {' '.join(prefix)} --config {what} -> exit {code}: {text.strip()[-300:]}")
    return problems


# ------------------------------------------------------------------------------------------------
# The walk, one test per command of `pan` (cli.COMMANDS)
# ------------------------------------------------------------------------------------------------

def test_pan_itself_refuses_an_unknown_command():
    code, text = run_pan(["no-such-command"])
    assert code == 2 and "command" in text and "Traceback" not in text


def test_train(bad, data, tmp_path):
    assert not loader_config_problems(["train"], ["--output_dir", str(tmp_path / "out")], bad)


def test_check(bad, data, tmp_path):
    base = ["--config", str(TINY), "--video_csv_paths", str(data["train_csv"]), "--output_dir", str(tmp_path / "o")]
    parser = captured_parser(["check", *base], lambda p: p.prog == "pan check")
    problems = walk(["check"], parser, base, bad)
    problems += loader_config_problems(["check"], base[2:], bad)
    assert not problems, "\n".join(problems)


def test_launch_command(bad):
    from pan.launch_command import build_parser  # the command's own parser

    parser = build_parser()
    workflow = next(a for a in parser._actions if a.dest == "workflow").choices[0]
    base = ["--workflow", workflow, "--nodes", "1", "--gpus-per-node", "1"]
    assert not (problems := walk(["launch-command"], parser, base, bad)), "\n".join(problems)


def test_data(bad, data, tmp_path):
    from pan.data.precompute import build_parser as precompute_parser
    from pan.data.synth import build_parser as synth_parser

    synth = ["--out", str(tmp_path / "synth"), "--num-train", "1", "--num-heldout", "0", "--size", "16",
             "--num-frames", "2"]
    problems = walk(["data", "synth"], synth_parser(), synth, bad)
    precompute = ["--config", str(TINY), "--video_csv_paths", str(data["train_csv"]), "--out", str(tmp_path / "pre")]
    problems += walk(["data", "precompute"], precompute_parser(), precompute, bad)
    problems += loader_config_problems(["data", "precompute"], precompute[2:], bad)
    from pan.data.index import build_parser as index_parser
    problems += walk(["data", "index"], index_parser(), [str(data["train_csv"]), "--out", str(tmp_path / "idx")], bad)
    code, text = run_pan(["data", "no-such-tool"])
    if code != 2:
        problems.append(f"pan data no-such-tool -> exit {code}")
    assert not problems, "\n".join(problems)


def test_eval(bad, data):
    from pan.demo.analyser import build_parser

    assert not (problems := walk(["eval"], build_parser(), ["--csv", str(data["heldout_csv"])], bad)), \
        "\n".join(problems)


def test_sample(bad, run, tmp_path):
    """The run's recipe's sampler, every option (the run's own config names the recipe)."""
    from pan.recipe import get_recipe, resolve

    job = load_job_config(["--config", str(run / "config.yaml")], warn=lambda m: None, use_only=True)
    module = resolve(get_recipe(job.recipe).sample.partition(":")[0])
    base = ["--checkpoint", str(run), "--prompt", "a red square moving left", "--out", str(tmp_path / "a.mp4"),
            "--steps", "1"]
    assert not (problems := walk(["sample"], module.build_parser(job), base, bad)), "\n".join(problems)


SAMPLERS = [name for name in recipe_names() if get_recipe(name).sample]


def sampler_parser(name: str, base: list[str]) -> argparse.ArgumentParser:
    """The parser of recipe `name`'s `pan sample`, as the registry names it: its `build_parser`, or
    the one its sample function builds when called (taken before it parses: nothing runs)."""
    module_name, _, function = get_recipe(name).sample.partition(":")
    module, job = resolve(module_name), get_recipe(name).job_config()
    if hasattr(module, "build_parser"):
        return module.build_parser(job)
    return captured_parser(lambda: getattr(module, function)(job, base), lambda p: p.prog == "pan sample")


def parser_refusals(name: str, parser: argparse.ArgumentParser, base: list[str], bad: Bad) -> list[str]:
    """Each option of a sampler's parser with its bad values: what the parser accepts or refuses
    without naming the option. (A checkpoint's contents and a size the model cannot take are judged
    after parsing, as for the recipe walked on a run: pan.sampling.)"""
    problems = []
    for action in parser._actions:
        if untyped(action):
            problems.append(f"{name}: {untyped(action)}")
            continue
        if getattr(action.type, "kind", None) == "checkpoint":
            continue
        for what, value in bad_values(action, bad) or []:
            if what == "a size the model cannot take":
                continue
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
                parser.parse_args(with_value(base, action, value))
                problems.append(f"{name}: {needle(action)} = {what} is accepted by the parser")
                continue
            if needle(action) not in err.getvalue():
                problems.append(f"{name}: {needle(action)} = {what}: {err.getvalue().strip()[-200:]}")
    return problems


@pytest.mark.parametrize("name", SAMPLERS)
def test_every_recipes_sampler_refuses_in_its_parser(name, bad, tmp_path):
    """Every registered recipe's sampler (built in and plugins, as the registry lists them): every
    number option has a typed value, and what its parser judges (numbers, files, choices, outputs)
    it refuses by name."""
    base = ["--checkpoint", str(tmp_path), "--out", str(tmp_path / "a.mp4")]
    parser = sampler_parser(name, base)
    if any("--prompt" in a.option_strings for a in parser._actions):
        base += ["--prompt", "x"]
    assert not (problems := parser_refusals(name, parser, base, bad)), "\n".join(problems)


def test_the_sampler_walk_reaches_every_recipe_with_a_sampler():
    assert {"pan", "pyramid_flow", "pyramid_flow_ar", "wan", "toy_gan"} <= set(SAMPLERS)  # plugins too


def test_the_walk_finds_an_untyped_number_an_accepted_value_and_a_traceback(bad, monkeypatch):
    """The walk's own check: a command with a plain-int option, that crashes on an unknown device
    and never reads its CSV before it is done (a corrupt one passes) is caught at all three, and
    only there."""
    def build_parser() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog="pan fake")
        parser.add_argument("--count", type=int, default=1)
        parser.add_argument("--device", type=looked_up("device", str), default="cpu")
        parser.add_argument("--csv", type=input_file("a CSV"))
        return parser

    def fake(argv: list[str]) -> int:
        args = build_parser().parse_args(argv)
        if args.device != "cpu":
            raise ValueError(f"no device {args.device}")
        return 0

    monkeypatch.setitem(cli.COMMANDS, "fake", (fake, "the walk's self-test"))
    problems = walk(["fake"], build_parser(), [], bad)
    assert any("--count: a plain int takes 0 and negatives" in p for p in problems), problems
    assert any("[--device = an unknown device] -> exit raised" in p and "ValueError" in p for p in problems)
    csv = [p.split("  ")[1] for p in problems if "--csv" in p]
    assert csv == ["[--csv = a corrupt file] -> exit 0: (nothing printed)"], problems
    assert len(problems) == 3, problems
    # The same plain int in a sampler's parser is a finding of the parser walk too.
    assert parser_refusals("fake", build_parser(), [], bad)[0].startswith("fake: --count: a plain int")


def test_export(bad, run, tmp_path):
    from pan.export import build_parser

    base = [str(run), "--out", str(tmp_path / "m.safetensors")]
    assert not (problems := walk(["export"], build_parser(), base, bad)), "\n".join(problems)


def test_inspect(bad, run):
    from pan.checkpoint.consolidate import build_parser

    assert not (problems := walk(["inspect"], build_parser(), [str(run)], bad)), "\n".join(problems)


def test_plot(bad, run, tmp_path):
    from pan.runtime.plot import build_parser

    base = [str(run), "--out", str(tmp_path / "p.png")]
    assert not (problems := walk(["plot"], build_parser(), base, bad)), "\n".join(problems)


def test_demo(bad, tmp_path):
    """`pan demo`'s --recipe, then each demo's own options (a bad one must stop it before it trains)."""
    from pan.demo.main import dispatch_parser, recipes_with_demos
    from pan.recipe import get_recipe, resolve

    problems = walk(["demo"], dispatch_parser(), [], bad)
    for name in recipes_with_demos():
        prefix = ["demo", "--recipe", name]
        module = resolve(get_recipe(name).demo.partition(":")[0])
        parser = (module.build_parser() if hasattr(module, "build_parser") else
                  captured_parser([*prefix, "--out", str(tmp_path / name)],
                                  lambda p: p.prog.startswith("pan demo") and p.add_help))
        problems += walk(prefix, parser, ["--out", str(tmp_path / name)], bad)
    assert not problems, "\n".join(problems)


def test_every_command_is_walked():
    """Each command of `pan` has its walk here, a test named after it: a new command gets one."""
    tests = {name.removeprefix("test_").replace("_", "-") for name in globals() if name.startswith("test_")}
    assert not set(cli.COMMANDS) - tests, f"not walked: {sorted(set(cli.COMMANDS) - tests)}"


# ------------------------------------------------------------------------------------------------
# The console script: the same refusals through `pan` itself
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["sample", "--checkpoint", "{folder}", "--prompt", "x", "--out", "{tmp}/a.mp4"],
    ["eval", "--csv", "{tmp}/no_such.csv"],
], ids=["sample-empty-folder", "eval-missing-csv"])
def test_the_console_script_refuses_without_a_traceback(argv, bad, tmp_path):
    pan = shutil.which("pan", path=str(Path(sys.executable).parent))
    assert pan, "the `pan` console script is not installed beside this python"
    argv = [a.format(folder=bad.folder, tmp=tmp_path) for a in argv]
    done = subprocess.run([pan, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert argv[1] in done.stderr  # the option
