"""The Wan recipe (pan/recipes/wan/) on tiny diffusers Wan folders (tests/wan_tiny.py).

`pan data precompute` encodes synthetic clips with the folder's VAE and umT5 exactly as diffusers'
pipelines do; training on them runs through the real trainer (the loss is finite and falls on one
repeated clip, a resumed run equals a straight one to the bit, A14B's samples train the expert their
timestep picks); the recipe's loss on a batch equals the one computed by hand with diffusers'
WanTransformer3DModel in float64; configs that cannot work are refused naming the key.

Sizes come from the folders' config.json files (`clip_geometry`), so the tests run unchanged on other
tiny configs. Tolerances: FP64_TOL as in tests/test_wan_model.py (pan and diffusers' float64
evaluation differ by <= 5e-16 there; the fp32 noise is >= 3e-7); the latents' (ULP-level: pan divides
by the std where diffusers multiplies by its inverse) and the noising rule's (fp32 rounding of
x0 + t (noise - x0)) are said where they are used.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from wan_tiny import prepare_variant, read_json

from pan.config import ConfigError, load_job_config
from pan.data.precompute import main as precompute_main
from pan.export import main_export as export_main
from pan.models.packing import patchify, unpatchify
from pan.parallel.world import planned_task
from pan.recipes.wan.export import export_diffusers
from pan.recipes.wan.folder import read_folder
from pan.trainer import build_trainer

diffusers = pytest.importorskip("diffusers")

FP64_TOL = 1e-11
# pan normalises a latent as (z - mean) / std, diffusers as (z - mean) * (1 / std): a few ULPs apart
LATENT_RTOL = 4 * torch.finfo(torch.float32).eps
PIPELINE_TEXT_ROWS = 512     # WanPipeline's max_sequence_length: the rows its transformer sees
NUM_CLIPS = 4


# ------------------------------------------------------------------------------------------------
# Folders, clips, configs
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("wan")


_made: dict[str, dict] = {}


def made(root: Path, variant: str) -> dict:
    """A variant's folder, clips, config and precomputed data (made once per module)."""
    if variant not in _made or not _made[variant]["folder"].exists():
        _made[variant] = prepare_variant(root / variant, variant, NUM_CLIPS, num_heldout=1)
    return _made[variant]


def job(setup: dict, out: Path, *extra: str, data: Path | None = None):
    return load_job_config(["--config", str(setup["yaml"]), "--output_dir", str(out),
                            "--video_csv_paths", str(data or setup["precomputed"]), *extra], warn=lambda m: None)


def samples_of(task, count: int) -> dict:
    """Sample id -> sample of the task's loader (read until `count` distinct samples were seen)."""
    loader = task.build_loader(SimpleNamespace(dp=1))
    seen = {}
    try:
        while len(seen) < count:
            for s in next(loader).samples:
                seen[s.sample_id] = s
    finally:
        loader.close()
    return seen


def one_batch(task):
    loader = task.build_loader(SimpleNamespace(dp=1))
    try:
        return next(loader)
    finally:
        loader.close()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    diff = (a.double() - b.double()).abs().max().item()
    return diff / scale if scale else diff


# ------------------------------------------------------------------------------------------------
# Step 1: the folders
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["t2v", "ti2v", "a14b"])
def test_tiny_folders_are_wan_pipelines(root, variant):
    """diffusers loads each folder as a WanPipeline; the recipe reads what it holds from its JSON."""
    folder = made(root, variant)["folder"]
    pipe = diffusers.WanPipeline.from_pretrained(folder)
    index = read_json(folder / "model_index.json")
    info = read_folder(folder)
    assert info.experts == tuple(n for n in ("transformer", "transformer_2") if getattr(pipe, n) is not None)
    assert info.boundary_ratio == index["boundary_ratio"] == pipe.config.boundary_ratio
    assert info.flow_shift == read_json(folder / "scheduler/scheduler_config.json")["flow_shift"]
    assert info.derived_conditioning == ("ti2v" if index["expand_timesteps"] else "t2v")
    assert info.latent_channels == pipe.vae.config.z_dim == pipe.transformer.config.out_channels


# ------------------------------------------------------------------------------------------------
# Step 3: precompute = diffusers' encoders
# ------------------------------------------------------------------------------------------------

