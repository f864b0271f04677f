"""The memory and step-time probe of the `pyramid_flow` recipe (its `probe` hook, pan/estimate/):
what both Pyramid-Flow recipes' micro-batches hold; the autoregressive recipe's probe builds its
micro-batches of units with `pyramid_probe` and `level_shape`.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from pan.config.core import ConfigError
from pan.encoders.pyramid_text import check_text_encoders as released_layout
from pan.encoders.text import frozen_dtype
from pan.estimate import Phase, Probe, frozen_vae_bytes, largest_batch, loader_bytes, module_bytes, run_device
from pan.models.packing import PackInfo
from pan.preflight.core import Preflight
from pan.recipes.pyramid_flow.rules import check_frame_rule, check_stage_sizes_rule, dit_shape
from pan.recipes.pyramid_flow.task import PyramidInputs

def text_encoder_bytes(job, dtype: torch.dtype) -> int:
    """The released T5 and CLIP(s) in `dtype`, as `pan.encoders.pyramid_text` loads them."""
    m = job.model
    layout = released_layout(job.text, "pyramid_flux" if m.model_name == "pan" else m.model_name, m.model_path or "")
    return sum(_text_model_bytes(layout.folder / slot.model_dir, slot.kind, slot.projected, dtype)
               for slot in layout.slots)


@functools.cache  # building even a meta model imports its modeling code: once per process
def _text_model_bytes(model_dir: Path, kind: str, projected: bool, dtype: torch.dtype) -> int:
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

    cls = T5EncoderModel if kind == "t5" else (CLIPTextModelWithProjection if projected else CLIPTextModel)
    config = cls.config_class.from_pretrained(model_dir, local_files_only=True)
    return module_bytes(lambda: cls(config), dtype)


def pyramid_probe(ctx: Preflight, task, samples: list[list[tuple[int, int, int]]], describe: str) -> Probe:
    """One micro-batch of `samples`, each the latent shapes (t, h, w) of its clips in packing order
    (the trained one last), every caption at t5_max_length rows; one phase, the DiT's loss. Frozen
    where the data is read (cp rank 0): the VAE, and the text encoders when captions are encoded
    during training."""

    job, cp, model = ctx.job, ctx.dims.cp, task.model
    # The DiT's latent channels, which the latents it trains on have (the `vae` row compares the
    # VAE's with them: they must agree where clips are encoded online).
    shape, text_len = dit_shape(job), job.text.t5_max_length
    channels = shape.latent_channels
    layouts = [model.sample_layout([model.patch_grid((0, *clip)) for clip in clips], text_len) for clips in samples]
    whole = PackInfo.from_layouts(layouts)
    pack = whole.shard(0, cp) if cp > 1 else whole
    one = torch.empty(channels, *samples[0][-1], device="meta")   # token widths, from one clip
    widths = model.patchify(one).shape[1], model.target_tokens(one).shape[1]

    def loss(models):
        nv, b = pack.num_video_tokens, len(samples)
        inputs = PyramidInputs(x=torch.empty(nv, widths[0]), target=torch.empty(nv, widths[1]),
                               weight=torch.empty(nv), timesteps=torch.empty(b),
                               text=torch.empty(pack.num_text_tokens, shape.caption_width),
                               pooled=torch.empty(b, shape.pooled_width or 0), pack=pack, sample_ids=[],
                               samples=b, tokens=whole.num_video_tokens, packing=1.0, bad_samples=0)
        return task.loss_sum(models["transformer"], inputs)

    dtype = frozen_dtype(run_device())
    frozen = {"vae": frozen_vae_bytes(job.vae, dtype)}
    online_text = task.encodes_captions()
    if online_text:
        frozen["text encoders"] = text_encoder_bytes(job, job.text.dtype(run_device()))
    data = job.data
    clips = largest_batch(data, task.tokens_of, images=bool(data.image_tar_paths))
    shapes = "; ".join(" + ".join("x".join(map(str, clip)) for clip in sample) for sample in samples)
    return Probe([Phase("transformer", loss)], tokens=whole.num_video_tokens // cp, samples=len(samples),
                 flops=3 * task.forward_flops(whole) / cp, frozen=frozen, loader=loader_bytes(data, clips),
                 online_text=online_text,
                 describe=f"{describe} (latent clips t x h x w: {shapes}) = {whole.num_video_tokens} video + "
                          f"{whole.num_text_tokens} caption tokens per data-parallel rank")


def level_shape(task, t: int, h: int, w: int, level: int) -> tuple[int, int, int]:
    """(t, h, w) of a full-resolution latent's frames at pyramid `level` (each level below the top
    halves the sides)."""
    down = task.job.pyramid.stages - 1 - level
    return t, h >> down, w >> down


def largest_batch_clips(ctx: Preflight, task) -> list[tuple[int, int, int]]:
    """Full-resolution latent shapes (t, h, w) of the data budget's fullest micro-batch."""
    data = ctx.job.data
    # Clips the VAE cannot encode, or whose stages do not cut into patches: the `stage sizes` row's failures.
    check_stage_sizes_rule(ctx.job)
    check_frame_rule(ctx.job)
    clips = largest_batch(data, task.tokens_of, images=bool(data.image_tar_paths))
    if not clips:
        raise ConfigError("max_tokens_per_batch", "no clip of the buckets and frame rules fits the "
                          "token budget (see the batch row).")
    return [task.geometry.latent_shape(*clip)[1:] for clip in clips]


def full_sequence_probe(ctx: Preflight) -> Probe:
    """The fullest pack of the largest clips, each at the stage the rotation gives it: of every
    place the rotation can start a batch at, the one with the most tokens."""
    task = ctx.task
    clips = largest_batch_clips(ctx, task)
    cycle = task.column_stages

    def batch(start: int) -> list[list[tuple[int, int, int]]]:
        return [[level_shape(task, *clip, cycle[(start + i) % len(cycle)])] for i, clip in enumerate(clips)]
    tokens = lambda samples: sum(math.prod(task.model.patch_grid((0, *s[-1]))) for s in samples)  # noqa: E731
    fullest = max((batch(start) for start in range(len(cycle))), key=tokens)
    return pyramid_probe(ctx, task, fullest, f"{len(clips)} clip(s) at their pyramid stages")
