"""`pan check` for the causal_vae recipe: its checks (context groups, frames, LPIPS, GAN, clips) and
its probe of the largest micro-batch (memory and step time, pan/estimate/).

`CHECKS` lists the recipe's checks in the order of `pan check`'s table, pan's generic ones
(pan/preflight/checks.py: the warm start of both parts among them) with them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from pan.checkpoint import layout
from pan.config.core import ConfigError
from pan.data.plan import Ref
from pan.data.reader import SampleReader, open_sources, rules_of
from pan.estimate import Phase, Probe, largest_batch, loader_bytes
from pan.models.lpips import LPIPS
from pan.parallel.vae_context import frame_split
from pan.preflight.checks import (
    check_cpu,
    check_layout,
    check_memory,
    check_output_dir,
    check_step_time,
    check_warm_start,
    final_checkpoint,
    spread_rows,
    unopened_row,
)
from pan.preflight.core import Row
from pan.recipes.causal_vae.config import DISCRIMINATOR, VAE, check_lpips_file
from pan.recipes.causal_vae.data import ClipBatch, ClipReader
from pan.recipes.causal_vae.model import vae_forward_flops
from pan.recipes.causal_vae.objective import Objective


def check_context(ctx) -> list[Row]:
    """GPUs against context_size: context groups are consecutive ranks of one node."""
    size = ctx.job.context.context_size
    ctx.task  # noqa: B018 - the task refuses a context group across nodes (said once, in the layout row)
    groups = ctx.world_size // size
    detail = (f"world {ctx.world_size} = {groups} context group(s) of {size}; each group reads its own "
              f"clips ({groups} data shares)")
    return [Row("context", "pass", detail + ("; every rank decodes only its own frames." if size > 1 else "."))]


def check_frames(ctx) -> list[Row]:
    """Frame counts and frame sizes against the VAE, the context split and the discriminator."""
    job = ctx.job
    cfg, data, size = job.vae_config(), job.data, job.context.context_size
    f = cfg.temporal_factor
    split = frame_split(data.max_frames, f, size)
    latent = (data.max_frames - 1) // f + 1
    detail = (f"windows of {data.max_frames} frames (1 + {f} x {(data.max_frames - 1) // f}) -> {latent} "
              f"latent frames at {', '.join(data.resolution_buckets)}")
    if size > 1:
        detail += f"; frames per rank of a context group: {split}"
        if (latent - 1) % size:
            return [Row("frames", "warn", detail + ": unbalanced, the first ranks carry one latent frame more.",
                        f"use 1 + {f}k x {size} frames (e.g. {1 + f * size * max(1, (latent - 1) // size)}) "
                        "to balance the ranks.")]
    return [Row("frames", "pass", detail + ".")]


def check_lpips(ctx) -> list[Row]:
    """The LPIPS file loads into the VGG16 LPIPS network (checked by the config loader too)."""
    path = ctx.job.objective.lpips_ckpt
    if ctx.job.loss.perceptual_weight == 0:
        return [Row("lpips", "pass", "perceptual_weight is 0: no LPIPS term.")]
    check_lpips_file(path)
    return [Row("lpips", "pass", f"{path}: every VGG16 LPIPS key and shape fits.")]


def check_gan(ctx) -> list[Row]:
    """Whether the GAN really trains: a discriminator, and a disc_start the run reaches."""
    job = ctx.job
    if not job.objective.add_discriminator:
        return [Row("gan", "warn", "add_discriminator is false: this run trains no discriminator and "
                    "adds no GAN term (right for stage 1; the original's stage-2 script forgets the flag "
                    "and silently trains without a GAN).", "set add_discriminator: true for stage 2.")]
    start, steps = job.loss.disc_start, job.trainer.max_steps
    if start >= steps:
        return [Row("gan", "warn", f"disc_start {start} >= max_steps {steps}: the GAN never switches on "
                    "(the original's script starts it at 250000 of 200000 steps).",
                    f"set disc_start below {steps}.")]
    return [Row("gan", "pass", f"{job.discriminator.disc_type} discriminator, GAN terms from step {start} "
                f"of {steps} (disc weight {job.loss.disc_weight}).")]


def check_clips(ctx) -> list[Row]:
    """A few samples of every source (video CSVs, annotation files: rows with `video` or `image`,
    image tars) decoded as training reads them (random windows of max_frames frames, resized and
    cropped, checked against what the VAE can encode); images as 1-frame clips."""

    data, rows, sources = ctx.job.data, [], []
    opened = open_sources(data)
    for o in opened:
        if o.source is None:
            rows.append(unopened_row("clips", o))
        elif o.kind == "video_csv" and "path" not in o.source.columns:
            rows.append(Row("clips", "fail", f"{o.label} holds precomputed latents (latent_path): the VAE "
                            "trains on pixels.", "give the CSV of the videos."))
        else:
            sources.append(o)
    csvs = {o.stream: o.source for o in sources if o.kind != "image_tars"}
    tars = opened.tars
    # The reader training uses, with what the VAE can encode (the task's sample_fit): a clip it
    # cannot encode is skipped as `unfit` here as it is in training.
    reader = ClipReader(SampleReader(csvs, tars, rules_of(data), fit=ctx.task.sample_fit()),
                        seed=ctx.job.trainer.seed, temporal_factor=ctx.job.vae_config().temporal_factor)
    for o in sources:
        label, stream, size = o.label, o.stream, len(o.source)
        picks = spread_rows(ctx.sample_rows, size)
        got = [reader[Ref(0, stream, 0, 0, i)] for i in picks]
        problems = [f"#{i} {g.reason}: {g.detail}" for i, g in zip(picks, got) if g.sample is None]
        good = len(picks) - len(problems)
        detail = f"{label}: {size} samples; decoded {good}/{len(picks)} of rows {picks}"
        if problems:
            detail += ". Skipped:\n" + "\n".join(problems)  # one problem a line
        status = "fail" if good == 0 else ("warn" if problems else "pass")
        rows.append(Row("clips", status, detail + ".", "" if status == "pass" else
                        "fix the media or the frame rules named above (such samples are skipped)."))
    return rows


# ---- pan check: memory and step time (pan/estimate/) ------------------------------------------

_FLOPS: dict[tuple, float] = {}


def training_flops(cfg, frames: int, height: int, width: int) -> float:
    """Training FLOPs (3 x the forward's) of one clip, counted once a process for each VAE and clip
    shape: each count runs the VAE's forward on the meta device (~0.1 s), and a probe's pack of many
    clips has a few shapes, probed again for each change `pan check` tries."""
    key = (repr(cfg), frames, height, width)
    if key not in _FLOPS:
        _FLOPS[key] = 3 * vae_forward_flops(cfg, frames, height, width)
    return _FLOPS[key]


def vae_probe(ctx) -> Probe:
    """The recipe's largest micro-batch: the data budget's fullest pack of its longest, largest clips,
    this rank's frames of them (context rank 0 holds the most); the VAE's phase (reconstruction,
    LPIPS, KL and, once the GAN is on, the generator term scored by the discriminator's copy), then
    the discriminator's phase on the same reconstructions."""
    import math

    job, task = ctx.job, ctx.task
    cfg, size, f = task.vae_cfg, task.context_size, task.vae_cfg.temporal_factor
    clips = largest_batch(job.data, task.tokens_of, images=bool(job.data.image_tar_paths))
    if not clips:
        raise ConfigError("max_tokens_per_batch", "no clip of the buckets and frame rules fits the "
                          "token budget.")
    own = [(frame_split(total, f, size)[0] if total > 1 and size > 1 else total, h, w) for total, h, w in clips]
    gan = job.objective.add_discriminator and job.loss.disc_start < job.trainer.max_steps
    helpers = {}
    if job.loss.perceptual_weight > 0:
        with torch.device("meta"):
            helpers["lpips"] = LPIPS()
    if gan:
        helpers["discriminator copy"] = task.build_discriminator().requires_grad_(False)
    made: dict[str, object] = {}

    def vae_loss(models):
        noises = [torch.empty(cfg.latent_channels, (t - 1) // f + 1, h // cfg.spatial_factor, w // cfg.spatial_factor)
                  for t, h, w in own]
        batch = ClipBatch([torch.empty(3, t, h, w) for t, h, w in own], noises, [total for total, _, _ in clips],
                          [f"clip{i}" for i in range(len(clips))], float(len(clips)), sum(t for t, _, _ in own))
        objective = Objective(job.loss, models.get("lpips"), models.get("discriminator copy"))
        made.update(batch=batch, objective=objective)
        return models[VAE](batch, objective)

    def discriminator_loss(models):
        return made["objective"].discriminator_loss(models[DISCRIMINATOR], made["batch"])

    phases = [Phase(VAE, vae_loss)] + ([Phase(DISCRIMINATOR, discriminator_loss)] if gan else [])
    # Both are loaded in fp32 on every rank.
    frozen = {name: sum(t.numel() * 4 for t in (*m.parameters(), *m.buffers())) for name, m in helpers.items()}
    shapes = ", ".join(f"{t}x{h}x{w}" for t, h, w in sorted(set(own), reverse=True))
    return Probe(phases, tokens=sum(math.prod(c) for c in own), samples=len(clips),
                 flops=sum(n * training_flops(cfg, *c) for c, n in Counter(own).items()), frozen=frozen,
                 loader=loader_bytes(job.data, clips), helpers=helpers,
                 describe=f"{len(clips)} clip(s) ({shapes} frames x H x W on this rank) = "
                          f"{sum(math.prod(c) for c in own)} pixels" + (", GAN on" if gan else ""))


# The rows of `pan check`, in this order.
CHECKS = [check_layout, check_output_dir, check_cpu, check_context, check_frames, check_lpips, check_gan, check_warm_start,
          check_clips, check_memory, check_step_time]


# ------------------------------------------------------------------------------------------------
# The launch workflow's rule (`pan launch-command --workflow causal-video-vae`)
# ------------------------------------------------------------------------------------------------

def check_launch(job, dims=None, previous=None) -> None:
    """A stage chained after another (`--stage both`) that starts from a checkpoint that does not
    exist must start from the one that stage writes last. (A lone stage's warm start is the `warm
    start` row's, which launch-command runs next.) A run that resumes its own output_dir uses none."""
    source = job.model.warm_start_checkpoint
    if source is None or layout.complete_checkpoints(Path(job.checkpoint.output_dir)):
        return
    if previous is not None:
        expected = final_checkpoint(previous)
        if Path(source).resolve() == expected.resolve():
            return
        if not Path(source).exists():
            raise ConfigError("warm_start_checkpoint", f"is {source}, which does not exist, and the stage "
                              f"before this one writes {expected} last (its output_dir and max_steps "
                              f"{previous.trainer.max_steps}): to start from it, set this stage's "
                              f"warm_start_checkpoint to it (--stage<STAGE>.warm_start_checkpoint {expected}).")