def test_precompute_encodes_as_the_wan_pipelines(root, tmp_path):
    """Latents are AutoencoderKLWan's posterior mode normalised with latents_mean / latents_std as
    diffusers' Wan pipelines do; text features are WanPipeline.encode_prompt's rows before its zero
    padding; the empty caption's features are written once."""
    setup = made(root, "t2v")
    assert setup["rc"] == 0
    rows = list(csv.DictReader(open(setup["precomputed"])))
    assert len(rows) == NUM_CLIPS
    raw = planned_task(job(setup, tmp_path / "run", data=setup["clips"]))   # the clips, decoded as training does
    decoded = samples_of(raw, NUM_CLIPS)
    pipe = diffusers.WanPipeline.from_pretrained(setup["folder"])
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    for i, row in enumerate(rows):
        saved = load_file(str(setup["pre"] / row["latent_path"]))
        frames = decoded[f"train:{i}"].frames                                       # [T, 3, H, W] uint8
        video = (frames.float() / 127.5 - 1.0).permute(1, 0, 2, 3).unsqueeze(0)
        with torch.no_grad():
            expected = ((vae.encode(video).latent_dist.mode() - mean) * inv_std)[0]
        assert saved["latent"].shape == expected.shape == setup["geometry"]["latent"]
        torch.testing.assert_close(saved["latent"], expected, rtol=LATENT_RTOL, atol=LATENT_RTOL)
        with torch.no_grad():   # as WanPipeline.__call__ runs it (autograd picks another attention kernel)
            embeds, _ = pipe.encode_prompt(row["caption"], do_classifier_free_guidance=False,
                                           max_sequence_length=PIPELINE_TEXT_ROWS)
        n = saved["text"].shape[0]
        assert 0 < n < PIPELINE_TEXT_ROWS
        assert torch.equal(saved["text"], embeds[0, :n])
        assert not embeds[0, n:].any()                     # the pipeline's rows after the real ones: zeros
    empty = load_file(str(setup["pre"] / "empty_text.safetensors"))["text"]
    with torch.no_grad():
        negative, _ = pipe.encode_prompt("", do_classifier_free_guidance=False,
                                         max_sequence_length=PIPELINE_TEXT_ROWS)
    assert torch.equal(empty, negative[0, :empty.shape[0]]) and not negative[0, empty.shape[0]:].any()


