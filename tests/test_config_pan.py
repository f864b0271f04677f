"""The Pan recipe's config: real YAML files, rejected through a real `python train.py` subprocess."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pan.cli import cmd_train
from pan.config import ConfigError, dump_job, load_job_config
from pan.config.docs import render

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def base(tmp_path):
    """The tiny CPU config, pointed at a data CSV and output dir inside tmp_path."""
    (tmp_path / "train.csv").write_text("path,caption\nclip.mp4,a red square moving left\n")
    cfg = yaml.safe_load((REPO / "config/tiny_cpu.yaml").read_text())
    cfg["data"]["video_csv_paths"] = [str(tmp_path / "train.csv")]
    cfg["output"]["output_dir"] = str(tmp_path / "run")
    return cfg


def write(tmp_path, cfg, text_after: str = "") -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False) + text_after)
    return path


def train_py(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "train.py", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def edit(cfg, section, key, value):
    cfg.setdefault(section, {})[key] = value
    return cfg


REJECTIONS = [
    # (change to the config, key named in the message, words of the fix)
    (lambda c: edit(c, "training", "learning_rat", 1e-3), "learning_rat", "Did you mean `learning_rate`"),
    (lambda c: edit(c, "model", "transformer_config_overrides",
                    {**c["model"]["transformer_config_overrides"], "zero_init_modulation": True}),
     "transformer_config_overrides.zero_init_modulation", "move it out"),
    (lambda c: edit(c, "training", "legacy_eager_mode", False), "legacy_eager_mode", "not supported"),
    (lambda c: edit(c, "model", "pretrained_transformer_path", "weights.pt"),
     "pretrained_transformer_path", "load_transformer_weights: true"),
    (lambda c: edit(c, "distributed", "cp_size", 3), "cp_size", "divisible by cp_size"),
    (lambda c: edit(c, "output", "report_to", "wandbb"), "report_to", "Did you mean 'wandb'"),
    (lambda c: edit(c, "diffusion", "flow_snr_type", "logit"), "flow_snr_type", "is not one of"),
    (lambda c: edit(c, "diffusion", "train_timestep_shift_mode", "auto"), "train_timestep_shift_mode",
     "is not one of"),
    (lambda c: edit(c, "training", "lr_scheduler_type", "step"), "lr_scheduler_type", "is not one of"),
    (lambda c: edit(c, "training", "dtype", "fp16"), "dtype", "is not one of"),
    (lambda c: edit(c, "training", "max_steps", 0), "max_steps", ">= 1"),
    (lambda c: edit(c, "data", "max_tokens_per_batch", -5), "max_tokens_per_batch", "> 0"),
    (lambda c: edit(c, "tasks", "cfg_drop_prob", 1.5), "cfg_drop_prob", "<= 1"),
    (lambda c: edit(c, "model", "transformer_config_overrides",
                    {**c["model"]["transformer_config_overrides"], "text_embed_dim": 128}),
     "transformer_config_overrides.text_embed_dim", "gives 384-wide features"),
]


@pytest.mark.parametrize("change,key,words", REJECTIONS, ids=[r[1] for r in REJECTIONS])
def test_training_rejects_with_exit_code_2(tmp_path, base, change, key, words, capsys):
    """train.py's own entry point, in this process (a subprocess each costs seconds of imports:
    the next test runs train.py itself once)."""
    path = write(tmp_path, change(base))
    with pytest.raises(SystemExit) as exited:
        cmd_train(["--config", str(path)])
    stderr = capsys.readouterr().err
    assert exited.value.code == 2, stderr
    assert f"`{key}`" in stderr and words in stderr, stderr
    assert "Traceback" not in stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_train_py_rejects_with_exit_code_2(tmp_path, base):
    change, key, words = REJECTIONS[0]
    result = train_py("--config", write(tmp_path, change(base)))
    assert result.returncode == 2, result.stderr
    assert f"`{key}`" in result.stderr and words in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_every_independent_problem_is_reported_in_one_run(tmp_path, base):
    """One launch lists them all: a typo, a bad enum, a bound inside the architecture overrides and
    a bad command-line value, from four different components."""
    edit(base, "training", "learning_rat", 1e-3)
    edit(base, "diffusion", "flow_snr_type", "logit")
    base["model"]["transformer_config_overrides"]["mlp_ratio"] = 0
    result = train_py("--config", write(tmp_path, base), "--max_steps", "zero")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "4 problems" in result.stderr, result.stderr
    for key in ("learning_rat", "flow_snr_type", "transformer_config_overrides.mlp_ratio", "max_steps"):
        assert f"`{key}`" in result.stderr, (key, result.stderr)
    assert "run.yaml:" in result.stderr  # each still points at its line


def test_cross_key_rules_of_different_components_are_reported_together(tmp_path, base):
    edit(base, "distributed", "cp_size", 3)
    edit(base, "model", "pretrained_transformer_path", "weights.pt")
    with pytest.raises(ConfigError) as info:
        load_job_config(["--config", str(write(tmp_path, base))], warn=lambda m: None)
    assert "`cp_size`" in str(info.value) and "`pretrained_transformer_path`" in str(info.value)


def test_key_in_two_sections_names_both_lines(tmp_path, base):
    path = write(tmp_path, base, "extra:\n  learning_rate: 0.1\n")
    result = train_py("--config", path)
    assert result.returncode == 2 and "set twice" in result.stderr
    assert "run.yaml:" in result.stderr


def test_command_line_override_is_checked_too(tmp_path, base):
    result = train_py("--config", write(tmp_path, base), "--cp_size", "3")
    assert result.returncode == 2 and "`cp_size`" in result.stderr


def test_overrides_beat_the_file_and_nest(tmp_path, base):
    job = load_job_config(["--config", str(write(tmp_path, base)), "--learning_rate", "1e-5",
                           "--transformer_config_overrides.num_layers", "2",
                           "--transformer_config_overrides", '{"mlp_ratio": 2.0}'], warn=lambda m: None)
    assert job.optim.learning_rate == 1e-5
    assert job.model.transformer_config_overrides.num_layers == 2
    assert job.model.transformer_config_overrides.mlp_ratio == 2.0
    assert job.model.transformer_config_overrides.hidden_size == 64  # the file's value is kept


def test_legacy_architecture_names_load_with_one_warning_each(tmp_path, base):
    arch = base["model"]["transformer_config_overrides"]
    arch["heads_num"] = arch.pop("num_attention_heads")
    arch["mm_double_blocks_depth"] = arch.pop("num_layers")
    arch["rope_dim_list"] = arch.pop("rope_axes_dim")
    warnings = []
    job = load_job_config(["--config", str(write(tmp_path, base))], warn=warnings.append)
    got = job.model.transformer_config_overrides
    assert (got.num_attention_heads, got.num_layers, got.rope_axes_dim) == (4, 2, [4, 6, 6])
    assert len(warnings) == 3
    for new in ("num_attention_heads", "num_layers", "rope_axes_dim"):
        assert sum(new in w for w in warnings) == 1


def test_resolved_config_reproduces_the_run(tmp_path, base):
    job = load_job_config(["--config", str(write(tmp_path, base)), "--learning_rate", "3e-4",
                           "--transformer_config_overrides.num_layers", "2"], warn=lambda m: None)
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(dump_job(job))
    again = load_job_config(["--config", str(resolved)], warn=lambda m: None)
    assert again == job


def test_docs_config_md_is_current():
    assert (REPO / "docs/config.md").read_text() == render(), \
        "docs/config.md is stale: run `make docs` and commit it"


def test_production_configs_share_everything_but_init_data_and_output():
    pre = yaml.safe_load((REPO / "config/pretrain_29B_720p.yaml").read_text())
    sft = yaml.safe_load((REPO / "config/sft_29B_720p.yaml").read_text())
    differing = {(s, k) for s in pre for k in pre[s] if pre[s].get(k) != sft[s].get(k)}
    assert {s for s, _ in differing} == {"model", "data", "output"}
    assert {k for s, k in differing if s == "model"} == {"pretrained_transformer_path",
                                                         "load_transformer_weights"}


def test_production_architecture_has_29_2b_parameters():
    from pan.config.loader import build_dataclass
    from pan.models.pan_dit import PanDiTConfig, PanVideoDiffusionTransformer

    raw = yaml.safe_load((REPO / "config/pretrain_29B_720p.yaml").read_text())
    arch = build_dataclass(PanDiTConfig, raw["model"]["transformer_config_overrides"])
    with torch.device("meta"):
        model = PanVideoDiffusionTransformer(arch)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - 29.2e9) < 0.3e9, count
