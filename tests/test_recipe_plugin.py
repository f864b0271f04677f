"""A recipe that lives outside pan (tests/plugins/pan_toy_gan, installed by `make test`) is found
through its `pan.recipes` entry point, or through PAN_RECIPE_MODULES, and every `pan` command serves
it from its Recipe record alone: train and resume, `pan check` (its own row, the memory probe),
`pan sample`, `pan export --format`, `pan launch-command` (docs/adding_a_recipe.md)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import pytest
import yaml

from pan.checkpoint import layout
from pan.checkpoint.consolidate import consolidated_weights
from pan.export import main_export
from pan.config import load_job_config
from pan.preflight import main_check
from pan.recipe import get_recipe, recipe_names
from pan.runtime.plot import draw, read_records
from pan.runtime.plot import main as plot_main
from pan.sampling import main as sample_main
from pan.trainer import train

ROOT = Path(__file__).resolve().parents[1]


def write_config(path: Path, output_dir: Path, max_steps: int, recipe: str = "toy_gan", **model) -> Path:
    cfg = {"recipe": recipe, "model": {"toy_width": 8, "toy_samples": 12, "toy_batch": 2, **model},
           "training": {"max_steps": max_steps, "learning_rate": 1e-2, "warmup_steps": 0, "dtype": "fp32"},
           "output": {"output_dir": str(output_dir), "save_interval": 2, "log_interval": 1,
                      "progress_bar": False}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_installed_package_is_found_through_its_entry_point():
    assert [ep.value for ep in entry_points(group="pan.recipes") if ep.name == "toy_gan"] == ["pan_toy_gan"]
    assert "toy_gan" in recipe_names()
    recipe = get_recipe("toy_gan")
    assert recipe.job_config.__module__ == "pan_toy_gan.config"
    assert [w.name for w in recipe.workflows] == ["toy-gan"]


def test_it_trains_resumes_checks_samples_and_exports(tmp_path, capsys):
    run = tmp_path / "run"
    # Two runs of 4 steps (the second resumes at step 4) against one straight run of 6.
    assert train(load_job_config(["--config", str(write_config(tmp_path / "a.yaml", run, 4))],
                                 warn=lambda m: None)) == 0
    assert train(load_job_config(["--config", str(write_config(tmp_path / "b.yaml", run, 6))],
                                 warn=lambda m: None)) == 0
    straight = tmp_path / "straight"
    assert train(load_job_config(["--config", str(write_config(tmp_path / "c.yaml", straight, 6))],
                                 warn=lambda m: None)) == 0
    assert losses(run) == losses(straight) and len(losses(run)) == 6
    # pan plot draws any recipe's run: four panels, the loss on a log axis.
    assert plot_main([str(run), "--out", str(tmp_path / "toy.png")]) == 0
    from PIL import Image

    assert Image.open(tmp_path / "toy.png").size == (1200, 800)
    assert draw(read_records(run / "metrics.jsonl")).axes[0].get_yscale() in ("log", "symlog")

    # pan check: its own row, and memory and step time from its probe.
    capsys.readouterr()
    assert main_check(["--config", str(tmp_path / "b.yaml"), "--json"]) == 0
    rows = {r["check"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["toy data"]["status"] == "pass"
    assert rows["memory"]["status"] == "pass" and "2 samples of 8 values" in rows["memory"]["detail"]
    assert rows["resume"]["status"] == "pass" and "checkpoint-6" in rows["resume"]["detail"]

    # pan sample: the run's recipe is read from its config.yaml.
    out = tmp_path / "samples.csv"
    assert sample_main(["--checkpoint", str(run), "--num-samples", "3", "--out", str(out)]) == 0
    drawn = [[float(v) for v in row] for row in csv.reader(out.open())]
    assert len(drawn) == 3 and all(len(row) == 8 for row in drawn)
    # ... and anywhere: from a copy of the run folder, and from its generator exported alone (the file
    # carries the run's config, so no --config).
    shutil.copytree(run, tmp_path / "elsewhere" / "run")
    assert main_export([str(run), "--part", "generator", "--out", str(tmp_path / "generator.safetensors")]) == 0
    for name, source in (("copied", tmp_path / "elsewhere" / "run"), ("exported", tmp_path / "generator.safetensors")):
        assert sample_main(["--checkpoint", str(source), "--num-samples", "3", "--out", str(tmp_path / f"{name}.csv")]) == 0
        assert (tmp_path / f"{name}.csv").read_text() == out.read_text(), name

    # pan export --format toy_npz: the recipe's own format, the generator's weights as saved.
    ckpt = run / layout.checkpoint_name(6)
    npz = tmp_path / "generator.npz"
    assert main_export([str(ckpt), "--format", "toy_npz", "--out", str(npz)]) == 0
    assert "toy_npz" in capsys.readouterr().out
    saved = consolidated_weights(ckpt / "generator")
    with np.load(npz) as arrays:
        assert sorted(arrays.files) == sorted(saved)
        for name, tensor in saved.items():
            assert np.array_equal(arrays[name], tensor.numpy())
    assert main_export([str(ckpt), "--format", "toy_npz", "--dtype", "bf16", "--out", str(npz)]) == 2


def test_its_workflow_rule_refuses_before_printing(tmp_path, capsys, monkeypatch):
    from pan.launch_command import main_launch_command

    monkeypatch.chdir(ROOT)
    config = write_config(tmp_path / "toy.yaml", tmp_path / "run", 4, toy_samples=3)
    assert main_launch_command(["--workflow", "toy-gan", "--nodes", "1", "--gpus-per-node", "1",
                                "--config", str(config)]) == 0
    capsys.readouterr()
    assert main_launch_command(["--workflow", "toy-gan", "--nodes", "1", "--gpus-per-node", "2",
                                "--config", str(config)]) == 2
    assert "toy_samples >= 4" in capsys.readouterr().err


def test_a_module_named_in_PAN_RECIPE_MODULES_is_a_recipe(tmp_path):
    """A module that is not installed (on PYTHONPATH) and defines RECIPE, found in every process."""
    (tmp_path / "my_toy.py").write_text(
        "import dataclasses\nimport pan_toy_gan\n"
        "RECIPE = dataclasses.replace(pan_toy_gan.RECIPE, name='my_toy', workflows=())\n")
    config = write_config(tmp_path / "toy.yaml", tmp_path / "run", 2, recipe="my_toy")
    env = {**os.environ, "PAN_RECIPE_MODULES": "my_toy", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "train.py", "--config", str(config)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(losses(tmp_path / "run")) == 2
    unset = {k: v for k, v in env.items() if k != "PAN_RECIPE_MODULES"}
    refused = subprocess.run([sys.executable, "train.py", "--config", str(config)], cwd=ROOT, env=unset,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "unknown recipe 'my_toy'" in refused.stderr


@pytest.mark.parametrize("hook", ["task", "checks", "probe", "sample"])
def test_every_hook_of_every_recipe_resolves(hook):
    for name in recipe_names():
        recipe = get_recipe(name)
        if getattr(recipe, hook) is not None:
            assert recipe.hook(hook) is not None, (name, hook)