def test_ti2v_condition_is_the_first_frames_own_latent(root, tmp_path):
    """TI2V trains with the clip latent's first frame as the given frame; WanImageToVideoPipeline
    (expand_timesteps) conditions on the VAE latent of the image alone: with Wan's causal VAE the two
    are the same numbers."""
    setup = made(root, "ti2v")
    raw = planned_task(job(setup, tmp_path / "run", data=setup["clips"]))
    sample = samples_of(raw, 1)["train:0"]
    saved = load_file(str(setup["pre"] / next(csv.DictReader(open(setup["precomputed"])))["latent_path"]))
    vae = diffusers.AutoencoderKLWan.from_pretrained(setup["folder"] / "vae")
    mean = torch.tensor(vae.config.latents_mean).view(-1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(-1, 1, 1, 1)
    image = (sample.frames[:1].float() / 127.5 - 1.0).permute(1, 0, 2, 3).unsqueeze(0)    # [1, 3, 1, H, W]
    with torch.no_grad():
        alone = (vae.encode(image).latent_dist.mode()[0] - mean) * inv_std
    torch.testing.assert_close(saved["latent"][:, :1], alone, rtol=LATENT_RTOL, atol=LATENT_RTOL)


# ------------------------------------------------------------------------------------------------
# Step 3: the loss = diffusers' model by hand, in float64
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["t2v", "ti2v"])
def test_loss_equals_diffusers_by_hand(root, tmp_path, variant):
    """The recipe's loss on a prepared batch (x_t = (1 - t) x0 + t noise, target noise - x0, timestep
    1000 t; TI2V: the first latent frame given clean at timestep 0 and out of the loss) equals the
    velocity loss of diffusers' WanTransformer3DModel on the same weights, with the captions padded to
    512 zero rows as WanPipeline pads them, in float64."""
    from test_wan_model import float64_islands

    from pan.recipes.wan.task import loss_sum
    from pan.recipes.wan.weights import load_transformer

    setup = made(root, variant)
    extra = ("--image_cond_prob", "1.0") if variant == "ti2v" else ()
    task = planned_task(job(setup, tmp_path / "run", "--text_dropout_prob", "0", *extra))
    task.load_encoders()
    batch = one_batch(task)
    task.seed_draws_for(batch)
    inputs = task.prepare(batch).parts["transformer"]
    patch = task.arch.patch_size
    grids = [layout.clips[0].grid for layout in inputs.pack.layouts]
    pan_model = load_transformer(setup["folder"] / "transformer", dtype=torch.float64)
    as64 = dataclasses.replace(inputs, x=inputs.x.double(), target=inputs.target.double(),
                               weight=inputs.weight.double(), text=inputs.text.double(),
                               timesteps=inputs.timesteps.double())
    with torch.no_grad():
        pan_loss = (loss_sum(pan_model, as64) / task.loss_count(as64)).item()

    reference = diffusers.WanTransformer3DModel.from_pretrained(setup["folder"] / "transformer").double()
    sse, count = 0.0, 0
    starts = [0] + list(torch.tensor([math.prod(g) for g in grids]).cumsum(0).tolist())
    for i, sample in enumerate(batch.samples):
        x0 = sample.latent.double()
        text = sample.text.double()
        text = torch.cat([text, text.new_zeros(PIPELINE_TEXT_ROWS - text.shape[0], text.shape[1])])[None]
        rows = slice(starts[i], starts[i + 1])
        x_t = unpatchify(inputs.x[rows].double(), grids[i], patch)
        target = unpatchify(inputs.target[rows].double(), grids[i], patch)
        t = inputs.sigmas[i].double()
        noise = target + x0
        given = 1 if variant == "ti2v" else 0
        # the noising rule (fp32 rounding of x0 + t (noise - x0)); a given frame is x0 itself
        expected = (1 - t) * x0 + t * noise
        expected[:, :given] = x0[:, :given]
        assert relative(x_t, expected) < 1e-6
        # Wan's scale: the scheduler's num_train_timesteps x t (in fp32, as the pipeline's timesteps are)
        scale = read_json(setup["folder"] / "scheduler/scheduler_config.json")["num_train_timesteps"]
        timestep = torch.full(x0.shape[1:], (inputs.sigmas[i] * scale).item(), dtype=torch.float64)
        timestep[:given] = 0.0                 # WanPipeline's expand_timesteps: mask * t, first frame 0
        timestep = patchify(timestep[None], patch)[:, 0]
        if variant != "ti2v":
            timestep = timestep[:1]
            assert torch.equal(inputs.timesteps[i:i + 1].double(), timestep)
        else:
            assert torch.equal(inputs.timesteps[rows].double(), timestep)
        with float64_islands(), torch.no_grad():
            pred = reference(hidden_states=x_t[None], timestep=timestep[None] if variant == "ti2v" else timestep,
                             encoder_hidden_states=text).sample[0]
        sse += (pred - target)[:, given:].square().sum().item()
        count += target[:, given:].numel()
    ref_loss = sse / count
    print(f"\n{variant}: recipe loss {pan_loss:.10f}, diffusers by hand {ref_loss:.10f}, "
          f"relative {abs(pan_loss - ref_loss) / ref_loss:.1e}")
    assert abs(pan_loss - ref_loss) <= FP64_TOL * ref_loss


# ------------------------------------------------------------------------------------------------
# Step 3: training through the trainer
# ------------------------------------------------------------------------------------------------

def fixed_loss(task, model, batch, seeds=range(4)) -> float:
    """The mean loss of `model` on `batch` over a few fixed draws of t and noise."""
    from pan.recipes.wan.task import loss_sum

    total = 0.0
    with torch.no_grad():
        for seed in seeds:
            task.generator.manual_seed(seed)
            task.rng.seed(seed)
            inputs = task.prepare(batch).parts["transformer"]
            total += (loss_sum(model, inputs) / task.loss_count(inputs)).item()
    return total / len(seeds)


