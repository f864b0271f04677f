"""The README's "Train on your own videos", run as written on the demo's synthetic data: every
command of the section's code blocks, parsed from README.md (so the doc and this test cannot drift),
in a scratch folder that mirrors the repository root. Each must succeed and leave what the README
says it leaves. `pan --help` must list the same commands.

Only the dataset and the sampler's steps are cut for speed (8 clips instead of 480, 4 Euler steps
instead of 30; see SPEEDUPS); the JSONL file the README's second block reads is written from the
synthetic CSV, as a user's own file would be."""

import csv
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from pan.cli import main as pan_main
from pan.demo.analyser import load_video

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Train on your own videos"
# Appended to a command that starts with the key (later flags win in argparse and in pan's configs).
SPEEDUPS = {("pan", "data", "synth"): ["--num-train", "8", "--num-heldout", "0"],
            ("pan", "sample"): ["--steps", "4"]}
NUM_CLIPS = 8


def section_commands() -> list[list[str]]:
    """The commands of the README section's ```bash blocks, one per line, comments dropped."""
    text = (REPO / "README.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    blocks = re.findall(r"```bash\n(.*?)```", text[start:end if end > 0 else None], re.DOTALL)
    return [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()
            if shlex.split(line, comments=True)]


def marked_commands(doc: Path) -> list[list[str]]:
    """The commands of the doc's ```bash blocks marked `<!-- runs in tests/test_newcomer_path.py -->`
    (docs/writing_docs.md): docs/lora.md's LoRA on the README's run."""
    blocks = re.findall(r"<!-- runs in tests/test_newcomer_path.py -->\n```bash\n(.*?)```", doc.read_text(), re.DOTALL)
    return [shlex.split(line, comments=True) for block in blocks for line in block.replace("\\\n", " ").splitlines()
            if shlex.split(line, comments=True)]


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def csv_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def check_outcome(argv: list[str], out: str, cwd: Path) -> None:
    """What the README says each command leaves behind."""
    if argv[:3] == ["pan", "data", "synth"]:
        out = cwd / option(argv, "--out")
        assert len(csv_rows(out / "train.csv")) == NUM_CLIPS
        # The README's JSONL commands train on this file: the same clips, one {"video", "text"} a line.
        assert [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()] == \
            [{"video": r["path"], "text": r["caption"]} for r in csv_rows(out / "train.csv")]
    elif argv[:2] == ["pan", "check"]:
        assert out.rstrip().endswith(", 0 failed"), out
    elif argv[:3] == ["pan", "data", "precompute"]:
        rows = csv_rows(cwd / option(argv, "--out") / "train.csv")
        assert len(rows) == NUM_CLIPS and all((cwd / option(argv, "--out") / r["latent_path"]).is_file()
                                              for r in rows)
    elif argv[:2] == ["python", "train.py"]:
        run = cwd / option(argv, "--output_dir")
        assert {"checkpoint-10", "checkpoint-20", "metrics.jsonl", "config.yaml"} <= {p.name for p in run.iterdir()}
        assert "training finished at step 20" in out
    elif argv[:2] == ["pan", "plot"]:
        assert Image.open(cwd / argv[2] / "metrics.png").size == (1200, 800)
    elif argv[:2] == ["pan", "export"]:
        assert (cwd / option(argv, "--out")).stat().st_size > 0
    elif argv[:2] == ["pan", "sample"]:
        video = cwd / option(argv, "--out")
        assert load_video(video).shape == (5, 32, 32, 3)
        assert video.with_suffix(".gif").is_file()
    else:
        pytest.fail(f"the README section has a command this test does not know: {shlex.join(argv)}")


@pytest.fixture
def repo_like(tmp_path) -> Path:
    """A scratch folder where the README's relative paths (config/, train.py) resolve."""
    (tmp_path / "config").symlink_to(REPO / "config")
    (tmp_path / "train.py").symlink_to(REPO / "train.py")
    return tmp_path


def run_command(argv: list[str], cwd: Path, capsys) -> tuple[int, str]:
    """A README command: `pan ...` through `pan.cli.main`, the function the console script runs (in
    this process: no interpreter start per command); `python train.py ...` in a process of its own,
    as launched (it holds the output_dir's lease and may start a process group)."""
    if argv[0] == "pan":
        capsys.readouterr()
        code = pan_main(argv[1:])
        captured = capsys.readouterr()
        return code, captured.out + captured.err
    assert argv[:2] == ["python", "train.py"], f"a README command this test cannot run: {shlex.join(argv)}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    run = subprocess.run([sys.executable, *argv[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    return run.returncode, run.stdout + run.stderr


def test_the_readme_section_runs_as_written(repo_like, monkeypatch, capsys):
    """The README's section, then docs/lora.md's LoRA on the run it leaves."""
    commands = section_commands()
    lora = marked_commands(REPO / "docs" / "lora.md")
    assert any("--lora_rank" in a for a in lora) and any("--lora" in a for a in lora if a[:2] == ["pan", "sample"])
    kinds = {" ".join(a[:3]) if a[1] == "data" else " ".join(a[:2]) for a in commands}
    assert {"pan data synth", "pan check", "pan data precompute", "python train.py", "pan sample"} <= kinds
    assert any("--annotation_paths" in a for a in commands)  # the JSONL form is shown and run too
    monkeypatch.chdir(repo_like)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    for argv in commands + lora:
        extra = next((v for k, v in SPEEDUPS.items() if tuple(argv[:len(k)]) == k), [])
        code, output = run_command(argv + extra, repo_like, capsys)
        assert code == 0, f"{shlex.join(argv)} exited {code}:\n{output[-3000:]}"
        check_outcome(argv, output, repo_like)


def test_pan_help_lists_the_readme_commands(capsys):
    assert pan_main(["--help"]) == 0
    help_text = capsys.readouterr().out
    listed = [shlex.split(line) for line in help_text.splitlines()
              if line.startswith(("  pan ", "  python "))]
    readme = section_commands()
    assert len(listed) == 4 and all(cmd in readme for cmd in listed), listed
    assert "docs/troubleshooting.md" in help_text and (REPO / "docs" / "troubleshooting.md").is_file()
