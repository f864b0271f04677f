"""`pan launch-command`: the printed commands, the refusals, and printed commands run for real: one
trains, one is refused and exits with the ranks' status (2), not torchrun's 1."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import free_port
from pan.checkpoint import layout
from pan.checkpoint.lease import RunLease, this_process
from pan.data.synth import synth_dataset
from pan.launch_command import main_launch_command

REPO = Path(__file__).resolve().parents[1]
DEMO = "config/tiny_cpu.yaml"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return synth_dataset(tmp_path_factory.mktemp("synth"), num_train=8, num_heldout=2)["train_csv"]


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # commands name repository-relative paths, as the launch scripts do


def tiny(tmp_path: Path, csv: Path) -> list[str]:
    """Overrides that make the demo config a 2-step, 1-layer run on the synthetic data."""
    return ["--video_csv_paths", str(csv), "--output_dir", str(tmp_path / "run"), "--max_steps", "2",
            "--warmup_steps", "0", "--transformer_config_overrides.num_layers", "1",
            "--max_samples_per_batch", "2", "--packed_dataloader_num_workers", "0"]


def printed(capsys, *argv: str) -> tuple[int, list[str], str]:
    code = main_launch_command(list(argv))
    out, err = capsys.readouterr()
    return code, [line for line in out.splitlines() if line and not line.startswith("#")], err


def test_single_node_prints_torchrun_and_sbatch(tmp_path, data, capsys):
    code, lines, _ = printed(capsys, "--workflow", "pretrain", "--nodes", "1", "--gpus-per-node", "2",
                             "--config", DEMO, *tiny(tmp_path, data))
    assert code == 0
    torchrun, sbatch = lines
    assert shlex.split(torchrun)[:9] == ["python", "-m", "pan.launch_command", "torchrun", "--nnodes=1",
                                         "--nproc_per_node=2", "--master_port=29500",
                                         "--master_addr=127.0.0.1", "--node_rank=0"]
    assert shlex.split(torchrun)[9:] == ["train.py", "--config", DEMO, *tiny(tmp_path, data)]
    assert shlex.split(sbatch) == ["PAN_NPROC_PER_NODE=2", "sbatch", "--nodes=1", "scripts/pretrain.sh",
                                   DEMO, *tiny(tmp_path, data)]


def test_multi_node_prints_srun_with_per_node_rank(tmp_path, data, capsys):
    spaced = tmp_path / "my run"
    code, lines, _ = printed(capsys, "--workflow", "pretrain", "--nodes", "3", "--gpus-per-node", "4",
                             "--config", DEMO, "--video_csv_paths", str(data), "--cp_size", "2",
                             "--hybrid_shard", "true", "--output_dir", str(spaced))
    assert code == 0
    torchrun, export, srun, sbatch = lines
    assert '"--node_rank=$SLURM_NODEID"' in torchrun and '"--master_addr=$MASTER_ADDR"' in torchrun
    assert export.startswith("export MASTER_ADDR=") and "scontrol show hostnames" in export
    words = shlex.split(srun)
    assert words[:5] == ["srun", "--nodes=3", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                         "--cpu-bind=none"]
    assert words[5:8] == ["bash", "-c",
                          'exec "$0" -m pan.launch_command torchrun --node_rank="$SLURM_NODEID" "$@"']
    assert words[8:10] == ["python", "--nnodes=3"] and str(spaced) in words  # quoted as one word
    assert shlex.split(torchrun)[:4] == ["python", "-m", "pan.launch_command", "torchrun"]
    assert shlex.split(sbatch)[:3] == ["PAN_NPROC_PER_NODE=4", "sbatch", "--nodes=3"]


@pytest.mark.parametrize("extra, gpus, reason", [
    (["--cp_size", "4"], 2, "does not divide the 2 processes per node"),
    (["--cp_size", "3"], 3, "num_attention_heads (4) must be divisible by cp_size (3)"),
    (["--hybrid_shard", "true", "--data_parallel_mode", "ddp"], 2, "hybrid_shard"),
    (["--no_such_key", "1"], 2, "unknown key"),
])
def test_invalid_layouts_are_refused_with_the_reason(tmp_path, data, capsys, extra, gpus, reason):
    code, lines, err = printed(capsys, "--workflow", "pretrain", "--nodes", "2", "--gpus-per-node",
                               str(gpus), "--config", DEMO, "--video_csv_paths", str(data), *extra)
    assert code == 2 and lines == []
    assert reason in err


def test_sft_needs_a_warm_start(tmp_path, data, capsys):
    code, _, err = printed(capsys, "--workflow", "sft", "--nodes", "1", "--gpus-per-node", "1",
                           "--config", DEMO, "--video_csv_paths", str(data))
    assert code == 2 and "load_transformer_weights" in err and "sft workflow" in err


def test_default_yaml_is_the_workflows(capsys):
    """Without --config the workflow's production YAML is validated (its model and data paths do not
    exist on a test machine, so it is refused, naming the file)."""
    code, _, err = printed(capsys, "--workflow", "sft", "--nodes", "2", "--gpus-per-node", "8")
    assert code == 2 and "config/sft_29B_720p.yaml" in err


def test_lora_keys_pass_through_to_every_command_and_are_validated(tmp_path, data, capsys):
    """The `lora` keys are train.py overrides like any other: carried into the torchrun and sbatch
    lines as given, and checked first (LoRA with Muon, an unknown target linear: refused, exit 2)."""
    lora = ["--lora_rank", "8", "--lora_alpha", "16", "--lora_target_modules", "[video_qkv.qkv,video_out]",
            "--use_muon", "false"]
    code, lines, err = printed(capsys, "--workflow", "pretrain", "--nodes", "1", "--gpus-per-node", "2",
                               "--config", DEMO, *tiny(tmp_path, data), *lora)
    assert code == 0, err
    torchrun, sbatch = lines
    assert shlex.split(torchrun)[-len(lora):] == lora and shlex.split(sbatch)[-len(lora):] == lora
    code, lines, err = printed(capsys, "--workflow", "pretrain", "--nodes", "1", "--gpus-per-node", "2",
                               "--config", DEMO, *tiny(tmp_path, data), "--lora_rank", "8")
    assert code == 2 and lines == [] and "use_muon" in err
    code, lines, err = printed(capsys, "--workflow", "pretrain", "--nodes", "1", "--gpus-per-node", "2",
                               "--config", DEMO, *tiny(tmp_path, data), *lora[:4], "--lora_target_modules",
                               "[video_no_such_linear]", "--use_muon", "false")
    assert code == 2 and lines == [] and "video_no_such_linear" in err


def test_what_pan_check_fails_for_the_job_is_refused(tmp_path, data, capsys):
    """`pan check`'s rows of the job run for the planned layout (issue 29): a data source whose clips
    do not decode is refused with the `data` row's words, as `pan check` says them; so is a model
    that does not fit the --device-memory given. Without that flag and without a GPU here, the memory
    row can only plan for this machine, so it warns."""
    from pan.preflight import main_check
    broken = tmp_path / "broken.csv"
    broken.write_text("path,caption\nno_such_clip.mp4,a red square moving left\n")
    args = ["--config", DEMO, *tiny(tmp_path, data), "--video_csv_paths", str(broken)]
    assert main_check([*args, "--gpus-per-node", "2"]) == 1
    table = capsys.readouterr().out
    assert "no_such_clip.mp4" in table
    code, lines, err = printed(capsys, "--workflow", "pretrain", "--nodes", "1", "--gpus-per-node", "2", *args)
    assert code == 2 and lines == [] and "data: " in err and "no_such_clip.mp4" in err, err

    huge = ["--config", DEMO, *tiny(tmp_path, data), "--transformer_config_overrides.hidden_size", "8192",
            "--transformer_config_overrides.num_attention_heads", "512"]
    code, lines, err = printed(capsys, "--workflow", "pretrain", "--nodes", "1", "--gpus-per-node", "2", *huge,
                               "--device-memory", "1")
    assert code == 2 and lines == [] and "memory: " in err and "does not fit" in err, err
    code, lines, err = printed(capsys, "--workflow", "pretrain", "--nodes", "1", "--gpus-per-node", "2", *huge)
    assert code == 0 and len(lines) == 2, err
    assert "warning: memory:" in err and "--device-memory" in err, err


def test_printed_torchrun_command_trains(tmp_path, data, capsys):
    """The printed single-node command, run as printed: 2 gloo processes train 2 steps, exit 0."""
    code, lines, _ = printed(capsys, "--workflow", "pretrain", "--nodes", "1", "--gpus-per-node", "2",
                             "--config", DEMO, "--master-port", str(free_port()), *tiny(tmp_path, data))
    assert code == 0
    torchrun = lines[0]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    run = subprocess.run(["bash", "-c", torchrun], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=240, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert layout.complete_checkpoints(tmp_path / "run") == [tmp_path / "run" / "checkpoint-2"]
    meta = layout.read_json(tmp_path / "run" / "checkpoint-2" / layout.META)
    assert meta["world_size"] == 2 and meta["dp_size"] == 2


def test_printed_torchrun_command_exits_with_the_ranks_status(tmp_path, data, capsys):
    """The printed single-node command on an output_dir whose lease another run holds (this process):
    both ranks refuse, and the command exits 2 (do not retry), where torchrun alone says 1."""
    out = tmp_path / "run"
    holder = RunLease(out, timeout=3600, processes=[this_process()])
    holder.acquire()
    try:
        code, lines, _ = printed(capsys, "--workflow", "pretrain", "--nodes", "1", "--gpus-per-node", "2",
                                 "--config", DEMO, "--master-port", str(free_port()), *tiny(tmp_path, data))
        assert code == 0
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        run = subprocess.run(["bash", "-c", lines[0]], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=240, check=False)
    finally:
        holder.release()
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    assert "is in use by the run started" in run.stderr and "pan launch: status 2 (rank" in run.stderr
    assert not list(out.glob("checkpoint-*"))


def test_every_problem_it_can_judge_is_refused_at_once_with_its_fix(tmp_path, capsys):
    """Issue 52, item 7: a causal VAE launch with three independent problems (a data path that does
    not exist, a max_frames the VAE cannot encode, a context group of 4 on 6 processes per node) lists
    all three in one refusal, each with its `fix:` line as `pan check` gives it, exit 2 (not one a
    round: the path, then the frame rule, then the layout)."""
    code, lines, err = printed(capsys, "--workflow", "causal-video-vae", "--nodes", "1", "--gpus-per-node", "6",
                               "--config", "config/causal_vae_tiny.yaml", "--output_dir", str(tmp_path / "run"),
                               "--video_csv_paths", str(tmp_path / "no_such.csv"), "--max_frames", "18",
                               "--context_size", "4")
    assert code == 2 and lines == [], err
    assert "refused (3 problems" in err, err
    problems = [line for line in err.splitlines() if line.startswith("  - ")]
    fixes = [line for line in err.splitlines() if line.startswith("    fix: ")]
    assert len(problems) == 3 and len(fixes) == 3, err
    said = "\n".join(problems)
    assert "`video_csv_paths`" in said and "no_such.csv does not exist" in said, err
    assert "`max_frames`" in said and "1 + 4k frames" in said, err
    assert "`context_size`" in said and "must divide the world size (6)" in said, err
    assert "17 or 21" in err and "context_size that divides 6" in err and f"remove {tmp_path / 'no_such.csv'}" in err
