"""The recipe contract with two trained parts (tests/plugins/pan_toy_gan: a generator and a
discriminator with its own optimizer keys): it trains and logs its own metrics, is SIGKILLed and
resumed bit-identically on 2 processes, refuses a checkpoint whose parts differ, and plugs its
workflow and preflight check into the CLI like a recipe of pan's own."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import yaml


from launch_utils import consumed, kill_after_step, launch, run_to_end
from pan.checkpoint import layout
from pan.checkpoint.consolidate import consolidated_weights
from pan.export import main_export
from pan.config import ConfigError, load_job_config
from pan.trainer import build_trainer, train

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8


def write_config(path: Path, output_dir: Path, **extra) -> Path:
    cfg = {"recipe": "toy_gan",
           "model": {"toy_width": 16, "toy_samples": 40, "toy_batch": 3, **extra.pop("model", {})},
           "training": {"max_steps": STEPS, "learning_rate": 1e-2, "warmup_steps": 2, "dtype": "fp32",
                        "ema_decay": 0.9, "gradient_accumulation_steps": 2},
           "discriminator": {"disc_learning_rate": 5e-3, "disc_lr_scheduler_type": "cosine",
                             "disc_ema_decay": 0.5},
           "output": {"output_dir": str(output_dir), "save_interval": 2, "log_interval": 1,
                      "progress_bar": False, **extra.pop("output", {})}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_each_part_has_its_own_keys_and_metrics(tmp_path):
    config = write_config(tmp_path / "toy.yaml", tmp_path / "run")
    job = load_job_config(["--config", str(config)], warn=lambda m: None)
    assert job.disc_optim.optim().learning_rate == 5e-3 and job.optim.learning_rate == 1e-2
    assert job.disc_optim.optim().adam_beta1 == 0.5  # the recipe's default for its discriminator
    with pytest.raises(ConfigError, match="disc_muon_momentum"):
        load_job_config(["--config", str(config), "--disc_muon_momentum", "0.5"], warn=lambda m: None)

    trainer = build_trainer(job)
    assert list(trainer.parts) == ["generator", "discriminator"]
    assert trainer.parts["discriminator"].optimizer.by_name["adamw"].param_groups[0]["betas"] == (0.5, 0.9)
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert {"loss", "grad_norm", "lr", "lr/discriminator", "grad_norm/discriminator", "loss/disc",
            "disc/logits_real", "disc/logits_fake"} <= set(rows[-1])
    # Each part follows its own schedule: the generator's constant, the discriminator's cosine.
    assert rows[-1]["lr"] == pytest.approx(1e-2) and rows[-1]["lr/discriminator"] < 5e-3

    ckpt = tmp_path / "run" / layout.checkpoint_name(STEPS)
    assert layout.saved_parts(ckpt) == ["generator", "discriminator"]
    for folder in ("generator", "generator_optimizer", "generator_ema", "discriminator",
                   "discriminator_optimizer", "discriminator_ema"):
        assert (ckpt / folder / layout.DCP_METADATA).is_file(), folder
    # `pan export` names the part it reads: the main one by default, any other with --part.
    assert main_export([str(ckpt), "--out", str(tmp_path / "g.safetensors")]) == 0
    assert main_export([str(ckpt), "--part", "discriminator", "--out", str(tmp_path / "d.safetensors")]) == 0
    assert main_export([str(ckpt), "--part", "vae", "--out", str(tmp_path / "x.safetensors")]) == 2
    from safetensors.torch import load_file
    assert torch.equal(load_file(str(tmp_path / "d.safetensors"))["fc2.weight"],
                       trainer.parts["discriminator"].model.fc2.weight.detach())


def test_a_checkpoint_of_other_parts_is_refused_naming_them(tmp_path, capsys):
    config = write_config(tmp_path / "toy.yaml", tmp_path / "run")
    job = load_job_config(["--config", str(config), "--max_steps", "2"], warn=lambda m: None)
    build_trainer(job).fit()
    alone = load_job_config(["--config", str(config), "--toy_discriminator", "false"], warn=lambda m: None)
    with pytest.raises(ConfigError) as err:
        build_trainer(alone)
    assert "['generator', 'discriminator']" in str(err.value) and "not in this run: ['discriminator']" in str(err.value)
    assert train(alone) == 2
    assert "not in this run: ['discriminator']" in capsys.readouterr().err


# -- SIGKILL and resume on 2 processes -------------------------------------------------------------

def final_state(output_dir: Path) -> dict:
    ckpt = output_dir / layout.checkpoint_name(STEPS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {folder: consolidated_weights(ckpt / folder)
                for part in layout.saved_parts(ckpt) for folder in layout.part_dirs(part)}


def test_two_parts_are_killed_and_resumed_bit_identically(tmp_path):
    plugin = {"PAN_RECIPE_MODULES": "pan_toy_gan"}
    straight = write_config(tmp_path / "straight.yaml", tmp_path / "straight")
    run_to_end(straight, tmp_path / "straight.log", **plugin)

    killed_dir = tmp_path / "killed"
    killed = write_config(tmp_path / "killed.yaml", killed_dir, model={"toy_step_sleep": 0.4})
    log = tmp_path / "killed.log"
    # SIGKILL both ranks once step 5 is logged: checkpoint-4 is the latest, step 5 is lost.
    kill_after_step(launch(killed, log, **plugin), killed_dir, 5, log)
    assert [s for s in map(layout.step_of, layout.complete_checkpoints(killed_dir))][-1] < STEPS
    run_to_end(killed, log, **plugin)
    assert "resuming from checkpoint-" in log.read_text()

    reference, resumed = final_state(tmp_path / "straight"), final_state(killed_dir)
    assert set(reference) == set(resumed) == {
        "generator", "generator_optimizer", "generator_ema",
        "discriminator", "discriminator_optimizer", "discriminator_ema"}
    for folder in reference:
        for key, value in reference[folder].items():
            assert torch.equal(value, resumed[folder][key]), (folder, key)
    assert consumed(tmp_path / "straight") == consumed(killed_dir)


# -- the recipe's workflow and preflight check through the CLI -----------------------------------

def test_a_recipes_workflow_is_listed_accepted_and_matched_to_its_recipe(tmp_path, capsys, monkeypatch):
    from pan.launch_command import main_launch_command

    monkeypatch.chdir(ROOT)
    config = write_config(tmp_path / "toy.yaml", tmp_path / "run")
    assert main_launch_command(["--workflow", "toy-gan", "--nodes", "1", "--gpus-per-node", "2",
                                "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "recipe toy_gan" in out and "scripts/toy_gan.sh" in out
    # A Pan workflow with this config, and the toy workflow with a Pan config, are refused.
    assert main_launch_command(["--workflow", "pretrain", "--nodes", "1", "--gpus-per-node", "1",
                                "--config", str(config)]) == 2
    assert "workflow pretrain trains the pan recipe" in capsys.readouterr().err
    csv = tmp_path / "clips.csv"
    csv.write_text("path,caption\nclip.mp4,a clip\n")
    assert main_launch_command(["--workflow", "toy-gan", "--nodes", "1", "--gpus-per-node", "1",
                                "--config", "config/tiny_cpu.yaml", "--video_csv_paths", str(csv)]) == 2
    assert "workflow toy-gan trains the toy_gan recipe" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main_launch_command(["--help"])
    assert "toy-gan" in capsys.readouterr().out


def test_a_recipes_preflight_check_runs_for_its_jobs(tmp_path, capsys):
    from pan.preflight import main_check

    config = write_config(tmp_path / "toy.yaml", tmp_path / "run", model={"toy_samples": 5})
    assert main_check(["--config", str(config), "--gpus-per-node", "2"]) == 1   # 5 < 3 x 2 ranks
    out = capsys.readouterr().out
    assert "toy data" in out and "toy_samples >= 6" in out
    assert main_check(["--config", str(config), "--gpus-per-node", "1"]) == 0
