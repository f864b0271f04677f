"""Image-to-video training of the Wan recipe on tiny I2V diffusers folders (tests/wan_tiny.py): Wan 2.1
I2V (condition channels and a CLIP image encoder) and Wan 2.2 I2V A14B (condition channels, two experts,
no CLIP).

`pan data precompute` writes each clip's condition as WanImageToVideoPipeline builds it (the VAE's
encoding of the first frame followed by zero frames; the first frame's CLIP rows), the packed reader
carries them to the task (a precomputed row's extra tensors, SampleFit.extras), the recipe's loss equals
the velocity loss of diffusers' transformer on the pipeline's own inputs in float64, training runs
through the trainer, and `pan sample --image` is WanImageToVideoPipeline with the trained weights: the
same latents as that pipeline given the exported transformer (2.1 I2V), or both exported experts (2.2 I2V
A14B, switched at its boundary_ratio, each with its own guidance scale).

Sizes come from the folders' config.json files. Tolerances: FP64_TOL as in tests/test_wan_recipe.py;
LATENT_RTOL (a few fp32 ULPs) for the precomputed condition against the pipeline's.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_wan_recipe import FP64_TOL, LATENT_RTOL, fixed_loss, one_batch, relative, samples_of
from wan_tiny import prepare_variant, read_json

from pan.config import load_job_config
from pan.models.packing import patchify, unpatchify
from pan.parallel.world import planned_task
from pan.recipes.wan.export import export_diffusers
from pan.recipes.wan.precompute import CONDITION, IMAGE_EMBEDS
from pan.trainer import build_trainer

diffusers = pytest.importorskip("diffusers")

NUM_CLIPS = 4
_made: dict[str, dict] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("wan_i2v")


def made(root: Path, variant: str) -> dict:
    """A variant's folder, clips, config and precomputed data (made once per module)."""
    if variant not in _made:
        _made[variant] = prepare_variant(root / variant, variant, NUM_CLIPS, num_heldout=0)
        assert _made[variant]["rc"] == 0
    return _made[variant]


def job(setup: dict, out: Path, *extra: str, data: Path | None = None):
    return load_job_config(["--config", str(setup["yaml"]), "--output_dir", str(out),
                            "--video_csv_paths", str(data or setup["precomputed"]), *extra], warn=lambda m: None)


def first_frame_image(frames: torch.Tensor):
    """A clip's first frame (uint8 [T, 3, H, W]) as the PIL image a user gives the pipeline."""
    from PIL import Image

    return Image.fromarray(frames[0].permute(1, 2, 0).contiguous().numpy())


# ------------------------------------------------------------------------------------------------
# Precompute: the pipeline's condition
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["i2v", "i2v_a14b"])
def test_precompute_writes_the_pipelines_condition(root, tmp_path, variant):
    """Each row's `condition` is WanImageToVideoPipeline.prepare_latents' latent condition for the clip's
    first frame at the clip's size (the mask channels it puts before it are the recipe's mask), and
    `image_embeds` (2.1 I2V) its encode_image of that frame; the reader hands both to the task."""
    from pan.recipes.wan.task import first_frame_mask

    setup = made(root, variant)
    geometry = setup["geometry"]
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(setup["folder"])
    decoded = samples_of(planned_task(job(setup, tmp_path / "raw", data=setup["clips"])), NUM_CLIPS)
    task = planned_task(job(setup, tmp_path / "run"))
    read = samples_of(task, NUM_CLIPS)
    rows = list(csv.DictReader(open(setup["precomputed"])))
    for i, row in enumerate(rows):
        saved = load_file(str(setup["pre"] / row["latent_path"]))
        image = first_frame_image(decoded[f"train:{i}"].frames)
        pixels = pipe.video_processor.preprocess(image, height=geometry["size"], width=geometry["size"])
        with torch.no_grad():
            _, condition = pipe.prepare_latents(pixels.float(), 1, pipe.vae.config.z_dim, geometry["size"],
                                                geometry["size"], geometry["frames"], torch.float32, "cpu",
                                                torch.Generator().manual_seed(0))
        mask, latent_condition = condition[0, :4], condition[0, 4:]
        assert torch.equal(first_frame_mask(saved["latent"]), mask)
        # pan scales pixels as x / 127.5 - 1 and divides by the std, the pipeline (x / 255) * 2 - 1 and
        # multiplies by 1 / std: a few ULPs apart, as the latents (LATENT_RTOL; measured 4.6e-8)
        difference = relative(saved[CONDITION], latent_condition)
        print(f"\n{variant} row {i}: condition vs the pipeline's {difference:.1e}")
        assert saved[CONDITION].shape == saved["latent"].shape and difference < LATENT_RTOL
        if pipe.transformer.config.image_dim is not None:
            with torch.no_grad():
                embeds = pipe.encode_image(image, "cpu")[0]
            assert torch.equal(saved[IMAGE_EMBEDS], embeds)
        else:
            assert IMAGE_EMBEDS not in saved
        extras = read[f"train:{i}"].extras
        assert sorted(extras) == sorted(k for k in (CONDITION, IMAGE_EMBEDS) if k in saved)
        assert all(torch.equal(extras[k], saved[k]) for k in extras)
        # as a decoding worker hands it over (pickled) and as the sample cache hands out copies
        for again in (pickle.loads(pickle.dumps(read[f"train:{i}"])), read[f"train:{i}"].copy()):
            assert all(torch.equal(again.extras[k], saved[k]) for k in saved if k in extras)
            assert all(again.extras[k] is not extras[k] for k in extras)


