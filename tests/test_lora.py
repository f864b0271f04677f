"""LoRA fine-tuning (`lora_rank` > 0, pan/lora/adapters.py) of the DiT recipes on CPU.

- The fixture miniFLUX and SD3 DiTs (../shared/reference/pyramid_flow, as released folders, through
  the fixture causal VAE), the AR recipe's block-causal path on the fixture miniFLUX, and a tiny Pan
  transformer train adapters only: the loss of a fixed batch falls, only `lora_A` / `lora_B` change
  (the frozen base stays bit-identical to the weights it was loaded from), and a checkpoint's
  transformer/ holds the adapters alone. A bf16 base (lora_base_dtype) trains fp32 adapters.
- Layouts on real gloo groups: 2 ranks of FSDP2 with activation checkpointing train as 1 process
  with 2 micro-batches (the tiny Pan transformer and the fixture miniFLUX), Ulysses cp 2 as 1
  process (the tiny Pan transformer, the fixture miniFLUX, and the AR recipe's block-causal path
  on it; for the fixture miniFLUX the smallest cp size its head count allows: 2 for the public set),
  PiSSA's init under FSDP2 as in 1 process: the same samples at every step, losses within
  floating-point noise (rel 1e-5, launch_utils.assert_continues_the_run) and adapters within
  test_parallel_exactness's TOL (the fixture miniFLUX's within a multiple of the fp32-vs-float64
  difference of the same one-process run, measured in the test: FLUX_NOISE_FACTOR). A resume of
  the FSDP2 run's sharded adapters, and a 1-process train.py SIGKILLed and launched again (the tiny
  Pan transformer and the fixture miniFLUX), end bit-identical to the uninterrupted runs.
- Refusals (exit 2): a target name no block has (listing the names it has), lora keys while LoRA is
  off, a bf16 base under fp32 compute, Muon, a resume on another base, of another rank, or full
  fine-tuning of a LoRA run's checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from dist_utils import run_distributed
from launch_utils import assert_continues_the_run, consumed, kill_after_step, launch, run_to_end
from pan.checkpoint import layout
from pan.lora.adapters import LORA_KEY, base_names
from pan.models.pan_dit import PanDiTConfig, PanVideoDiffusionTransformer
from pan.models.pyramid_io import read_weights
from pyramid_reference import REFERENCE, cp_size_for, dit_config, needs_reference, read_json
from pyramid_tiny import (FIXTURE_DIT, FIXTURE_VAE, VAE_CLIP_DATA, VARIANT, batch_loss, causal_vae_keys,
                          final_weights, load)
from pyramid_tiny import fixture_model_path_fixture, released_fixture, vae_videos_fixture  # noqa: F401
from test_kill_resume import tiny_config
from test_parallel_exactness import TOL

RANK = 4
PAN_STEPS = 8      # the SIGKILL after step 3 lands well before the end (a step takes > 0.05 s)
SD3_DIT = REFERENCE / "mmdit_dit" / VARIANT


# ------------------------------------------------------------------------------------------------
# Runs: configs and what a run leaves
# ------------------------------------------------------------------------------------------------

def is_adapter(name: str) -> bool:
    return LORA_KEY.search(name) is not None


def trained_on_a_held_batch(config: Path) -> dict:
    """Build a LoRA run in this process, measure the loss of its first batch, train it to the end and
    measure again; the weights before and after, and the run's LoRA reference."""
    from pan.trainer import build_trainer

    trainer = build_trainer(load(config))
    held, _ = trainer.next_micro_batches()
    snapshot = lambda: {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    start, before = snapshot(), batch_loss(trainer, held)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.fit()
    out = {"before": before, "after": batch_loss(trainer, held), "start": start, "end": snapshot(),
           "trainable": trainable, "state": {n: t.clone() for n, t in trainer.model.state_dict().items()},
           "lora": trainer.parts["transformer"].lora, "steps": trainer.state.step}
    trainer.close()
    return out


def assert_trained_adapters_only(run: dict, base: dict[str, torch.Tensor], fall: float,
                                 unread: tuple[str, ...] = ()) -> None:
    """The loss of the held batch fell by `fall`; the adapters, and only they, trained (every one but
    those of the linears named in `unread`, whose output the loss never reads: no gradient reaches
    them, only weight decay); the frozen base is `base` (the source's tensors) bit for bit."""
    assert run["after"] < fall * run["before"], (run["before"], run["after"])
    assert run["trainable"] == {n for n in run["start"] if is_adapter(n)} and run["trainable"]
    changed = {n for n, start in run["start"].items() if not torch.equal(run["end"][n], start)}
    assert changed <= run["trainable"], changed - run["trainable"]
    assert not {n for n in run["trainable"] if not n.startswith(unread)} - changed, run["trainable"] - changed
    frozen = base_names(run["state"])
    assert frozen.keys() == base.keys()
    for name, t in frozen.items():
        assert torch.equal(t, base[name]), name


def assert_checkpoint_holds_adapters(output_dir: Path, run: dict) -> None:
    """The last checkpoint's transformer/ holds exactly the trained adapters, and meta.json says on
    which base they were trained."""
    step = run["steps"]
    ckpt = output_dir / layout.checkpoint_name(step)
    weights = final_weights(output_dir, step)["transformer"]
    assert weights.keys() == run["trainable"]
    for name, t in weights.items():
        assert torch.equal(t, run["end"][name]), name
    meta = json.loads((ckpt / layout.META).read_text())
    assert meta["lora"]["transformer"] == run["lora"] and run["lora"]["rank"] == RANK


# ------------------------------------------------------------------------------------------------
# The fixture miniFLUX and SD3 DiTs, the AR recipe
# ------------------------------------------------------------------------------------------------

def pyramid_config(path: Path, model_path: Path, videos: Path, output_dir: Path, recipe: str = "pyramid_flow",
                   **sections) -> Path:
    """A LoRA run of a released-layout folder through its causal VAE: whole 9-frame 64x64 clips."""
    cfg = {"recipe": recipe,
           "model": {"model_name": "pyramid_flux", "model_path": str(model_path), **causal_vae_keys(model_path),
                     **sections.pop("model", {})},
           "training": {"learning_rate": 2e-2, "max_steps": 6, "dtype": "fp32", "use_muon": False,
                        **sections.pop("training", {})},
           "data": {"video_csv_paths": [str(videos)], **VAE_CLIP_DATA, "max_tokens_per_batch": 1000,
                    "max_samples_per_batch": 4, "packed_dataloader_num_workers": 0, **sections.pop("data", {})},
           "output": {"output_dir": str(output_dir), "save_interval": 6, "log_interval": 1,
                      "progress_bar": False, **sections.pop("output", {})},
           "lora": {"lora_rank": RANK, **sections.pop("lora", {})},
           **sections}
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def sd3_model_path(tmp_path_factory) -> Path:
    """The fixture SD3 DiT and causal VAE as a release, with tiny SD3 text encoders of the DiT's
    widths (read from the fixture's model_info.json)."""
    from pyramid_text_models import write_pyramid_text_encoders

    widths = read_json("mmdit_dit/model_info.json")["init_config"]
    root = tmp_path_factory.mktemp("sd3_model")
    (root / VARIANT).symlink_to(SD3_DIT)
    (root / "causal_video_vae").symlink_to(FIXTURE_VAE)
    write_pyramid_text_encoders(root, "pyramid_mmdit", pooled_width=widths["pooled_projection_dim"],
                                caption_width=widths["joint_attention_dim"])
    return root


@needs_reference
def test_the_fixture_miniflux_trains_adapters_only(tmp_path, fixture_model_path, vae_videos):
    run = tmp_path / "run"
    result = trained_on_a_held_batch(pyramid_config(tmp_path / "flux.yaml", fixture_model_path, vae_videos, run))
    assert result["lora"]["base_source"] == str(fixture_model_path / VARIANT)
    assert_trained_adapters_only(result, read_weights(FIXTURE_DIT), fall=0.8)
    assert_checkpoint_holds_adapters(run, result)


@needs_reference
def test_the_fixture_sd3_dit_trains_adapters_only(tmp_path, sd3_model_path, vae_videos):
    run = tmp_path / "run"
    result = trained_on_a_held_batch(pyramid_config(tmp_path / "sd3.yaml", sd3_model_path, vae_videos, run,
                                                    model={"model_name": "pyramid_mmdit"}))
    # The last joint block keeps no caption output (context_pre_only): its caption queries are unused.
    last = read_json("mmdit_dit/model_info.json")["init_config"]["num_layers"] - 1
    assert_trained_adapters_only(result, read_weights(SD3_DIT), fall=0.8,
                                 unread=(f"transformer_blocks.{last}.attn.add_q_proj.",))
    assert_checkpoint_holds_adapters(run, result)
    # train.py's path resumes it (`pan check` at start included): 2 more steps on the same base
    from pan.trainer import train

    job = load(tmp_path / "sd3.yaml", "--max_steps", "8", "--watchdog", "false", "--exit_when_launcher_dies", "false")
    assert train(job) == 0
    assert (run / layout.checkpoint_name(8)).is_dir()


@needs_reference
def test_the_ar_recipe_trains_adapters_only_on_its_block_causal_path(tmp_path, fixture_model_path, vae_videos):
    """The fixture miniFLUX through pyramid_flow_ar: 9-frame clips (2 latent frames, 2 units) in a
    sync group of 2 slots on 1 rank x 2 micro-batches, attention block-causal over the units."""
    run = tmp_path / "run"
    config = pyramid_config(tmp_path / "ar.yaml", fixture_model_path, vae_videos, run, recipe="pyramid_flow_ar",
                            autoregressive={"frame_per_unit": 1, "video_sync_group": 2},
                            training={"gradient_accumulation_steps": 2})
    result = trained_on_a_held_batch(config)
    assert_trained_adapters_only(result, read_weights(FIXTURE_DIT), fall=0.8)
    assert_checkpoint_holds_adapters(run, result)


# ------------------------------------------------------------------------------------------------
# A tiny Pan transformer: layouts, SIGKILL, refusals
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pan_setup(tmp_path_factory) -> dict:
    """Synthetic clips, and two bases (.pt state dicts of the tiny transformer) a LoRA run loads: one
    to train on, another to be refused on. Their modulation is not zero (a trained base's is not;
    a zero-initialised one would give the adapters zero gradients)."""
    from pan.data.synth import synth_dataset

    root = tmp_path_factory.mktemp("pan_lora")
    data = synth_dataset(root / "data", num_train=16, num_heldout=0, size=16, num_frames=5)["train_csv"]
    arch = yaml.safe_load(tiny_config(root / "arch.yaml", data, root / "unused", {}).read_text())
    arch = arch["model"]["transformer_config_overrides"]
    bases = {}
    for name, seed in (("base", 1), ("other_base", 2)):
        torch.manual_seed(seed)
        model = PanVideoDiffusionTransformer(PanDiTConfig(**arch), zero_init_modulation=False)
        bases[name] = root / f"{name}.pt"
        torch.save(model.state_dict(), bases[name])
    return {"root": root, "data": data, **bases}


def pan_config(setup: dict, name: str, *, lora: dict | None = None, training: dict | None = None,
               distributed: dict | None = None, base: str = "base", root: Path | None = None) -> Path:
    """test_kill_resume's tiny Pan run (EMA on) as a LoRA run on `base`; output_dir root/name."""
    root = root or setup["root"]
    config = tiny_config(root / f"{name}.yaml", setup["data"], root / name, {"cp_size": 1, **(distributed or {})},
                         keep=PAN_STEPS)
    cfg = yaml.safe_load(config.read_text())
    cfg["model"].update(pretrained_transformer_path=str(setup[base]), load_transformer_weights=True)
    cfg["training"].update({"use_muon": False, "max_steps": PAN_STEPS, "learning_rate": 1e-2, **(training or {})})
    cfg["lora"] = {"lora_rank": RANK, **(lora or {})}
    config.write_text(yaml.safe_dump(cfg))
    return config


def test_a_bf16_base_trains_fp32_adapters(pan_setup):
    """lora_base_dtype: bf16 under dtype: bf16: the frozen base's matrices are held in bf16 (the
    source's weights rounded once), its vectors (norms, biases) and the adapters in fp32."""
    from pan.trainer import build_trainer

    config = pan_config(pan_setup, "bf16_base", training={"dtype": "bf16", "max_steps": 2},
                        lora={"lora_base_dtype": "bf16"})
    trainer = build_trainer(load(config))
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit()
    trainer.close()
    source = torch.load(pan_setup["base"], weights_only=True)
    for name, p in trainer.model.named_parameters():
        if is_adapter(name):
            assert p.dtype == torch.float32 and p.requires_grad, name
        else:
            dtype = torch.bfloat16 if p.ndim >= 2 else torch.float32
            assert p.dtype == dtype and not p.requires_grad, name
            assert torch.equal(p.detach(), source[name.replace(".base_layer", "")].to(dtype)), name
    assert any(not torch.equal(p.detach(), start[n]) for n, p in trainer.model.named_parameters() if is_adapter(n))
    rows = [json.loads(line) for line in (pan_setup["root"] / "bf16_base" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0 < r["loss"] < 10 for r in rows), rows


def fit(config: Path) -> None:
    from pan.trainer import build_trainer

    trainer = build_trainer(load(config))
    trainer.fit()
    trainer.close()


def fit_all(runs: list[tuple[Path, Path | None]]) -> None:
    """A spawned rank's work: several runs in one process group (spawns are the slow part); a run
    given a checkpoint folder starts from a copy of it (a resume)."""
    import torch.distributed as dist

    for config, checkpoint in runs:
        if checkpoint is not None:
            if dist.get_rank() == 0:
                out = Path(load(config).checkpoint.output_dir)
                shutil.copytree(checkpoint, out / checkpoint.name)
            dist.barrier()
        fit(config)


FSDP2 = {"enable_gradient_checkpointing": True}            # dp_shard 2, activation checkpointing
CP2 = {"cp_size": 2}
ACCUMULATE = {"gradient_accumulation_steps": 2}           # 1 process: the 2 data shards of dp 2
PISSA = {"lora_init": "pissa"}
RESUMED_AT = 4                                            # `fsdp2_resumed` continues checkpoint-4 of `fsdp2`
FLUX_STEPS = 4
FLUX_SAVE_INTERVAL = 2                                    # the miniFLUX SIGKILLed after step 3 resumes from 2
# The AR recipe as test_the_ar_recipe_trains_adapters_only_on_its_block_causal_path runs it: a sync
# group of 2 slots on 1 data-parallel rank x 2 micro-batches, attention block-causal over the units.
AR = {"recipe": "pyramid_flow_ar", "autoregressive": {"frame_per_unit": 1, "video_sync_group": 2},
      "training": ACCUMULATE}
# The fixture miniFLUX's one-process runs (the references of its other layouts) and their sections.
FLUX_ONE_PROCESS = {"flux_one_accumulating": {"training": ACCUMULATE}, "flux_one": {}, "flux_ar_one": AR}


def flux_config(root: Path, name: str, model_path: Path, videos: Path, **sections) -> Path:
    """A FLUX_STEPS-step LoRA run of the fixture miniFLUX (checkpoints every FLUX_SAVE_INTERVAL
    steps); output_dir root/name."""
    return pyramid_config(root / f"{name}.yaml", model_path, videos, root / name,
                          training={"max_steps": FLUX_STEPS, **sections.pop("training", {})},
                          output={"save_interval": FLUX_SAVE_INTERVAL}, **sections)


@pytest.fixture(scope="module")
def layouts(pan_setup, request) -> dict[str, Path]:
    """Each layout's output_dir: on 2 gloo ranks (one spawn; `fsdp2_resumed` continues checkpoint-4
    of `fsdp2`), and their references in this process; with the fixtures, the fixture miniFLUX on 2
    FSDP2 ranks, on Ulysses cp (the plain and the AR recipe: cp 2, or the smallest size its heads
    allow, on as many ranks) and on 1 process too."""
    root = pan_setup["root"]
    two = {"fsdp2": (pan_config(pan_setup, "fsdp2", distributed=FSDP2), None),
           "fsdp2_resumed": (pan_config(pan_setup, "fsdp2_resumed", distributed=FSDP2),
                             root / "fsdp2" / layout.checkpoint_name(RESUMED_AT)),
           "cp2": (pan_config(pan_setup, "cp2", distributed=CP2), None),
           "pissa_fsdp2": (pan_config(pan_setup, "pissa_fsdp2", lora=PISSA), None)}
    one = {"one_accumulating": pan_config(pan_setup, "one_accumulating", training=ACCUMULATE),
           "one": pan_config(pan_setup, "one"),
           "pissa_one": pan_config(pan_setup, "pissa_one", lora=PISSA, training=ACCUMULATE)}
    alone: dict[str, tuple] = {}          # Ulysses runs on the cp size the fixture's heads allow, if not 2
    if REFERENCE.is_dir():
        model_path, videos = (request.getfixturevalue(name) for name in ("fixture_model_path", "vae_videos"))

        def flux(name: str, **sections) -> Path:
            return flux_config(root, name, model_path, videos, **sections)
        two["flux_fsdp2"] = (flux("flux_fsdp2", distributed=FSDP2), None)
        cp = cp_size_for(dit_config("flux_dit")["num_attention_heads"])
        if cp > 1:
            runs = {"flux_cp": (flux("flux_cp", distributed={"cp_size": cp}), None),
                    "flux_ar_cp": (flux("flux_ar_cp", distributed={"cp_size": cp}, **AR), None)}
            (two if cp == 2 else alone).update(runs)
        one |= {name: flux(name, **sections) for name, sections in FLUX_ONE_PROCESS.items()}
    run_distributed(fit_all, world_size=2, args=(list(two.values()),))
    if alone:
        run_distributed(fit_all, world_size=cp, args=(list(alone.values()),))
    for config in one.values():
        fit(config)
    return {name: root / name for name in {**two, **alone, **one}}


def assert_bit_identical(run: Path, reference: Path, first_step: int = 1, steps: int = PAN_STEPS) -> None:
    """The same final adapters and optimizer state, bit for bit, and the same samples at every step
    from `first_step` on."""
    want, got = final_weights(reference, steps), final_weights(run, steps)
    for folder in want:
        assert want[folder].keys() == got[folder].keys()
        for key, value in want[folder].items():
            assert torch.equal(value, got[folder][key]), (folder, key)
    later = lambda ids: {rank: {s: i for s, i in steps.items() if s >= first_step}
                         for rank, steps in ids.items()}
    assert later(consumed(reference)) == later(consumed(run))


def assert_same_training(run: Path, reference: Path, steps: int = PAN_STEPS, tol: float = TOL) -> None:
    """Every step trains the reference's samples with a loss within floating-point noise; the final
    adapters are the reference's within `tol` (test_parallel_exactness's TOL by default)."""
    assert_continues_the_run(reference, run, first_step=1, last_step=steps)
    got, want = (final_weights(d, steps)["transformer"] for d in (run, reference))
    assert got.keys() == want.keys() and all(is_adapter(n) for n in got)
    for name, t in want.items():
        assert (got[name] - t).abs().max().item() < tol, name


# The fixture miniFLUX's adapters after FLUX_STEPS AdamW steps at lr 2e-2, on other layouts (FSDP2, cp)
# against one process: the same sums in other fp32 orders. Their tolerance is measured on the same run
# (`flux_tol`): FLUX_NOISE_FACTOR x the largest difference of any adapter between that run in fp32 and
# in float64, at least FLUX_NOISE_FACTOR fp32 ulps of the largest adapter. The factor: 2 for the two
# fp32 runs compared, each within its rounding of the float64 one, and 2 for another order rounding
# further than the one measured. Adam carries the rounding of a near-cancelling gradient element into
# a step of up to the learning rate, so the noise is that of a few such elements and varies by set:
# measured (2026-12-07) 2.0e-5 (flux_one), 2.2e-5 (flux_ar_one), 1.1e-5 (flux_one_accumulating) on the
# public set, against layout differences of 1.7e-5 (cp 2), 3.1e-6 (AR, cp 2), 0 (FSDP2); on a second
# set (3 heads) 2.8e-4, 9.3e-6, 4.8e-5 against 3.3e-5 (cp 3), 2.2e-6, 0. One element of a base weight
# changed by 1e-3 in the cp runs puts their adapters 2.0e-4 and 1.3e-4 off (public set): both fail.
FLUX_NOISE_FACTOR = 4


def float64_inputs(inputs):
    """A micro-batch (PyramidInputs) with its floating-point tensors in float64."""
    return dataclasses.replace(inputs, **{f.name: getattr(inputs, f.name).double() for f in dataclasses.fields(inputs)
                                          if isinstance(getattr(inputs, f.name), torch.Tensor)
                                          and getattr(inputs, f.name).is_floating_point()})


def float64_loss_sum(model, inputs) -> torch.Tensor:
    """PyramidTask.loss_sum without its cast of the prediction to fp32 (for bf16 runs): the float64
    pass keeps every value in float64 (checked equal to the task's own loss in fp32)."""
    from pan.models.pyramid_dit import trained_rows

    pred = model(inputs.x, inputs.timesteps, inputs.text, inputs.pooled, inputs.pack, trained_only=True)
    target, weight = (trained_rows(t, inputs.pack) for t in (inputs.target, inputs.weight))
    return ((pred - target).square().sum(dim=1) * weight).sum()


def fp32_and_float64_adapters(config: Path) -> tuple[dict, dict]:
    """The run `config` trains, its FLUX_STEPS steps taken twice in this process on the same
    micro-batches (the same samples and draws): in fp32 (the trainer's own step) and in float64 (the
    model, its inputs and its AdamW state in float64; the time features, which pan computes in fp32,
    are inputs here). Returns the adapters after each."""
    from pan.trainer import build_trainer

    trainer = build_trainer(load(config))
    part, model = trainer.main, trainer.model
    steps = [trainer.next_micro_batches()[0] for _ in range(FLUX_STEPS)]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer, scheduler = (copy.deepcopy(x.state_dict()) for x in (part.optimizer, part.scheduler))
    adapters = lambda: {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter(n)}
    with torch.no_grad():
        assert float64_loss_sum(model, steps[0][0]).item() == trainer.task.loss_sum(model, steps[0][0]).item()
    for micro_batches in steps:
        trainer.train_step(micro_batches)
    fp32 = adapters()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    model.double()
    part.optimizer.load_state_dict(optimizer)
    part.scheduler.load_state_dict(scheduler)
    trainer.task.loss_sum = float64_loss_sum
    for micro_batches in steps:
        trainer.train_step([float64_inputs(mb) for mb in micro_batches])
    fp64 = adapters()
    trainer.close()
    assert all(t.dtype == torch.float64 for t in fp64.values())
    return fp32, fp64


@pytest.fixture(scope="module")
def flux_tol(layouts, fixture_model_path, vae_videos, tmp_path_factory):
    """The fixture miniFLUX's adapter tolerance against a one-process run of `layouts` (a name of
    FLUX_ONE_PROCESS; see FLUX_NOISE_FACTOR), measured on that run: its fp32 pass is the run, bit for bit."""
    measured: dict[str, float] = {}

    def tol(reference: str) -> float:
        if reference not in measured:
            config = flux_config(tmp_path_factory.mktemp("flux_noise"), reference, fixture_model_path, vae_videos,
                                 **FLUX_ONE_PROCESS[reference])
            fp32, fp64 = fp32_and_float64_adapters(config)
            run = final_weights(layouts[reference], FLUX_STEPS)["transformer"]
            assert fp32.keys() == run.keys() and all(torch.equal(fp32[n], run[n]) for n in run), reference
            noise = max((fp32[n].double() - fp64[n]).abs().max().item() for n in fp64)
            scale = max(t.abs().max().item() for t in fp64.values())
            measured[reference] = FLUX_NOISE_FACTOR * max(noise, scale * 2.0 ** -23)
        return measured[reference]
    return tol


def test_pan_lora_loss_falls_and_only_the_adapters_train(pan_setup):
    run = pan_setup["root"] / "held"
    config = pan_config(pan_setup, "held", training={"max_steps": 12, "learning_rate": 5e-2,
                                                     "lr_scheduler_type": "constant"})
    result = trained_on_a_held_batch(config)
    assert result["lora"]["base_source"] == str(pan_setup["base"])
    # With no single-stream block after it, the last double-stream block's text output is unused.
    arch = load(config).model.transformer_config_overrides
    last = f"blocks.{arch.num_layers - 1}"
    unread = (f"{last}.text_out.", f"{last}.text_mlp.") if arch.num_single_layers == 0 else ()
    assert_trained_adapters_only(result, torch.load(pan_setup["base"], weights_only=True), fall=0.8, unread=unread)
    assert_checkpoint_holds_adapters(run, result)


@pytest.fixture
def pan_log(caplog):
    """pan's log records (its logger does not propagate)."""
    from pan.logging import get_logger
    logger = get_logger()
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


NOTHING_TRAINS = "every LoRA adapter's gradient is 0 at step 1"


@pytest.mark.parametrize("zero_output", [True, False], ids=["zero-output-base", "trained-base"])
def test_a_base_whose_output_layer_is_zero_warns_once_that_nothing_trains(pan_setup, tmp_path, pan_log, zero_output):
    """Issue 52, item 10: on a base whose output layer is zero (the original's init, as the AR demo's
    model folder holds) no gradient reaches the adapters, at any step: the first step says so, once,
    naming the layer; a LoRA run on a base whose output is not zero says nothing of the kind."""
    from pan.trainer import build_trainer

    base = torch.load(pan_setup["base"], weights_only=True)
    if zero_output:
        base["final.proj.weight"].zero_()
        base["final.proj.bias"].zero_()
    torch.save(base, tmp_path / "base.pt")
    config = pan_config({**pan_setup, "base": tmp_path / "base.pt"}, "run", root=tmp_path, training={"max_steps": 3})
    trainer = build_trainer(load(config))
    trainer.fit()
    trainer.close()
    said = [r.getMessage() for r in pan_log.records if NOTHING_TRAINS in r.getMessage()]
    if not zero_output:
        assert said == []
        return
    assert len(said) == 1, said
    assert "the base's final.proj (outside its blocks) is zero" in said[0] and "no gradient reaches the adapters" in said[0], said[0]
    assert "lora_rank: 0" in said[0] and said[0].startswith("transformer: "), said[0]
    assert pan_log.records[[r.getMessage() for r in pan_log.records].index(said[0])].levelname == "WARNING"


def test_two_fsdp2_ranks_with_activation_checkpointing_train_as_one_process(layouts):
    assert_same_training(layouts["fsdp2"], layouts["one_accumulating"])


@needs_reference
def test_the_fixture_miniflux_on_two_fsdp2_ranks_trains_as_one_process(layouts, flux_tol):
    assert_same_training(layouts["flux_fsdp2"], layouts["flux_one_accumulating"], steps=FLUX_STEPS,
                         tol=flux_tol("flux_one_accumulating"))


def test_cp2_trains_as_cp1(layouts):
    assert_same_training(layouts["cp2"], layouts["one"])


@needs_reference
@pytest.mark.parametrize("run", ["flux", "flux_ar"], ids=["pyramid_flow", "pyramid_flow_ar"])
def test_the_fixture_miniflux_under_cp2_trains_as_cp1(layouts, flux_tol, run):
    """Ulysses cp 2 (every rank holds the step's samples, each a share of every sequence; on the AR
    recipe's path the attention block-causal across the ranks' shards) as 1 process. cp 2 where the
    fixture's head count is even (the public set's 2 heads), else the smallest size it allows."""
    if f"{run}_cp" not in layouts:
        pytest.skip("the fixture miniFLUX has one attention head: nothing for Ulysses to split")
    assert_same_training(layouts[f"{run}_cp"], layouts[f"{run}_one"], steps=FLUX_STEPS, tol=flux_tol(f"{run}_one"))


def test_pissa_init_under_fsdp2_is_its_init_in_one_process(layouts):
    assert_same_training(layouts["pissa_fsdp2"], layouts["pissa_one"])
    # PiSSA starts the adapters from the base's singular vectors: not from zero, and not the default's
    default, pissa = (final_weights(layouts[n], PAN_STEPS)["transformer"] for n in ("one_accumulating", "pissa_one"))
    assert all(not torch.equal(default[n], pissa[n]) for n in default)


def test_an_fsdp2_resume_is_bit_identical(layouts):
    """checkpoint-4 of the FSDP2 run (its adapters, sharded) continued in another output_dir, the
    base loaded again from its source."""
    assert_bit_identical(layouts["fsdp2_resumed"], layouts["fsdp2"], first_step=RESUMED_AT + 1)


def test_an_elastic_resume_continues_the_fsdp2_adapters_on_one_process(pan_setup, layouts, tmp_path):
    """checkpoint-4 of the 2-rank FSDP2 run continued by one process (its two data shards as two
    micro-batches of a step): the same samples at every step, the loss and the final adapters
    within floating-point noise of the 2-rank run."""
    out = tmp_path / "elastic"
    shutil.copytree(layouts["fsdp2"] / layout.checkpoint_name(RESUMED_AT), out / layout.checkpoint_name(RESUMED_AT))
    fit(pan_config(pan_setup, "elastic", root=tmp_path, training=ACCUMULATE))
    assert_continues_the_run(layouts["fsdp2"], out, first_step=RESUMED_AT + 1, last_step=PAN_STEPS)
    got, want = (final_weights(d, PAN_STEPS)["transformer"] for d in (out, layouts["fsdp2"]))
    assert got.keys() == want.keys() and all(is_adapter(n) for n in got)
    for name, t in want.items():
        assert (got[name] - t).abs().max().item() < TOL, name


def test_sigkill_and_resume_is_bit_identical(pan_setup, layouts, tmp_path):
    """train.py SIGKILLed after step 3 and launched again ends as the uninterrupted run."""
    config = pan_config(pan_setup, "killed", root=tmp_path)
    killed, log = tmp_path / "killed", tmp_path / "killed.log"
    kill_after_step(launch(config, log, world_size=1), killed, 3, log)
    run_to_end(config, log, world_size=1)
    assert "resuming from checkpoint-" in log.read_text()
    assert_bit_identical(killed, layouts["one"])


@needs_reference
def test_the_fixture_miniflux_sigkilled_and_resumed_is_bit_identical(layouts, fixture_model_path, vae_videos,
                                                                     tmp_path):
    """train.py on the fixture miniFLUX SIGKILLed after step 3 resumes from checkpoint-2 and ends as
    the uninterrupted run (`flux_one`, the same config)."""
    config = flux_config(tmp_path, "killed", fixture_model_path, vae_videos)
    killed, log = tmp_path / "killed", tmp_path / "killed.log"
    kill_after_step(launch(config, log, world_size=1), killed, 3, log)
    run_to_end(config, log, world_size=1)
    assert f"resuming from checkpoint-{FLUX_SAVE_INTERVAL}" in log.read_text(), log.read_text()[-3000:]
    assert_bit_identical(killed, layouts["flux_one"], steps=FLUX_STEPS)


# ---- refusals ------------------------------------------------------------------------------------

def refused_at_load(capsys, config: Path, *extra: str) -> str:
    from pan.cli import cmd_train

    with pytest.raises(SystemExit) as exited:
        cmd_train(["--config", str(config), *extra])
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert "Traceback" not in err
    return err


def test_a_wrong_target_name_exits_2_listing_the_valid_names(pan_setup, tmp_path, capsys):
    from pan.lora.adapters import candidate_names

    config = pan_config(pan_setup, "wrong", root=tmp_path)
    arch = load(config).model.transformer_config_overrides
    with torch.device("meta"):
        names = candidate_names(PanVideoDiffusionTransformer(arch))
    err = refused_at_load(capsys, config, "--lora_target_modules", '["attn_qkv.qkv", "attn.to_qq"]')
    assert "`lora_target_modules`" in err and "attn.to_qq" in err
    assert all(name in err for name in names), err
    assert not (tmp_path / "wrong").exists()


@needs_reference
def test_a_wrong_target_name_of_a_fixture_dit_exits_2_listing_its_names(tmp_path, sd3_model_path, vae_videos,
                                                                        capsys):
    from pan.lora.adapters import candidate_names
    from pan.models.pyramid_io import load_pretrained
    from pan.models.pyramid_mmdit import PyramidMMDiT

    config = pyramid_config(tmp_path / "sd3.yaml", sd3_model_path, vae_videos, tmp_path / "run",
                            model={"model_name": "pyramid_mmdit"}, lora={"lora_target_modules": ["to_q"]})
    names = candidate_names(load_pretrained(SD3_DIT, PyramidMMDiT))
    err = refused_at_load(capsys, config)
    assert "`lora_target_modules`" in err and all(name in err for name in names), err


@pytest.mark.parametrize("extra, key, words", [
    (["--lora_rank", "0", "--lora_alpha", "8"], "lora_alpha", "lora_rank is 0"),
    (["--lora_rank", "0", "--lora_init", "pissa"], "lora_init", "lora_rank is 0"),
    (["--lora_base_dtype", "bf16"], "lora_base_dtype", "dtype is fp32"),
    (["--use_muon", "true"], "use_muon", "use_muon: false"),
], ids=["alpha-without-lora", "init-without-lora", "bf16-base-fp32-compute", "muon"])
def test_lora_keys_that_change_nothing_or_cannot_work_exit_2(pan_setup, tmp_path, capsys, extra, key, words):
    err = refused_at_load(capsys, pan_config(pan_setup, "refused", root=tmp_path), *extra)
    assert f"`{key}`" in err and words in err, err


@pytest.mark.parametrize("extra, words", [
    (["--pretrained_transformer_path", "{other_base}"], "this run's base is"),
    (["--lora_rank", "8"], "lora_rank: checkpoint 4, this run 8"),
    (["--lora_rank", "0"], "LoRA fine-tuning of transformer; this run is full fine-tuning"),
], ids=["other-base", "other-rank", "full"])
def test_a_resume_on_another_base_or_rank_exits_2(pan_setup, layouts, tmp_path, capsys, request, extra, words):
    """train.py exits 2 naming the checkpoint and what differs (another rank or full fine-tuning:
    `pan check`'s resume row, run at start, from meta.json; another base: the checkpointer, once the
    base is loaded and its fingerprint known); the checkpointer refuses each too."""
    from pan.config import ConfigError
    from pan.trainer import build_trainer, train

    out = tmp_path / "run"
    shutil.copytree(layouts["one"] / layout.checkpoint_name(PAN_STEPS), out / layout.checkpoint_name(PAN_STEPS))
    config = pan_config(pan_setup, "run", root=tmp_path, training={"max_steps": PAN_STEPS + 2})
    extra = [e.format(other_base=pan_setup["other_base"]) for e in extra]
    job = load(config, "--watchdog", "false", "--exit_when_launcher_dies", "false", *extra)
    assert train(job) == 2
    err = capsys.readouterr().err
    assert f"checkpoint-{PAN_STEPS}" in err and "Traceback" not in err, err
    said = {"other-rank": "lora_rank: checkpoint 4, this run 8"}
    assert said.get(request.node.callspec.id, words) in err, err
    with pytest.raises(ConfigError) as refused:
        build_trainer(job)
    assert f"checkpoint-{PAN_STEPS}" in str(refused.value) and words in str(refused.value), str(refused.value)