def test_loss_is_finite_and_falls_on_one_repeated_clip(root, tmp_path):
    setup = made(root, "t2v")
    one = setup["pre"] / "one.csv"
    with open(setup["precomputed"]) as f:
        lines = f.read().splitlines()
    one.write_text("\n".join(lines[:2]) + "\n")
    steps = 20
    trainer = build_trainer(job(setup, tmp_path / "run", "--max_steps", str(steps), "--max_samples_per_batch", "1",
                                "--save_interval", str(steps), data=one))
    batch = one_batch(trainer.task)
    before = fixed_loss(trainer.task, trainer.model, batch)
    trainer.fit()
    trainer.close()
    after = fixed_loss(trainer.task, trainer.model, batch)
    logged = [json.loads(line)["loss"] for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    print(f"\nloss on fixed draws: {before:.4f} -> {after:.4f}; logged {logged[0]:.4f} ... {logged[-1]:.4f}")
    assert len(logged) == steps and all(math.isfinite(x) for x in logged)
    assert after < 0.9 * before      # measured on the tiny t2v folder: 2.64 -> 1.56


@pytest.mark.parametrize("variant", ["t2v", "a14b"])
def test_resume_equals_a_straight_run(root, tmp_path, variant):
    """2 steps, then a resumed run to 4, gives every trained expert the weights a straight 4-step run
    gives, to the bit (written as diffusers folders by `pan export --format wan_diffusers`, which
    diffusers loads)."""
    setup = made(root, variant)
    straight = build_trainer(job(setup, tmp_path / "straight", "--max_steps", "4"))
    straight.fit()
    straight.close()
    first = build_trainer(job(setup, tmp_path / "resumed", "--max_steps", "2"))
    first.fit()
    first.close()
    again = build_trainer(job(setup, tmp_path / "resumed", "--max_steps", "4"))
    assert again.state.step == 2
    again.fit()
    again.close()
    experts = read_folder(setup["folder"]).experts
    assert list(straight.parts) == list(experts)
    for run in ("straight", "resumed"):
        export_diffusers(tmp_path / run / "checkpoint-4", tmp_path / f"{run}-export")
    # whole weights: the adapters' format refuses them (exit 2) and writes nothing
    assert export_main([str(tmp_path / "straight/checkpoint-4"), "--format", "wan_lora",
                        "--out", str(tmp_path / "lora")]) == 2
    assert not (tmp_path / "lora").exists()
    for name in experts:
        a = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "straight-export" / name).state_dict()
        b = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "resumed-export" / name).state_dict()
        start = diffusers.WanTransformer3DModel.from_pretrained(setup["folder"] / name).state_dict()
        assert a.keys() == b.keys() == start.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert any(not torch.equal(a[k], start[k].float()) for k in a)   # it did train
        live = straight.parts[name].model.state_dict()
        assert all(torch.equal(a[k], live[k]) for k in a)


def test_a14b_samples_train_the_expert_their_timestep_picks(root, tmp_path):
    """With both experts, a sample with t >= boundary_ratio trains `transformer` alone (the other's
    weights stay bit for bit), one below it `transformer_2` alone."""
    setup = made(root, "a14b")
    boundary = read_folder(setup["folder"]).boundary_ratio
    trainer = build_trainer(job(setup, tmp_path / "run", "--max_samples_per_batch", "1", "--max_steps", "50"))
    seen = set()
    for _ in range(12):
        before = {name: {k: v.clone() for k, v in part.model.state_dict().items()}
                  for name, part in trainer.parts.items()}
        micro_batches, _ = trainer.next_micro_batches()
        (mb,) = micro_batches
        (name,) = [n for n, c in mb.counted.items() if c]
        t = mb.parts[name].sigmas.item()
        assert (t >= boundary) == (name == "transformer")
        trainer.train_step(micro_batches)
        for part, weights in before.items():
            now = trainer.parts[part].model.state_dict()
            changed = any(not torch.equal(now[k], weights[k]) for k in weights)
            assert changed == (part == name), (part, name, t)
        seen.add(name)
        if len(seen) == 2:
            break
    trainer.close()
    assert seen == {"transformer", "transformer_2"}


@pytest.mark.parametrize("experts, part", [("high_noise", "transformer"), ("low_noise", "transformer_2")])
def test_one_a14b_expert_trains_on_its_range(root, tmp_path, experts, part):
    setup = made(root, "a14b")
    boundary = read_folder(setup["folder"]).boundary_ratio
    task = planned_task(job(setup, tmp_path / "run", "--wan_experts", experts))
    task.load_encoders()
    assert [spec.name for spec in task.part_specs()] == [part]
    batch = one_batch(task)
    for seed in range(8):
        task.generator.manual_seed(seed)
        task.rng.seed(seed)
        inputs = task.prepare(batch).parts[part]
        sigmas = inputs.sigmas
        assert bool((sigmas >= boundary).all()) if part == "transformer" else bool((sigmas < boundary).all())


# ------------------------------------------------------------------------------------------------
# Step 2: refusals
# ------------------------------------------------------------------------------------------------

def refused_key(setup: dict, out: Path, *extra: str) -> set[str]:
    with pytest.raises(ConfigError) as refusal:
        job(setup, out, *extra)
    return {p.key for p in refusal.value.problems()}