@pytest.mark.parametrize("variant", ["i2v", "i2v_a14b"])
def test_online_encoding_gives_the_precomputed_condition(root, tmp_path, variant):
    """Training on the source clips (encoded on the training ranks) conditions each clip on what
    `pan data precompute` writes for it."""
    setup = made(root, variant)
    task = planned_task(job(setup, tmp_path / "run", data=setup["clips"]))
    task.load_encoders()
    rows = list(csv.DictReader(open(setup["precomputed"])))
    samples = samples_of(task, NUM_CLIPS)
    for i, row in enumerate(rows):
        saved = load_file(str(setup["pre"] / row["latent_path"]))
        (online,) = task.conditions([samples[f"train:{i}"]])
        assert sorted(online) == sorted(k for k in (CONDITION, IMAGE_EMBEDS) if k in saved)
        assert all(torch.equal(online[k], saved[k]) for k in online)


def test_rows_without_the_condition_are_skipped_as_unfit(root, tmp_path):
    """A T2V-style precomputed row (latent and text only) cannot train I2V: the loader skips it as a
    bad sample (`unfit`, counted; the detail names the missing tensor) and trains on the others."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from pan.data.decode import SkipSample

    setup = made(root, "i2v")
    lines = setup["precomputed"].read_text().splitlines()
    header, good = lines[0], lines[1]
    row = next(csv.DictReader(open(setup["precomputed"])))
    saved = load_file(str(setup["pre"] / row["latent_path"]))
    save_file({"latent": saved["latent"], "text": saved["text"]}, str(setup["pre"] / "plain.safetensors"))
    mixed = setup["pre"] / "mixed.csv"
    mixed.write_text("\n".join([header, good.replace(row["latent_path"], "plain.safetensors"), good]) + "\n")
    task = planned_task(job(setup, tmp_path / "run", data=mixed))
    loader = task.build_loader(SimpleNamespace(dp=1))
    skipped, trained = {}, set()
    try:
        for _ in range(4):
            batch = next(loader)
            trained |= {s.sample_id for s in batch.samples}
            for reason, n in batch.skipped.items():
                skipped[reason] = skipped.get(reason, 0) + n
    finally:
        loader.close()
    assert trained == {"mixed:1"} and skipped.get("unfit", 0) >= 1
    good = samples_of(planned_task(job(setup, tmp_path / "run2")), 1)["train:0"]
    with pytest.raises(SkipSample) as skip:
        task.sample_fit().check(dataclasses.replace(good, extras=None))
    assert skip.value.reason == "unfit" and CONDITION in skip.value.detail
    short = {**good.extras, CONDITION: good.extras[CONDITION][:, :1]}     # not the latent's shape
    with pytest.raises(SkipSample) as skip:
        task.sample_fit().check(dataclasses.replace(good, extras=short))
    assert skip.value.reason == "unfit" and CONDITION in skip.value.detail
    task.sample_fit().check(good)


# ------------------------------------------------------------------------------------------------
# The loss = diffusers' transformer on the pipeline's inputs, in float64
# ------------------------------------------------------------------------------------------------

def test_i2v_loss_equals_diffusers_by_hand(root, tmp_path):
    """The recipe's loss on a prepared I2V batch equals the velocity loss of diffusers'
    WanTransformer3DModel given what WanImageToVideoPipeline gives it: [x_t ; mask ; condition] on the
    channels, the CLIP rows as encoder_hidden_states_image, captions padded to 512 zero rows; every
    frame in the loss. Float64."""
    from test_wan_model import float64_islands

    from pan.recipes.wan.task import first_frame_mask, loss_sum
    from pan.recipes.wan.weights import load_transformer

    setup = made(root, "i2v")
    task = planned_task(job(setup, tmp_path / "run", "--text_dropout_prob", "0"))
    task.load_encoders()
    batch = one_batch(task)
    task.seed_draws_for(batch)
    inputs = task.prepare(batch).parts["transformer"]
    assert inputs.image is not None and inputs.image.shape[0] == len(batch.samples)
    patch = task.arch.patch_size
    grids = [layout.clips[0].grid for layout in inputs.pack.layouts]
    pan_model = load_transformer(setup["folder"] / "transformer", dtype=torch.float64)
    as64 = dataclasses.replace(inputs, x=inputs.x.double(), target=inputs.target.double(),
                               weight=inputs.weight.double(), text=inputs.text.double(),
                               timesteps=inputs.timesteps.double(), image=inputs.image.double())
    with torch.no_grad():
        pan_loss = (loss_sum(pan_model, as64) / task.loss_count(as64)).item()

    reference = diffusers.WanTransformer3DModel.from_pretrained(setup["folder"] / "transformer").double()
    scale = read_json(setup["folder"] / "scheduler/scheduler_config.json")["num_train_timesteps"]
    sse, count = 0.0, 0
    starts = [0] + list(torch.tensor([math.prod(g) for g in grids]).cumsum(0).tolist())
    for i, sample in enumerate(batch.samples):
        x0, condition = sample.latent.double(), sample.extras[CONDITION].double()
        text = sample.text.double()
        text = torch.cat([text, text.new_zeros(512 - text.shape[0], text.shape[1])])[None]
        rows = slice(starts[i], starts[i + 1])
        target = unpatchify(inputs.target[rows].double(), grids[i], patch)
        t = inputs.sigmas[i].double()
        x_t = (1 - t) * x0 + t * (target + x0)
        model_input = unpatchify(inputs.x[rows].double(), grids[i], patch)
        # the pipeline's order; x_t to the fp32 rounding of x0 + t (noise - x0), the rest exact
        expected = torch.cat([x_t, first_frame_mask(x0), condition])
        assert relative(model_input, expected) < 1e-6
        assert torch.equal(model_input[x0.shape[0]:], expected[x0.shape[0]:])
        timestep = torch.tensor([(inputs.sigmas[i] * scale).item()], dtype=torch.float64)
        with float64_islands(), torch.no_grad():
            pred = reference(hidden_states=model_input[None], timestep=timestep, encoder_hidden_states=text,
                             encoder_hidden_states_image=sample.extras[IMAGE_EMBEDS].double()[None]).sample[0]
        sse += (pred - target).square().sum().item()
        count += target.numel()
    ref_loss = sse / count
    print(f"\ni2v: recipe loss {pan_loss:.10f}, diffusers by hand {ref_loss:.10f}, "
          f"relative {abs(pan_loss - ref_loss) / ref_loss:.1e}")
    assert abs(pan_loss - ref_loss) <= FP64_TOL * ref_loss


# ------------------------------------------------------------------------------------------------
# Training, export, `pan sample`
# ------------------------------------------------------------------------------------------------

def test_i2v_loss_is_finite_and_falls_on_one_repeated_clip(root, tmp_path):
    setup = made(root, "i2v")
    one = setup["pre"] / "one.csv"
    one.write_text("\n".join(setup["precomputed"].read_text().splitlines()[:2]) + "\n")
    steps = 20
    trainer = build_trainer(job(setup, tmp_path / "run", "--max_steps", str(steps), "--max_samples_per_batch", "1",
                                "--save_interval", str(steps), data=one))
    batch = one_batch(trainer.task)
    before = fixed_loss(trainer.task, trainer.model, batch)
    trainer.fit()
    trainer.close()
    after = fixed_loss(trainer.task, trainer.model, batch)
    print(f"\ni2v loss on fixed draws: {before:.4f} -> {after:.4f}")
    assert math.isfinite(after) and after < 0.9 * before


@pytest.fixture(scope="module")
def a14b_run(root) -> dict:
    """Wan 2.2 I2V A14B trained 6 steps with both experts (checkpoint-6), and its weights before."""
    setup = made(root, "i2v_a14b")
    run = root / "i2v_a14b_run"
    trainer = build_trainer(job(setup, run, "--max_steps", "6", "--save_interval", "6"))
    start = {name: {k: v.clone() for k, v in part.model.state_dict().items()} for name, part in trainer.parts.items()}
    trainer.fit()
    trainer.close()
    return dict(setup=setup, run=run, trainer=trainer, start=start)


def test_i2v_a14b_trains_both_experts(a14b_run):
    """Wan 2.2 I2V A14B: both experts train on the condition channels (no CLIP rows), each moving."""
    from pan.recipes.wan.folder import read_folder

    trainer, start = a14b_run["trainer"], a14b_run["start"]
    assert list(trainer.parts) == list(read_folder(a14b_run["setup"]["folder"]).experts)
    for name, part in trainer.parts.items():
        now = part.model.state_dict()
        assert all(torch.isfinite(v).all() for v in now.values())
        assert any(not torch.equal(now[k], start[name][k]) for k in now), name


def test_pan_sample_is_the_i2v_a14b_pipeline_with_both_trained_experts(a14b_run, tmp_path):
    """`pan sample --image` on a Wan 2.2 I2V A14B run (two experts switched at boundary_ratio 0.9, no
    image encoder): WanImageToVideoPipeline with both experts' checkpoint weights, the same latents and
    video as that pipeline loaded from the folder with `pan export --format wan_diffusers`'s transformer
    and transformer_2, given the same image, prompt, seed, steps and both guidance scales; each expert's
    trained weights change the result (both denoise some of the steps)."""
    from pan.recipes.wan.sample import generate, prompt_embeds, wan_pipeline
    from pan.recipes.wan.text import UMT5Encoder
    from pan.sampling import main as sample_main
    from pan.sampling import resolve_weights

    setup, run = a14b_run["setup"], a14b_run["run"]
    geometry, checkpoint = setup["geometry"], a14b_run["run"] / "checkpoint-6"
    raw = planned_task(job(setup, tmp_path / "raw", data=setup["clips"]))
    image = first_frame_image(samples_of(raw, 1)["train:0"].frames)
    image.save(tmp_path / "first.png")
    size = ["--num-frames", str(geometry["frames"]), "--height", str(geometry["size"]),
            "--width", str(geometry["size"]), "--steps", "3"]
    rc = sample_main(["--checkpoint", str(checkpoint), "--prompt", "a red square moving left", "--image",
                      str(tmp_path / "first.png"), "--guidance-scale-2", "3", "--out", str(tmp_path / "clip.mp4"),
                      *size])
    assert rc == 0 and (tmp_path / "clip.mp4").is_file()

    loaded = job(setup, run)
    experts = loaded.model.trained_experts()
    assert experts == ("transformer", "transformer_2")
    ours = wan_pipeline(loaded, {name: resolve_weights(checkpoint, False, part=name)[0] for name in experts})
    export_diffusers(checkpoint, tmp_path / "export")
    exported = {name: diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "export" / name) for name in experts}
    theirs = diffusers.WanImageToVideoPipeline.from_pretrained(setup["folder"], **exported)
    assert isinstance(ours, diffusers.WanImageToVideoPipeline) and ours.image_encoder is None
    assert ours.transformer_2 is not None and ours.config.boundary_ratio == theirs.config.boundary_ratio == 0.9
    only = {name: diffusers.WanImageToVideoPipeline.from_pretrained(setup["folder"], **{name: exported[name]})
            for name in experts}   # one expert trained, the other the folder's
    rows = loaded.model.max_text_tokens
    texts = UMT5Encoder(setup["folder"], rows)
    prompt = "a cat plays the piano"
    call = dict(image=image, prompt_embeds=prompt_embeds(texts, [prompt], rows),
                negative_prompt_embeds=prompt_embeds(texts, [""], rows), height=geometry["size"],
                width=geometry["size"], num_frames=geometry["frames"], num_inference_steps=3, guidance_scale=5.0,
                guidance_scale_2=3.0, output_type="latent")
    a, b, *partial = (p(**call, generator=torch.Generator().manual_seed(0)).frames
                      for p in (ours, theirs, *only.values()))
    assert torch.equal(a, b) and not any(torch.equal(a, c) for c in partial)
    video = generate(ours, [prompt], [0], height=geometry["size"], width=geometry["size"],
                     num_frames=geometry["frames"], steps=3, guidance_scale=5.0, max_sequence_length=rows,
                     texts=texts, image=image, guidance_scale_2=3.0)
    expected = theirs(**{**call, "output_type": "pt"}, generator=torch.Generator().manual_seed(0)).frames.float()
    assert torch.equal(video, expected)


def test_pan_sample_is_the_i2v_pipeline_with_the_trained_weights(root, tmp_path):
    """`pan sample --image` writes the videos; its pipeline is WanImageToVideoPipeline with the
    checkpoint's transformer: given the same image, prompt, seed and steps, the same latents as that
    pipeline loaded from the folder with `pan export --format wan_diffusers`'s transformer."""
    from pan.recipes.wan.sample import generate, prompt_embeds, wan_pipeline
    from pan.recipes.wan.text import UMT5Encoder
    from pan.sampling import main as sample_main
    from pan.sampling import resolve_weights

    setup = made(root, "i2v")
    geometry = setup["geometry"]
    run = tmp_path / "run"
    trainer = build_trainer(job(setup, run, "--max_steps", "2"))
    trainer.fit()
    trainer.close()
    raw = planned_task(job(setup, tmp_path / "raw", data=setup["clips"]))
    image = first_frame_image(samples_of(raw, 1)["train:0"].frames)
    image.save(tmp_path / "first.png")
    size = ["--num-frames", str(geometry["frames"]), "--height", str(geometry["size"]),
            "--width", str(geometry["size"]), "--steps", "2"]
    rc = sample_main(["--checkpoint", str(run / "checkpoint-2"), "--prompt", "a red square moving left",
                      "--image", str(tmp_path / "first.png"), "--out", str(tmp_path / "clip.mp4"), *size])
    assert rc == 0 and (tmp_path / "clip.mp4").is_file()
    with pytest.raises(SystemExit) as stop:    # an I2V run without --image: refused, exit 2
        sample_main(["--checkpoint", str(run / "checkpoint-2"), "--prompt", "x", "--out", str(tmp_path / "n.mp4"),
                     *size])
    assert stop.value.code == 2

    loaded = job(setup, run)
    ours = wan_pipeline(loaded, {"transformer": resolve_weights(run / "checkpoint-2", False, part="transformer")[0]})
    export_diffusers(run / "checkpoint-2", tmp_path / "export")
    theirs = diffusers.WanImageToVideoPipeline.from_pretrained(
        setup["folder"], transformer=diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "export/transformer"))
    original = diffusers.WanImageToVideoPipeline.from_pretrained(setup["folder"])
    assert isinstance(ours, diffusers.WanImageToVideoPipeline)
    # the prompts as embeddings (WanImageToVideoPipeline's own prompt cleaning needs ftfy, see
    # pan/recipes/wan/sample.py); pan's encoding is WanPipeline.encode_prompt's (tests/test_wan_recipe.py)
    rows = loaded.model.max_text_tokens
    texts = UMT5Encoder(setup["folder"], rows)
    prompt = "a cat plays the piano"
    call = dict(image=image, prompt_embeds=prompt_embeds(texts, [prompt], rows),
                negative_prompt_embeds=prompt_embeds(texts, [""], rows), height=geometry["size"],
                width=geometry["size"], num_frames=geometry["frames"], num_inference_steps=2, output_type="latent")
    a, b, c = (p(**call, generator=torch.Generator().manual_seed(0)).frames for p in (ours, theirs, original))
    assert torch.equal(a, b) and not torch.equal(a, c)
    # `pan sample`'s own call (its generate) gives the pipeline's video
    video = generate(ours, [prompt], [0], height=geometry["size"], width=geometry["size"],
                     num_frames=geometry["frames"], steps=2, guidance_scale=5.0, max_sequence_length=rows,
                     texts=texts, image=image)
    expected = theirs(**{**call, "output_type": "pt"}, guidance_scale=5.0,
                      generator=torch.Generator().manual_seed(0)).frames.float()
    assert torch.equal(video, expected)


def test_an_i2v_folder_trains_i2v_only(root, tmp_path):
    """The condition channels must be fed: t2v or ti2v on an I2V folder is refused naming the key."""
    from pan.config import ConfigError

    setup = made(root, "i2v")
    assert job(setup, tmp_path / "run").model.resolved_conditioning() == "i2v"
    for other in ("t2v", "ti2v"):
        with pytest.raises(ConfigError) as refusal:
            job(setup, tmp_path / "run", "--conditioning", other)
        assert "conditioning" in {p.key for p in refusal.value.problems()}
