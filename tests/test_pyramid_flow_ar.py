"""The `pyramid_flow_ar` recipe (autoregressive temporal-pyramid training) end to end on CPU.

- Against the original's fixtures, through the recipe: the fixture's raw latents and caption
  features go through the task (window, stages, the sync slot's units, temporal-pyramid noising
  and history, packing with the causal rule and interpolated positions) and the released miniFLUX
  gives the original's outputs and loss. Noising is exact (the recorded draws replayed); outputs and
  the loss within atol=1e-5, rtol=1e-4 (the fixture README's tolerance for fp32 DiT numbers).
- Sync groups on real gloo groups: every unit of every video trained exactly once per group (2 and
  4 ranks, 2 ranks x 2 micro-batches, mixed clip lengths), and the same update from 1 rank x 4
  micro-batches, 2 x 2 and 4 x 1.
- A tiny run (2 processes, sync group 2) whose loss falls, SIGKILLed and resumed bit-identically
  through scripts/train_pyramid_flow.sh under the local Slurm; the fixture checkpoint folder trained
  through the fixture causal VAE and exported with the run's switches; `pan sample` unit by unit;
  the invariants at config load, in `pan check` and in `pan launch-command`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

from dist_utils import run_distributed
from pan.config import ConfigError
from pan.data.batch import RawBatch, Sample
from pan.data.synth import synth_dataset
from pan.models.attention import set_attention_backend
from pan.models.pyramid_flux import PyramidFluxTransformer
from pan.models.pyramid_io import load_pretrained, read_weights
from pan.parallel.dims import ParallelDims
from pan.parallel.world import World
from pan.recipes.pyramid_flow_ar.task import PyramidFlowARTask
from pyramid_reference import latent_channels, load_fixture, needs_reference
from pyramid_tiny import (FIXTURE_DIT, FIXTURE_VAE, VAE_CLIP_DATA, VARIANT, batch_loss, causal_vae_keys,
                          final_weights, load, released_config)
from pyramid_tiny import fixture_model_path_fixture, released_fixture, vae_videos_fixture  # noqa: F401
from slurm_cluster import slurm_cluster  # noqa: F401 - the local Slurm, started once per session

TOL = dict(atol=1e-5, rtol=1e-4)   # fp32 DiT outputs and loss against the fixtures (README section 1)


# ------------------------------------------------------------------------------------------------
# Model folders, data and configs
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """Synthetic 16x16 clips: 4-frame ones, and 2-frame ones for mixed lengths."""
    root = tmp_path_factory.mktemp("synth_ar")
    long = synth_dataset(root / "long", num_train=8, num_heldout=1, size=16, num_frames=4)["train_csv"]
    short = synth_dataset(root / "short", num_train=4, num_heldout=1, size=16, num_frames=2)["train_csv"]
    (root / "short.csv").write_text(short.read_text().replace("train/", "short/train/"))
    return {"long": long, "mixed": [long, root / "short.csv"]}


def write_config(path: Path, model_path: Path, videos, output_dir: Path, **sections) -> Path:
    cfg = {"recipe": "pyramid_flow_ar",
           "model": {"model_name": "pyramid_flux", "model_path": str(model_path), "vae_type": "identity",
                     **sections.pop("model", {})},
           "autoregressive": {"frame_per_unit": 1, "video_sync_group": 2, **sections.pop("autoregressive", {})},
           "training": {"learning_rate": 2e-3, "max_steps": 4, "dtype": "fp32", "use_muon": False,
                        **sections.pop("training", {})},
           "data": {"video_csv_paths": [str(v) for v in (videos if isinstance(videos, list) else [videos])],
                    "resolution_buckets": ["16x16"], "min_frames": 1, "max_frames": 4, "frames_mod": 1,
                    "frames_remainder": 0, "max_tokens_per_batch": 1000, "max_samples_per_batch": 4,
                    "packed_dataloader_num_workers": 0, **sections.pop("data", {})},
           "output": {"output_dir": str(output_dir), "save_interval": 2, "log_interval": 1,
                      "progress_bar": False, **sections.pop("output", {})},
           **sections}
    path.write_text(yaml.safe_dump(cfg))
    return path


def task_of(job, world_size: int = 1, rank: int = 0) -> PyramidFlowARTask:
    world = World.planned(world_size, rank=rank)
    return PyramidFlowARTask(job, world, ParallelDims.from_config(job.parallel, world_size, world_size))


# ------------------------------------------------------------------------------------------------
# Against the original, through the recipe
# ------------------------------------------------------------------------------------------------

class SampleDraws:
    """The fixture's per-column draws served sample by sample, in the order the recipe draws them
    (per sample: the trained unit's noise, its table index, the corruption level, the history)."""

    def __init__(self, tensors: dict, sidecar: dict, units_of_sample: list[int], columns: int):
        per_column: dict[int, list] = {}
        for d in sidecar["random_draws"][1:]:
            per_column.setdefault(d["column"], []).append(tensors[d["tensor"]])
        noise = tensors[sidecar["random_draws"][0]["tensor"]]              # [B, C, T, H, W]
        fpu = sidecar["runner_settings"]["frame_per_unit"]
        self.queue = []
        for r, units in enumerate(units_of_sample):
            c, i = r % columns, r // columns
            end = 1 + (units - 1) * fpu                                    # the trained unit's frames
            self.queue.append(noise[r:r + 1, :, max(0, end - fpu):end])
            self.queue += [d[i:i + 1] for d in per_column[c]]

    def _next(self, shape) -> torch.Tensor:
        value = self.queue.pop(0)
        assert tuple(value.shape) == tuple(shape), (tuple(value.shape), tuple(shape))
        return value

    rand = randn = _next


def fixture_batch(noising: dict, dit: dict) -> RawBatch:
    """The fixture's 8 raw latents with the DiT case's caption features, as a loaded batch."""
    samples = []
    for r, raw in enumerate(noising["in.latent_raw"]):
        features = {"prompt_embed": dit["in.encoder_hidden_states"][r],
                    "prompt_attention_mask": dit["in.encoder_attention_mask"][r],
                    "pooled_prompt_embed": dit["in.pooled_projections"][r]}
        samples.append(Sample(f"fixture:{r}", "video", "caption", tuple(raw.shape[1:]), 0, raw_latent=raw,
                              text_features=features))
    return RawBatch(samples=samples, tokens=0, token_budget=1, skipped={})


def fixture_settings(sidecar: dict) -> dict:
    """The original runner's AR settings of the fixture's noising call (its JSON), and its batch:
    window (max_temporal_length), sync group, frame_per_unit, batch size, columns (sum of sample_ratios)."""
    extra, runner = sidecar["runner_extra"], sidecar["runner_settings"]
    return {"window": extra["max_temporal_length"], "group": extra["video_sync_group"],
            "frame_per_unit": runner["frame_per_unit"], "batch": sidecar["tensors"]["in.latent_raw"]["shape"][0],
            "columns": len(sidecar["column_to_stage"])}


def fixture_task(tmp_path, fixture_model_path, data, sidecar: dict, **model):
    """The task on 1 rank holding the fixture's whole sync group (one micro-batch per slot)."""
    f = fixture_settings(sidecar)
    config = write_config(tmp_path / "fx.yaml", fixture_model_path, data["long"], tmp_path / "run",
                          model=model,
                          autoregressive={"video_sync_group": f["group"], "frame_per_unit": f["frame_per_unit"]},
                          training={"gradient_accumulation_steps": f["group"]}, tasks={"cfg_drop_prob": 0.0},
                          data={"max_frames": f["window"], "max_samples_per_batch": f["batch"]})
    return task_of(load(config))


def fixture_model(task) -> PyramidFluxTransformer:
    """The fixture's weights in the DiT the task builds (its switches applied), on SDPA."""
    model = PyramidFluxTransformer(task.model.config)
    model.load_state_dict(read_weights(FIXTURE_DIT))
    set_attention_backend(model, "sdpa")
    return model


@needs_reference
def test_fixture_noising_history_and_forward_through_the_recipe(tmp_path, fixture_model_path, data):
    noising, sidecar = load_fixture("scheduler/noise_temporal_pyramid")
    dit, _ = load_fixture("flux_dit/case_b_temporal_pyramid")
    f = fixture_settings(sidecar)
    task = fixture_task(tmp_path, fixture_model_path, data, sidecar)
    # 1 rank x the whole group (the public set: window 8, 8 units, 4 slots)
    assert (task.window, task.units_max, task.plan.slots) == (
        f["window"], 1 + (f["window"] - 1) // f["frame_per_unit"], tuple(range(f["group"])))
    task.hold(fixture_batch(noising, dit))
    # Rank 0 of the group on its first batch: the original's first call (the public set: units [4, 4, 5]).
    units = task.slot_units(0)
    assert units == sidecar["sample_stage_length"]["result_units_per_stage"]
    columns = f["columns"]
    assert [h.stage for h in task.held] == [sidecar["column_to_stage"][r % columns] for r in range(f["batch"])]
    draws = SampleDraws(noising, sidecar, [units[h.stage] for h in task.held], columns=columns)
    inputs = task.prepare_slot(0, draws)
    assert not draws.queue
    assert inputs.sample_ids == [f"fixture:{r}#unit{units[h.stage]}" for r, h in enumerate(task.held)]
    assert torch.equal(inputs.timesteps, dit["in.timestep_ratio"])           # exact: the recorded draws

    model = fixture_model(task)
    out = model(inputs.x, inputs.timesteps, inputs.text, inputs.pooled, inputs.pack)
    start = 0
    for r, layout in enumerate(inputs.pack.layouts):
        c, i = r % columns, r // columns
        end = start + layout.video_len
        # The packed inputs are the original's column clips, oldest first, exactly.
        clips = sorted(k for k in noising if k.startswith(f"out.noisy.col{c}.clip"))
        got = torch.split(inputs.x[start:end], [clip.tokens for clip in layout.clips])
        for name, tokens, clip in zip(clips, got, layout.clips):
            assert torch.equal(model.unpatchify(tokens, clip.grid), noising[name][i]), (r, name)
        last = layout.clips[-1]
        assert torch.equal(model.unpatchify(inputs.target[end - last.tokens:end], last.grid),
                           noising[f"out.target.col{c}"][i])
        torch.testing.assert_close(model.unpatchify(out[end - last.tokens:end], last.grid), dit[f"out.col{c}"][i],
                                   **TOL, msg=f"column {c} sample {i}")
        start = end
    loss = task.loss_sum(model, inputs) / task.loss_count(inputs)
    torch.testing.assert_close(loss, dit["out.loss"], **TOL)


@needs_reference
def test_causal_and_interpolation_switches_change_the_layouts_and_the_output(tmp_path, fixture_model_path, data):
    noising, sidecar = load_fixture("scheduler/noise_temporal_pyramid")
    dit, _ = load_fixture("flux_dit/case_b_temporal_pyramid")
    columns = fixture_settings(sidecar)["columns"]
    # The last column (highest stage), sample 0: its clips' grids in tokens (2x2 patch), oldest first;
    # interpolated positions put each lower-resolution history clip on the trained clip's grid (the
    # public set: f0-1@s0, f2@s1, f3@s2, noisy f4@s2 -> [(4, 8), (4, 8), None, None]).
    grids = [(shape[-2] // 2, shape[-1] // 2) for shape in sidecar["clip_structure"][columns - 1]]
    interpolated = [None if grid == grids[-1] else grids[-1] for grid in grids]
    assert any(interpolated), "the fixture's top-stage column has a lower-resolution history clip"
    outputs = {}
    for name, switches in (("released", {}), ("no_interp", {"interp_condition_pos": False}),
                           ("no_causal", {"use_temporal_causal": False})):
        task = fixture_task(tmp_path, fixture_model_path, data, sidecar, **switches)
        task.hold(fixture_batch(noising, dit))
        units = task.slot_units(0)
        inputs = task.prepare_slot(0, SampleDraws(noising, sidecar, [units[h.stage] for h in task.held], columns))
        top = inputs.pack.layouts[columns - 1]                              # the last column, sample 0
        refs = [clip.ref_hw for clip in top.clips]
        assert refs == ([None] * len(grids) if name == "no_interp" else interpolated), name
        assert top.attention == ("full" if name == "no_causal" else "block_causal"), name
        model = fixture_model(task)
        with torch.no_grad():
            outputs[name] = model(inputs.x, inputs.timesteps, inputs.text, inputs.pooled, inputs.pack)
    for name in ("no_interp", "no_causal"):
        assert (outputs[name] - outputs["released"]).abs().max() > 1e-3, name


# ------------------------------------------------------------------------------------------------
# Sync groups on real gloo groups: coverage and the same update on fewer ranks
# ------------------------------------------------------------------------------------------------

def read_units(config: Path, batches: int) -> dict:
    """This rank's plan and the sample ids (`<video>#unit<u>`) of its micro-batches over `batches`
    loader batches, through the task's own loader and next_batch (the model stays on meta)."""
    from pan.parallel.world import init_world

    job = load(config)
    world = init_world()
    dims = ParallelDims.from_config(job.parallel, world.size, world.local_size)
    task = PyramidFlowARTask(job, world, dims)
    task.load_encoders()
    loader = task.build_loader(dims)
    ids = [task.next_batch(loader)[0].sample_ids for _ in range(batches * len(task.plan.slots))]
    return {"plan": dataclasses.asdict(task.plan), "ids": ids}


def one_step(config: Path) -> dict:
    """The loss and the full gradients of one step's backward (the default train step's
    `backward_mean`), built by the trainer; and the (video, unit) pairs it trained."""
    from pan.task import StepContext
    from pan.trainer import build_trainer

    trainer = build_trainer(load(config))
    batches, _ = trainer.next_micro_batches()
    part = trainer.parts["transformer"]
    ctx = StepContext(trainer.parts, 0, "fp32", trainer.world.device)
    loss = ctx.backward_mean(part, batches, trainer.task.loss_sum, trainer.task.loss_count)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    grads = {n: full(p.grad).clone() for n, p in part.model.named_parameters()}
    return {"loss": loss, "grads": grads, "ids": sorted(i for b in batches for i in b.sample_ids)}


def fit(config: Path) -> None:
    from pan.trainer import build_trainer
    build_trainer(load(config)).fit()


def run_all(jobs: list[tuple]) -> list:
    """A spawned rank's work: several runs in one process group (spawns are the slow part)."""
    work = {"units": read_units, "step": one_step, "fit": fit}
    return [work[kind](*args) for kind, *args in jobs]


UNITS = {"train": 4, "short": 2}   # units of each data set's clips at max_frames 4, frame_per_unit 1


def ar_config(tmp_path: Path, name: str, released: Path, videos, **sections) -> Path:
    return write_config(tmp_path / f"{name}.yaml", released, videos, tmp_path / name, **sections)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, released, data):
    tmp = tmp_path_factory.mktemp("four_ranks")
    jobs = [("units", ar_config(tmp, "g4", released, data["mixed"], autoregressive={"video_sync_group": 4}), 3),
            # two groups of 2 ranks; units of 2 frames (frame 0, frames 1-2): 3-frame windows hold 2 units
            ("units", ar_config(tmp, "g2", released, data["mixed"], data={"max_frames": 3},
                                autoregressive={"video_sync_group": 2, "frame_per_unit": 2}), 3),
            ("step", ar_config(tmp, "4x1", released, data["long"], autoregressive={"video_sync_group": 4})),
            # dp 2 x Ulysses cp 2, 2 micro-batches: the same group, block-causal attention across ranks
            ("step", ar_config(tmp, "dp2cp2", released, data["long"], autoregressive={"video_sync_group": 4},
                               training={"gradient_accumulation_steps": 2}, distributed={"cp_size": 2}))]
    return run_distributed(run_all, world_size=4, args=(jobs,))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, released, data):
    tmp = tmp_path_factory.mktemp("two_ranks")
    two_by_two = {"autoregressive": {"video_sync_group": 4}, "training": {"gradient_accumulation_steps": 2}}
    jobs = [("units", ar_config(tmp, "g4_2x2", released, data["mixed"], **two_by_two), 3),
            ("step", ar_config(tmp, "2x2", released, data["long"], **two_by_two)),
            ("fit", straight_config(tmp, released, data))]
    return tmp, run_distributed(run_all, world_size=2, args=(jobs,))


def group_coverage(results: list[dict], index: int) -> dict[tuple[int, int], dict[str, list[int]]]:
    """(group, batch) -> video -> units trained by the group's slots, from every rank's ids."""
    out: dict = {}
    for rank_results in results:
        got = rank_results[index]
        plan, per_rank = got["plan"], len(got["plan"]["slots"])
        for m, ids in enumerate(got["ids"]):
            videos = out.setdefault((plan["loader_rank"], m // per_rank), {})
            for sample in ids:
                video, unit = sample.split("#unit")
                videos.setdefault(video, []).append(int(unit))
    return out


def assert_every_unit_once(coverage: dict, units_of) -> None:
    """Each clip of each batch has each of its units trained once by the group's slots (a clip
    read twice in one batch, at an epoch's end and the next one's start, twice)."""
    assert coverage
    for (group, batch), videos in coverage.items():
        for video, units in videos.items():
            times = len(units) // units_of(video)
            assert sorted(units) == sorted(list(range(1, units_of(video) + 1)) * times), (group, batch, video, units)


def test_every_unit_of_every_video_is_trained_once_per_sync_group(four_ranks, two_ranks):
    # 4 ranks, one group of 4 (units of max_frames 4 = 4): every unit of every clip, 4- and 2-unit
    # clips mixed, once per batch; the 4 ranks read the same videos (one data share).
    g4 = group_coverage(four_ranks, 0)
    assert_every_unit_once(g4, lambda video: UNITS[video.split(":")[0]])
    assert {r[0]["plan"]["loader_rank"] for r in four_ranks} == {0}
    # 4 ranks, two groups of 2; units of 2 frames in 3-frame windows: 4-frame clips hold 2 units,
    # 2-frame clips 1. The groups read disjoint shares.
    g2 = group_coverage(four_ranks, 1)
    assert_every_unit_once(g2, lambda video: 2 if video.startswith("train") else 1)
    assert [r[1]["plan"]["loader_rank"] for r in four_ranks] == [0, 0, 1, 1]
    for batch in range(3):
        assert not set(g2[(0, batch)]) & set(g2[(1, batch)])
    # 2 ranks x 2 micro-batches = a group of 4: the same coverage on half the ranks.
    _, results = two_ranks
    assert [tuple(r[0]["plan"]["slots"]) for r in results] == [(0, 1), (2, 3)]
    assert_every_unit_once(group_coverage(results, 0), lambda video: UNITS[video.split(":")[0]])


def test_a_group_over_micro_batches_makes_the_update_of_a_group_over_ranks(tmp_path, four_ranks, two_ranks,
                                                                              released, data):
    # 1 rank x 4 micro-batches, here in this process.
    one_by_four = one_step(ar_config(tmp_path, "1x4", released, data["long"],
                                     autoregressive={"video_sync_group": 4},
                                     training={"gradient_accumulation_steps": 4}))
    four_by_one = four_ranks[0][2]
    two_by_two = two_ranks[1][0][1]
    # The same (video, unit) pairs: the group's slots, wherever they run.
    assert sorted(i for r in four_ranks for i in r[2]["ids"]) == one_by_four["ids"]
    assert sorted(i for r in two_ranks[1] for i in r[1]["ids"]) == one_by_four["ids"]
    # The same samples, units, noise and caption drops; only the order in which the gradients of
    # the 4 micro-batches are summed differs (FSDP reduce-scatter vs accumulation in .grad; under
    # Ulysses also the attention's all-to-alls): equal to fp32 reduction order, i.e. within a few
    # ulps of the largest gradient (atol 1e-7, rtol 1e-5).
    for other in (four_by_one, two_by_two, four_ranks[0][3]):   # the last: dp 2 x cp 2 x 2 micro-batches
        assert other["loss"] == pytest.approx(one_by_four["loss"], rel=1e-6)
        for name, grad in one_by_four["grads"].items():
            torch.testing.assert_close(other["grads"][name], grad, atol=1e-7, rtol=1e-5, msg=name)
    assert max(g.abs().max() for g in one_by_four["grads"].values()) > 1e-3  # a gradient that matters


# ------------------------------------------------------------------------------------------------
# A tiny run: the loss falls; SIGKILL, then a resume through the launch script under Slurm
# ------------------------------------------------------------------------------------------------

STEPS = 16


def straight_config(tmp: Path, released: Path, data: dict, name: str = "straight") -> Path:
    return ar_config(tmp, name, released, data["long"], training={"max_steps": STEPS, "learning_rate": 3e-3},
                     output={"save_interval": 6})


def slurm_env(tmp_path: Path) -> dict[str, str]:
    import sys

    from dist_utils import free_port
    from slurm_cluster import REPO_ROOT, environ_outside_slurm
    env = environ_outside_slurm()
    env.update(PAN_ROOT=str(REPO_ROOT), PAN_PYTHON=sys.executable, PAN_NPROC_PER_NODE="2",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", TQDM_DISABLE="1",
               XDG_CACHE_HOME=str(tmp_path / "xdg"), PAN2_CACHE_ROOT=str(tmp_path / "pan2"))
    return env


def test_tiny_run_learns_and_a_killed_run_resumes_exactly_through_the_launch_script(tmp_path, request, two_ranks,
                                                                                     released, data):
    from launch_utils import consumed, kill_after_step, launch, run_to_end
    from slurm_cluster import slurm_installed

    tmp, _ = two_ranks
    straight = tmp / "straight"   # trained by the two_ranks fixture: 2 processes, sync group 2
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert len(losses) == STEPS and sum(losses[-6:]) < 0.8 * sum(losses[:6]), [round(x, 4) for x in losses]

    killed_dir = tmp_path / "killed"
    config = straight_config(tmp_path, released, data, name="killed")
    log = tmp_path / "killed.log"
    kill_after_step(launch(config, log), killed_dir, 8, log)                # SIGKILL after the save of step 6
    if slurm_installed():  # the resume goes through scripts/train_pyramid_flow.sh under the local Slurm
        from slurm_cluster import REPO_ROOT
        cluster = request.getfixturevalue("slurm_cluster")
        job_log = tmp_path / "resume.out"
        result = cluster.sbatch_wait(REPO_ROOT / "scripts" / "train_pyramid_flow.sh", [str(config)],
                                     env=slurm_env(tmp_path), cwd=tmp_path, output=job_log, timeout=240)
        text = cluster.job_log(job_log)
        assert result.returncode == 0, result.stderr + text
        assert f"--config {config}" in text and "--nproc_per_node=2" in text
    else:
        run_to_end(config, log)
        text = log.read_text()
    assert "resuming from checkpoint-" in text
    reference, resumed = final_weights(straight, STEPS), final_weights(killed_dir, STEPS)
    for folder in reference:
        for key, value in reference[folder].items():
            assert torch.equal(value, resumed[folder][key]), (folder, key)
    assert consumed(straight) == consumed(killed_dir)   # the same (video, unit) pairs, step by step


def test_a_checkpoint_of_two_ranks_continues_on_one_exactly(tmp_path, two_ranks, released, data):
    """Elastic: checkpoint-6 of the 2-rank run (one sync group of 2 slots on 2 ranks) continues on 1
    process x 2 micro-batches (the same group on 1 rank): every step trains the same (video, unit)
    pairs with the same draws, and the loss is the 2-rank run's within floating-point noise."""
    import shutil

    from launch_utils import assert_continues_the_run
    from pan.logging import get_logger
    from pan.trainer import build_trainer

    tmp, _ = two_ranks
    out = tmp_path / "elastic"
    shutil.copytree(tmp / "straight" / "checkpoint-6", out / "checkpoint-6")
    config = ar_config(tmp_path, "elastic", released, data["long"],
                       training={"max_steps": STEPS, "learning_rate": 3e-3, "gradient_accumulation_steps": 2},
                       output={"save_interval": 6})
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    get_logger().addHandler(handler)
    try:
        build_trainer(load(config)).fit()
    finally:
        get_logger().removeHandler(handler)
    assert any("each of the 1 data shards continues exactly" in r.getMessage() for r in records)
    assert_continues_the_run(tmp / "straight", out, first_step=7, last_step=STEPS)


@needs_reference
def test_the_fixture_checkpoint_trains_through_the_fixture_vae_and_exports_the_runs_switches(
        tmp_path, fixture_model_path, vae_videos):
    """The original's miniFLUX folder and causal VAE as a release, with interp_condition_pos switched
    off (the fixture's config.json has it on): clips of 2 latent frames (2 units; 9 frames for the
    public set's VAE) train in a sync group of 2 slots on 1 rank x 2 micro-batches, and the export
    says what was trained."""
    from pan.export import main_export
    from pan.trainer import build_trainer

    run = tmp_path / "run"
    config = write_config(tmp_path / "fx.yaml", fixture_model_path, vae_videos, run,
                          model={**causal_vae_keys(fixture_model_path), "interp_condition_pos": False},
                          data=VAE_CLIP_DATA, output={"save_interval": 6},
                          training={"max_steps": 6, "learning_rate": 3e-3, "gradient_accumulation_steps": 2})
    trainer = build_trainer(load(config))
    assert not trainer.model.config.interp_condition_pos and trainer.task.vae.latent_channels == latent_channels()
    held, _ = trainer.next_micro_batches()  # both slots' micro-batches, measured before and after training
    before = batch_loss(trainer, held)
    trainer.fit()
    assert batch_loss(trainer, held) < 0.5 * before  # the fixture's random weights start far off (~1.9)

    out = tmp_path / "export" / VARIANT
    assert main_export([str(run / "checkpoint-6"), "--format", "pyramid_flow", "--out", str(out)]) == 0
    assert released_config(out) == {**released_config(FIXTURE_DIT), "interp_condition_pos": False}
    exported = load_pretrained(out, PyramidFluxTransformer)
    assert not exported.config.interp_condition_pos
    for name, p in trainer.model.named_parameters():
        assert torch.equal(exported.state_dict()[name], p.detach()), name


def test_the_launch_script_is_the_shared_launcher_with_the_ar_default():
    import re
    import subprocess

    from slurm_cluster import REPO_ROOT
    script = REPO_ROOT / "scripts" / "train_pyramid_flow.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert re.findall(r"^#SBATCH (\S+)", text, flags=re.M)[:2] == ["--job-name=pan-pyramid-flow-ar", "--nodes=1"]
    assert "PAN_DEFAULT_CONFIG=config/pyramid_flow_ar_384p.yaml" in text

    def body(path: Path) -> list[str]:
        return [line for line in path.read_text().splitlines()
                if line and not line.startswith("#") and not line.startswith("PAN_DEFAULT_CONFIG=")]

    assert body(script) == body(REPO_ROOT / "scripts" / "sft.sh")


# ------------------------------------------------------------------------------------------------
# `pan sample`: unit by unit
# ------------------------------------------------------------------------------------------------

def test_sampling_runs_unit_by_unit_on_a_growing_temporal_pyramid():
    from pan.diffusion.pyramid_draws import GeneratorDraws
    from pan.diffusion.pyramid_schedule import PyramidConfig, PyramidSchedule
    from pan.diffusion.pyramid_sampler import sample_autoregressive

    schedule = PyramidSchedule(PyramidConfig())
    calls = []

    def given(history, stage):
        def velocity(x, t):
            calls.append((stage, x.shape[2], [tuple(h.shape[2:]) for h in history]))
            return torch.zeros_like(x)
        return velocity

    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(1, 3, 5, 8, 8, generator=gen)
    context = torch.randn(1, 3, 2, 8, 8, generator=gen)
    # frame_per_unit 2: units are frame 0, frames 1-2, frames 3-4; a context must be whole units.
    with pytest.raises(ValueError, match="whole units"):
        sample_autoregressive(given, noise, schedule, 1, GeneratorDraws(gen), frame_per_unit=2, context=context)
    calls.clear()
    out = sample_autoregressive(given, noise, schedule, 1, GeneratorDraws(gen), frame_per_unit=2,
                                context=context[:, :, :1])
    assert torch.equal(out[:, :, :1], context[:, :, :1])
    # Unit 1 sees frame 0 at each stage's own resolution; unit 2 sees frames 1-2 at the stage's
    # resolution and frame 0 a level lower (stage 0: everything at the lowest resolution).
    assert calls == [(0, 2, [(1, 2, 2)]), (1, 2, [(1, 4, 4)]), (2, 2, [(1, 8, 8)]),
                     (0, 2, [(1, 2, 2), (2, 2, 2)]), (1, 2, [(1, 2, 2), (2, 4, 4)]),
                     (2, 2, [(1, 4, 4), (2, 8, 8)])]
    calls.clear()
    sample_autoregressive(given, noise, schedule, 1, GeneratorDraws(gen), frame_per_unit=2,
                          context=context[:, :, :1], max_history_units=1)
    assert [h for _, _, h in calls[3:]] == [[(2, 2, 2)], [(2, 4, 4)], [(2, 8, 8)]]   # truncated: one unit


def test_pan_sample_generates_from_text_an_image_or_a_clip(tmp_path, two_ranks, data):
    import av
    import numpy as np
    from PIL import Image

    from pan.sampling import main as sample_main

    tmp, _ = two_ranks
    checkpoint = tmp / "straight" / f"checkpoint-{STEPS}"
    image = tmp_path / "first.png"
    Image.fromarray(np.full((16, 16, 3), 200, dtype=np.uint8)).save(image)
    clip = data["long"].parent / "train" / "000000.mp4"
    common = ["--checkpoint", str(checkpoint), "--prompt", "a red square moving left", "--num-frames", "4",
              "--height", "16", "--width", "16", "--steps", "1", "--video-steps", "1", "--guidance-scale", "3",
              "--video-guidance-scale", "2"]
    for name, extra in (("text", []), ("image", ["--image", str(image)]),
                        ("clip", ["--video", str(clip), "--video-frames", "2", "--max-history-units", "1"])):
        out = tmp_path / f"{name}.mp4"
        assert sample_main([*common, "--out", str(out), *extra]) == 0, name
        with av.open(str(out)) as f:
            frames = [fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]
        assert len(frames) == 4 and frames[0].shape == (16, 16, 3), name
        if name == "image":  # the given first frame comes back (up to the video codec)
            assert abs(frames[0].astype(float).mean() - 200) < 8
    # The trained DiT exports to the released layout, as a full-sequence run's does.
    from pan.export import main_export
    out = tmp_path / "export" / VARIANT
    assert main_export([str(checkpoint), "--format", "pyramid_flow", "--out", str(out)]) == 0
    exported = read_weights(out)
    for key, value in final_weights(tmp / "straight", STEPS)["transformer"].items():
        assert torch.equal(exported[key], value), key
    # The run's latest checkpoint exported as one file samples without its run (its config inside).
    assert main_export([str(tmp / "straight"), "--out", str(tmp_path / "dit.safetensors")]) == 0
    alone = [*common[2:], "--checkpoint", str(tmp_path / "dit.safetensors"), "--out", str(tmp_path / "alone.mp4")]
    assert sample_main(alone) == 0
    assert torch.equal(decoded_frames(tmp_path / "alone.mp4"), decoded_frames(tmp_path / "text.mp4"))


def decoded_frames(path: Path) -> torch.Tensor:
    import av

    with av.open(str(path)) as f:
        return torch.stack([torch.from_numpy(fr.to_ndarray(format="rgb24")) for fr in f.decode(video=0)]).float()


def test_prompts_sampled_together_are_the_clips_each_gets_alone(tmp_path, two_ranks):
    """`--batch-size` (`sample_batch_size`): one packed forward for several prompts, each drawing its
    own seed's noise: the clips of one batch of three are the three sampled one by one (up to the
    rounding of a one-row GEMV against a GEMM of the batch's conditioning rows), and differ from
    each other."""
    from pan.sampling import main as sample_main

    tmp, _ = two_ranks
    prompts = ["a red square moving left", "a blue circle moving up", "a green triangle moving right"]
    common = ["--checkpoint", str(tmp / "straight" / f"checkpoint-{STEPS}"), "--num-frames", "4",
              "--height", "16", "--width", "16", "--steps", "2", "--video-steps", "1", "--guidance-scale", "3",
              "--video-guidance-scale", "2", "--seed", "5"]
    for size in (1, 3):
        args = [*common, "--batch-size", str(size), "--out", str(tmp_path / f"b{size}" / "v.mp4")]
        for prompt in prompts:
            args += ["--prompt", prompt]
        assert sample_main(args) == 0
    alone, together = ([decoded_frames(tmp_path / f"b{size}" / f"v_{i:02d}.mp4") for i in range(3)]
                       for size in (1, 3))
    for a, b in zip(alone, together):
        assert (a - b).abs().max() <= 2, (a - b).abs().max()
    assert all((alone[i] - alone[j]).abs().max() > 20 for i, j in ((0, 1), (0, 2), (1, 2)))


# ------------------------------------------------------------------------------------------------
# Invariants: at config load, in the trainer, in `pan check` and `pan launch-command`
# ------------------------------------------------------------------------------------------------

def test_config_load_refuses_the_ar_invariants_naming_the_key(tmp_path, released, data):
    config = write_config(tmp_path / "ar.yaml", released, data["long"], tmp_path / "run")
    job = load(config)
    assert (job.recipe, job.ar.video_sync_group, job.model.interp_condition_pos) == ("pyramid_flow_ar", 2, None)
    for extra, key in ((["--frame_per_unit", "2"], "frame_per_unit"),            # (4 - 1) % 2
                       (["--video_sync_group", "3"], "video_sync_group"),         # 4 units % 3
                       (["--max_samples_per_batch", "3"], "max_samples_per_batch"),  # % sum(1, 2, 1)
                       (["--model_path", "/PATH/pyramid-flow-miniflux"], "model_path"),
                       (["--model_variant", "diffusion_transformer_image"], "model_variant"),
                       (["--sample_video_steps", "[10, 10]"], "sample_video_steps")):
        with pytest.raises(ConfigError) as err:
            load(config, *extra)
        assert f"`{key}`" in str(err.value), (extra, str(err.value))
    # Data-parallel ranks x micro-batches must hold whole groups: checked before anything is built.
    with pytest.raises(ConfigError, match="video_sync_group"):
        task_of(job, world_size=1)
    assert task_of(load(config, "--gradient_accumulation_steps", "2")).plan.slots == (0, 1)
    # enable_gradient_checkpointing (the 768p YAML) checkpoints the variant's share of the blocks.
    model = task_of(load(config, "--gradient_accumulation_steps", "2", "--enable_gradient_checkpointing",
                         "true")).model
    assert model.config.use_gradient_checkpointing and model.checkpointed_blocks()


def test_pan_check_reports_the_sync_groups_and_the_annotation_rows(tmp_path, released, data):
    from pan.preflight import Preflight, run_preflight

    latents = tmp_path / "latents"
    latents.mkdir()
    rows = []
    for i, frames in enumerate((4, 2)):
        torch.save(torch.randn(3, frames, 16, 16), latents / f"{i}.pt")
        rows.append(json.dumps({"video": f"v{i}.mp4", "text": f"clip {i}", "latent": f"latents/{i}.pt"}))
    rows.append(json.dumps({"video": "v2.mp4", "latent": "latents/0.pt"}))          # no caption
    annotations = tmp_path / "anno.jsonl"
    annotations.write_text("\n".join(rows) + "\n")
    config = write_config(tmp_path / "ar.yaml", released, [], tmp_path / "run",
                          data={"video_csv_paths": [], "annotation_paths": [str(annotations)]})
    job = load(config)

    def table(gpus: int, accumulation: int = 1, group: int = 2) -> dict[str, list]:
        job.trainer.gradient_accumulation_steps, job.ar.video_sync_group = accumulation, group
        out = {}
        for row in run_preflight(Preflight(job, 1, gpus)):
            out.setdefault(row.check, []).append(row)
        return out

    two = table(2)
    assert two["units"][0].status == "pass" and "4 units" in two["units"][0].detail
    # A group of 2 on 4 units: allowed (the original's rotation), but not every unit of a video.
    assert two["sync group"][0].status == "warn" and "2 of its 4 units" in two["sync group"][0].detail
    assert [r.status for r in two["annotation rows"]] == ["fail"]   # row #2 has no caption
    assert "#2" in two["annotation rows"][0].detail
    assert table(3)["sync group"][0].status == "fail"              # 3 ranks cannot hold groups of 2
    full = table(2, accumulation=2, group=4)["sync group"][0]       # 2 ranks x 2 micro-batches = 4
    assert full.status == "pass" and "each 2 rank(s) x 2 micro-batch(es)" in full.detail, full


@needs_reference
def test_launch_command_prints_the_ar_workflow_or_refuses(tmp_path, released, capsys):
    from pan.launch_command import main_launch_command
    from slurm_cluster import REPO_ROOT

    # Launch-command runs pan check's rows: a latent of the fixture DiT's channels, at the 384p
    # template's 640x384 (a 80x48 latent) and 121 frames (16 latent frames), one row per rank.
    annotations = tmp_path / "anno.jsonl"
    torch.save(torch.randn(3, 16, 48, 80), tmp_path / "v.pt")
    annotations.write_text(8 * (json.dumps({"video": "v.mp4", "text": "a clip", "latent": "v.pt"}) + "\n"))
    base = ["--workflow", "pyramid-flow-ar", "--nodes", "1", "--gpus-per-node", "8",
            "--config", str(REPO_ROOT / "config" / "pyramid_flow_ar_384p.yaml")]
    paths = ["--model_path", str(released), "--vae_path", str(FIXTURE_VAE),
             "--annotation_paths", f"[{annotations}]", "--output_dir", str(tmp_path / "run")]
    code = main_launch_command([*base, *paths])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "--nproc_per_node=8" in out and "scripts/train_pyramid_flow.sh" in out
    for extra, key in (([], "model_path"),                                           # the template's paths
                       (["--resolution_buckets", '["1280x768"]'], "resolution_buckets"),  # 768p on a 384p DiT
                       (["--video_sync_group", "3"], "video_sync_group"),           # 16 units % 3
                       (["--frame_per_unit", "2"], "frame_per_unit"),               # (16 - 1) % 2
                       (["--max_samples_per_batch", "6"], "max_samples_per_batch")):
        args = [*base, *extra] if not extra else [*base, *paths, *extra]
        assert main_launch_command(args) == 2, extra
        assert f"`{key}`" in capsys.readouterr().err, extra


def test_x_prediction_regresses_each_units_clean_latent_and_leaves_its_history_unweighted():
    """prediction_type sample in the AR packing: the trained unit's tokens carry x0 at its stage's
    resolution with the velocity-equivalent factor; the history's tokens carry nothing."""
    from pan.diffusion.flow import FlowConfig
    from pan.diffusion.pyramid_draws import GeneratorDraws
    from pan.diffusion.pyramid_latents import latent_pyramid
    from pan.diffusion.pyramid_noising import noise_unit, regression_target
    from pan.diffusion.pyramid_schedule import PyramidConfig, PyramidSchedule
    from pan.encoders.pyramid_text import TextFeatures
    from pan.models.pyramid_flux import PyramidFluxConfig
    from pan.recipes.pyramid_flow_ar.task import UnitSample, unit_inputs
    from pyramid_tiny import TINY_FLUX

    model = PyramidFluxTransformer(PyramidFluxConfig(**TINY_FLUX))
    schedule, flow = PyramidSchedule(PyramidConfig()), FlowConfig(prediction_type="sample")
    g = torch.Generator().manual_seed(0)
    levels = latent_pyramid(torch.randn(1, 3, 3, 16, 16, generator=g), schedule.stages)
    text = TextFeatures(torch.randn(4, TINY_FLUX["joint_attention_dim"], generator=g), torch.ones(4, dtype=torch.long),
                        torch.randn(TINY_FLUX["pooled_projection_dim"], generator=g))
    for stage in range(schedule.stages):
        noised = noise_unit(levels, stage, 3, schedule, GeneratorDraws(g))
        inputs = unit_inputs(model, [UnitSample("v#unit3", noised, text)], "cpu", flow, schedule)
        unit = model.target_tokens(noised.clean[0])
        history_rows = len(inputs.target) - len(unit)
        assert history_rows > 0 and torch.equal(inputs.target[history_rows:], unit)
        assert not inputs.target[:history_rows].any() and not inputs.weight[:history_rows].any()
        factor = regression_target(noised, flow, schedule)[1].item()
        torch.testing.assert_close(inputs.weight[history_rows:], torch.full((len(unit),), factor / noised.clean.numel()))