def test_refusals_name_the_key(root, tmp_path):
    setup = made(root, "t2v")
    folder, geometry = setup["folder"], setup["geometry"]
    spatial = geometry["size"] // (geometry["latent"][2])          # pixels per latent cell
    cases = [
        (("--model_path", str(folder / "vae")), "model_path"),                      # not a pipeline folder
        (("--model_path", str(tmp_path / "nowhere")), "model_path"),
        (("--wan_experts", "high_noise"), "wan_experts"),                          # one transformer
        (("--conditioning", "ti2v"), "conditioning"),                              # no expand_timesteps
        (("--conditioning", "i2v"), "conditioning"),                               # no condition channels
        (("--resolution_buckets", f"[{geometry['size'] + spatial}x{geometry['size']}]"), "resolution_buckets"),
        (("--frames_mod", "2", "--min_frames", "1"), "frames_mod"),
        (("--use_muon", "true"), "use_muon"),
        (("--cp_size", "3"), "cp_size"),                                         # 3 does not divide the heads
        (("--image_cond_prob", "0.3"), "image_cond_prob"),                         # t2v: nothing to give
        (("--flow_mode_scale", "1.0"), "flow_mode_scale"),                         # uniform draws
    ]
    for extra, key in cases:
        assert key in refused_key(setup, tmp_path / "run", *extra), (extra, key)

    # transformer_2 without a boundary: which expert denoises what is unknown
    broken = tmp_path / "broken"
    broken.mkdir()
    a14b = made(root, "a14b")["folder"]
    for sub in a14b.iterdir():
        if sub.is_dir():
            os.symlink(sub, broken / sub.name)
    index = read_json(a14b / "model_index.json")
    (broken / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": None}))
    assert "model_path" in refused_key(setup, tmp_path / "run", "--model_path", str(broken))

    # the commands exit 2 with the refusal
    with pytest.raises(SystemExit) as stop:
        precompute_main(["--config", str(setup["yaml"]), "--video_csv_paths", str(setup["clips"]),
                         "--wan_experts", "both", "--out", str(tmp_path / "pre")])
    assert stop.value.code == 2


# ------------------------------------------------------------------------------------------------
# Step 5: the shipped config, `pan sample`
# ------------------------------------------------------------------------------------------------

def test_the_shipped_lora_config_loads(root, tmp_path):
    """config/wan2.1_t2v_1.3b_lora.yaml passes every config check once its placeholders are given (on the
    tiny T2V folder: its buckets fit any Wan 2.1 folder's 8x VAE and 2x2 patches)."""
    setup = made(root, "t2v")
    config = Path(__file__).resolve().parents[1] / "config/wan2.1_t2v_1.3b_lora.yaml"
    loaded = load_job_config(["--config", str(config), "--model_path", str(setup["folder"]),
                              "--video_csv_paths", str(setup["precomputed"]), "--output_dir", str(tmp_path / "run")],
                             warn=lambda m: None)
    assert loaded.lora.enabled and loaded.model.trained_experts() == ("transformer",)
    assert loaded.flow.shift(loaded) == read_json(setup["folder"] / "scheduler/scheduler_config.json")["flow_shift"]


def test_pan_sample_is_wan_pipeline_with_the_trained_weights(root, tmp_path):
    """`pan sample` writes the videos; its pipeline is diffusers' WanPipeline with the checkpoint's
    transformer: the same latents as WanPipeline given the exported transformer folder."""
    from pan.recipes.wan.sample import wan_pipeline
    from pan.sampling import main as sample_main
    from pan.sampling import resolve_weights

    setup = made(root, "t2v")
    geometry = setup["geometry"]
    run = tmp_path / "run"
    trainer = build_trainer(job(setup, run, "--max_steps", "2"))
    trainer.fit()
    trainer.close()
    size = ["--num-frames", str(geometry["frames"]), "--height", str(geometry["size"]),
            "--width", str(geometry["size"]), "--steps", "2"]
    rc = sample_main(["--checkpoint", str(run / "checkpoint-2"), "--prompt", "a red square moving left",
                      "--prompt", "a cat plays the piano", "--out", str(tmp_path / "clip.mp4"), *size])
    assert rc == 0
    assert (tmp_path / "clip_00.mp4").is_file() and (tmp_path / "clip_01.gif").is_file()
    from PIL import Image                  # --image is an I2V run's: refused here (exit 2), not ignored
    Image.new("RGB", (geometry["size"], geometry["size"])).save(tmp_path / "first.png")
    with pytest.raises(SystemExit) as stop:
        sample_main(["--checkpoint", str(run / "checkpoint-2"), "--prompt", "x", "--image", str(tmp_path / "first.png"),
                     "--out", str(tmp_path / "no.mp4"), *size])
    assert stop.value.code == 2 and not (tmp_path / "no.mp4").exists()

    loaded = job(setup, run)
    weights = {"transformer": resolve_weights(run / "checkpoint-2", False, part="transformer")[0]}
    ours = wan_pipeline(loaded, weights)
    export_diffusers(run / "checkpoint-2", tmp_path / "export")
    theirs = diffusers.WanPipeline.from_pretrained(
        setup["folder"], transformer=diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "export/transformer"))
    original = diffusers.WanPipeline.from_pretrained(setup["folder"])
    call = dict(prompt="a cat plays the piano", height=geometry["size"], width=geometry["size"],
                num_frames=geometry["frames"], num_inference_steps=2, output_type="latent")
    a, b, c = (p(**call, generator=torch.Generator().manual_seed(0)).frames for p in (ours, theirs, original))
    assert torch.equal(a, b) and not torch.equal(a, c)


