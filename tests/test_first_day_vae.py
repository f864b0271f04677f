"""The causal VAE's two stages from the shipped YAMLs, without editing them (issue 29), through
`pan launch-command`: overrides reach every stage, `--stage<NAME>.<key>` only one, `--config
STAGE=YAML` replaces one stage's YAML; chained stages may not share an output_dir and the second
must start from the checkpoint the first writes last; a lone stage 2 needs a warm start that
exists. Each refusal: exit 2, the key, the fix, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from pan.launch_command import main_launch_command
from pan.models.lpips import LPIPS
from pyramid_reference import needs_reference
from pyramid_tiny import FIXTURE_VAE

REPO = Path(__file__).resolve().parents[1]
BASE = ["--workflow", "causal-video-vae", "--nodes", "1", "--gpus-per-node", "2"]


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    """One real clip long enough for stage 2's 33-frame windows (launch-command decodes a sample of
    the data, as `pan check` does)."""
    from pan.data.synth import main as synth
    out = tmp_path_factory.mktemp("videos")
    assert synth(["--out", str(out), "--num-train", "1", "--num-heldout", "1", "--size", "32",
                  "--num-frames", "33", "--fps", "24"]) in (0, None)
    return out / "train.csv"


@pytest.fixture
def shared(tmp_path, videos) -> list[str]:
    """What both stages take from the command line: the released folder, LPIPS weights and videos."""
    lpips = tmp_path / "vgg_lpips.pth"
    torch.save(LPIPS().state_dict(), lpips)
    return ["--model_path", str(FIXTURE_VAE), "--lpips_ckpt", str(lpips), "--video_csv_paths", f"[{videos}]",
            "--max_steps", "4000"]


def launch(capsys, *args: str) -> tuple[int, str, str]:
    code = main_launch_command([*BASE, *args])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, captured.err


@needs_reference
def test_both_stages_from_the_shipped_yamls_with_per_stage_overrides(tmp_path, shared, capsys):
    one, two = tmp_path / "s1", tmp_path / "s2"
    stage1 = ["--stage1.image_tar_paths", "[]", "--stage1.image_sample_prob", "0", "--stage1.output_dir", str(one)]
    # Stage 2's YAML starts from the shipped stage 1's last checkpoint, not this run's.
    code, _, err = launch(capsys, "--stage", "both", *shared, *stage1, "--stage2.output_dir", str(two))
    assert code == 2 and "`warm_start_checkpoint`" in err and str(one / "checkpoint-4000") in err, err
    code, out, err = launch(capsys, "--stage", "both", *shared, *stage1, "--stage2.output_dir", str(two),
                            f"--stage2.warm_start_checkpoint={one / 'checkpoint-4000'}")
    assert code == 0, err
    first, second = out.split("# ---- stage 2 ----")
    assert f"--output_dir {one}" in first and str(two) not in first and "--image_sample_prob 0" in first
    assert f"--output_dir {two}" in second and f"--warm_start_checkpoint={one / 'checkpoint-4000'}" in second
    assert "--max_steps 4000" in first and "--max_steps 4000" in second          # shared overrides: both
    # One output_dir for both stages: stage 2 would resume stage 1.
    code, _, err = launch(capsys, "--stage", "both", *shared, "--stage1.image_tar_paths", "[]",
                          "--stage1.image_sample_prob", "0", "--output_dir", str(one))
    assert code == 2 and "`output_dir`" in err and "stage 2" in err and "--stage<NAME>.output_dir" in err, err
    # A key of a stage that is not printed, or of no stage.
    code, _, err = launch(capsys, "--stage", "1", *shared, *stage1, "--stage2.output_dir", str(two))
    assert code == 2 and "--stage2" in err
    code, _, err = launch(capsys, "--stage", "both", *shared, "--stage3.output_dir", str(two))
    assert code == 2 and "'3'" in err


@needs_reference
def test_a_stage_yaml_of_ones_own_and_a_missing_warm_start(tmp_path, shared, capsys):
    mine = yaml.safe_load((REPO / "config" / "causal_vae_stage1.yaml").read_text())
    mine["data"].update(image_tar_paths=[], image_sample_prob=0.0)
    mine["output"]["output_dir"] = str(tmp_path / "mine1")
    config = tmp_path / "my_stage1.yaml"
    config.write_text(yaml.safe_dump(mine))
    code, _, err = launch(capsys, "--stage", "both", "--config", str(config), *shared)
    assert code == 2 and "`config`" in err and "STAGE=YAML" in err, err
    last = tmp_path / "mine1" / "checkpoint-4000"
    code, out, err = launch(capsys, "--stage", "both", "--config", f"1={config}", *shared,
                            "--stage2.output_dir", str(tmp_path / "s2"), "--stage2.warm_start_checkpoint", str(last))
    assert code == 0, err
    assert str(config) in out.split("# ---- stage 2 ----")[0] and "causal_vae_stage2.yaml" in out
    # Stage 2 alone: its warm start must exist now.
    code, _, err = launch(capsys, "--stage", "2", *shared, "--output_dir", str(tmp_path / "s2"),
                          "--warm_start_checkpoint", str(last))
    assert code == 2 and "`warm_start_checkpoint`" in err and "does not exist" in err, err