# ------------------------------------------------------------------------------------------------
# Step 5: a LoRA run's adapters in diffusers' format
# ------------------------------------------------------------------------------------------------

def pan_export(*argv: str) -> subprocess.CompletedProcess:
    """`pan export ARGV` as a user types it (a process of its own)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-m", "pan.cli", "export", *argv], capture_output=True, text=True,
                          env=env, timeout=300)


def test_lora_adapters_load_in_diffusers_and_equal_the_merged_weights(root, tmp_path):
    """`pan export CKPT --format wan_lora --out DIR` (no --merge: the format writes adapters): each
    expert's adapters, loaded by WanPipeline.load_lora_weights (A14B's low-noise one with
    load_into_transformer_2), give each transformer the outputs of the merged weights pan exports
    (`--merge --format wan_diffusers`), to fp32 rounding; the adapters did train (the outputs moved from
    the base's); `--merge` with wan_lora is refused in one line, exit 2."""
    from pan.recipes.wan.export import DIFFUSERS_LORA_WEIGHTS

    setup = made(root, "a14b")
    geometry = setup["geometry"]
    run = tmp_path / "run"
    # alpha != rank: the export must carry the scale; a large learning rate: adapters far from zero
    trainer = build_trainer(job(setup, run, "--lora_rank", "4", "--lora_alpha", "8", "--learning_rate", "5e-2",
                                "--max_steps", "6", "--save_interval", "6"))
    trainer.fit()
    trainer.close()
    checkpoint = run / "checkpoint-6"
    done = pan_export(str(checkpoint), "--format", "wan_lora", "--out", str(tmp_path / "lora"))
    assert done.returncode == 0, done.stderr
    refused = pan_export(str(checkpoint), "--format", "wan_lora", "--merge", "--out", str(tmp_path / "no"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().count("\n") == 0 and "--merge" in refused.stderr, refused.stderr
    assert not (tmp_path / "no").exists()
    export_diffusers(checkpoint, tmp_path / "merged")
    experts = read_folder(setup["folder"]).experts
    assert all((tmp_path / "lora" / name / DIFFUSERS_LORA_WEIGHTS).is_file() for name in experts)

    pipe = diffusers.WanPipeline.from_pretrained(setup["folder"])
    base = {name: diffusers.WanTransformer3DModel.from_pretrained(setup["folder"] / name) for name in experts}
    pipe.load_lora_weights(tmp_path / "lora" / "transformer")
    pipe.load_lora_weights(tmp_path / "lora" / "transformer_2", load_into_transformer_2=True)
    gen = torch.Generator().manual_seed(0)
    c, f, h, w = geometry["latent"]
    text_dim = read_json(setup["folder"] / "transformer/config.json")["text_dim"]
    inputs = dict(hidden_states=torch.randn(2, c, f, h, w, generator=gen), timestep=torch.tensor([300.0, 900.0]),
                  encoder_hidden_states=torch.randn(2, 7, text_dim, generator=gen))
    for name in experts:
        merged = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "merged" / name)
        with torch.no_grad():
            with_lora = getattr(pipe, name)(**inputs).sample
            expected = merged(**inputs).sample
            before = base[name](**inputs).sample
        difference = relative(with_lora, expected)
        moved = relative(with_lora, before)
        print(f"\n{name}: LoRA in diffusers vs pan's merged weights {difference:.1e} (moved {moved:.1e} from the base)")
        assert difference < 1e-5 and moved > 100 * difference
