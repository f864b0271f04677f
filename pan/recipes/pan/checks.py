"""`pan check` rows and the memory probe of the Pan recipe, and its launch workflows' rules."""

from __future__ import annotations

import torch

from pan.config.core import ConfigError, require
from pan.encoders.text import (
    frozen_dtype,
    load_text_config,
    load_tokenizer,
    resolve_text_encoder_path,
    validate_text_encoder,
)
from pan.encoders.vae import vae_geometry
from pan.estimate import Phase, Probe, frozen_vae_bytes, hf_model_bytes, largest_batch, loader_bytes, run_device
from pan.models.packing import PackInfo
from pan.preflight.checks import (
    check_cpu,
    check_data,
    check_layout,
    check_memory,
    check_output_dir,
    check_resume,
    check_step_time,
    check_warm_start,
    source_sizes,
)
from pan.preflight.core import Preflight, Row
from pan.recipes.pan.task import ModelInputs


def check_batch(ctx: Preflight) -> list[Row]:
    """Every stream must give each data-parallel rank a share, and clips must fit the token budget."""
    data, arch = ctx.job.data, ctx.job.model.transformer_config_overrides
    rows = []
    dp = ctx.dims.dp
    for name, size in source_sizes(data).items():
        if size < dp:
            rows.append(Row("batch", "fail", f"{name} has {size} samples, fewer than the {dp} "
                            "data-parallel ranks that share it.", "add samples or use fewer ranks."))
    geometry = vae_geometry(ctx.job.vae)
    pt, ph, pw = arch.patch_size
    frame_counts = data.frame_count_range()
    unencodable = [n for n in frame_counts if (n - 1) % geometry.temporal_factor]
    if unencodable:
        raise ConfigError("frames_mod", f"is {data.frames_mod} with frames_remainder {data.frames_remainder}: "
                          f"clips of {', '.join(map(str, unencodable[:4]))}{' ...' if len(unencodable) > 4 else ''} "
                          f"frames are allowed, but the {ctx.job.vae.vae_type} VAE ({geometry.temporal_factor}x in "
                          f"time) encodes only 1 + {geometry.temporal_factor}k frames. Set frames_mod: "
                          f"{geometry.temporal_factor} and frames_remainder: 1.")
    too_big = []
    for height, width in data.buckets():
        for label, frames in (("shortest", frame_counts[0]), ("longest", frame_counts[-1])):
            shape_error = geometry.clip_shape_error(frames, height, width)
            if shape_error:
                raise ConfigError("resolution_buckets", f"a {label} clip {frames}x{height}x{width} "
                                  f"(frames x H x W) cannot be encoded: {shape_error}. Fix the buckets "
                                  "or the frame rules.")
            _, t, h, w = geometry.latent_shape(frames, height, width)
            if t % pt or h % ph or w % pw:
                raise ConfigError("resolution_buckets", f"the latent {t}x{h}x{w} of a {label} clip at "
                                  f"{width}x{height} is not divisible by patch_size {arch.patch_size}.")
            tokens = (t // pt) * (h // ph) * (w // pw)
            if tokens > data.max_tokens_per_batch:
                too_big.append((label, frames, height, width, tokens))
    budget = data.max_tokens_per_batch
    if any(label == "shortest" for label, *_ in too_big):
        rows.append(Row("batch", "fail", "even the shortest clip exceeds max_tokens_per_batch "
                        f"{budget} in: " + _clips(too_big, "shortest") + "; every such sample would be "
                        "skipped (over_budget).", "raise max_tokens_per_batch or shrink the buckets."))
    elif too_big:
        rows.append(Row("batch", "warn", f"clips of max_frames exceed max_tokens_per_batch {budget} in: "
                        + _clips(too_big, "longest") + "; they are skipped (over_budget).",
                        "raise max_tokens_per_batch or lower max_frames."))
    if not rows:
        rows.append(Row("batch", "pass", f"{dp} data-parallel ranks, each with {budget} tokens per "
                        f"packed batch; every bucket's longest clip fits."))
    return rows


def _clips(found, label: str) -> str:
    return ", ".join(f"{f}x{h}x{w} -> {tok} tokens" for lab, f, h, w, tok in found if lab == label)


def check_text_encoder(ctx: Preflight) -> list[Row]:
    """Config, tokenizer and weight files of the text encoder, offline; its width fits the model."""
    cfg = ctx.job.text_encoder
    # The config load already checked the files, the keys and the width against text_embed_dim;
    # this also builds the tokenizer, which catches a broken vocabulary.
    model_dir = resolve_text_encoder_path(cfg.text_encoder_path)
    text_config = load_text_config(model_dir)
    tokenizer = load_tokenizer(model_dir)
    validate_text_encoder(cfg, text_config, tokenizer)
    return [Row("text encoder", "pass", f"{text_config.model_type}, {text_config.num_hidden_layers} "
                f"layers, width {text_config.hidden_size}, tokenizer {type(tokenizer).__name__}; "
                f"loads offline from {model_dir}.")]


def check_vae(ctx: Preflight) -> list[Row]:
    """The VAE's geometry (config only) and its latent channels against the model's."""
    geometry = vae_geometry(ctx.job.vae)
    arch = ctx.job.model.transformer_config_overrides
    if geometry.latent_channels != arch.out_channels:
        raise ConfigError("transformer_config_overrides.out_channels",
                          f"is {arch.out_channels}, but the VAE ({ctx.job.vae.vae_type}) gives "
                          f"{geometry.latent_channels} latent channels. Set out_channels: "
                          f"{geometry.latent_channels} (and in_channels to match the schema).")
    return [Row("vae", "pass", f"{ctx.job.vae.vae_type}: {geometry.latent_channels} latent channels, "
                f"{geometry.temporal_factor}x temporal, {geometry.spatial_factor}x spatial.")]


def pan_pack(job, task, clips, text_len: int, cp: int):
    """The PackInfo of clips (frames, H, W) with captions of `text_len` rows: whole, and this cp
    rank's share (rank 0, which holds the most rows)."""
    grids = []
    for frames, height, width in clips:
        _, t, h, w = task.geometry.latent_shape(frames, height, width)
        pt, ph, pw = job.model.transformer_config_overrides.patch_size
        grids.append((t // pt, h // ph, w // pw))
    whole = PackInfo.build(grids, [text_len] * len(clips))
    return whole, (whole.shard(0, cp) if cp > 1 else whole)


def pan_probe(ctx: Preflight) -> Probe:
    """The Pan recipe's largest micro-batch: the data budget's fullest pack of its largest clips,
    each caption at text_encoder_max_length rows; one phase (the transformer's loss)."""

    job, task, cp = ctx.job, ctx.task, ctx.dims.cp
    arch = job.model.transformer_config_overrides
    clips = largest_batch(job.data, task.tokens_of, images=bool(job.data.image_tar_paths))
    if not clips:
        raise ConfigError("max_tokens_per_batch", "no clip of the buckets and frame rules fits the "
                          "token budget (see the batch row).")
    whole, pack = pan_pack(job, task, clips, job.text_encoder.text_encoder_max_length, cp)

    def loss(models):
        nv, nt = pack.num_video_tokens, pack.num_text_tokens
        out = arch.out_channels * arch.patch_volume
        inputs = ModelInputs(x=torch.empty(nv, arch.in_channels * arch.patch_volume),
                             target=torch.empty(nv, out), weight=torch.empty(nv),
                             timesteps=torch.empty(whole.num_samples), text=torch.empty(nt, arch.text_embed_dim),
                             pack=pack, sample_ids=[], samples=whole.num_samples,
                             tokens=whole.num_video_tokens, packing=1.0, bad_samples=0)
        return task.loss_sum(models["transformer"], inputs)

    dtype = frozen_dtype(run_device())
    frozen = {"text encoder": hf_model_bytes(resolve_text_encoder_path(job.text_encoder.text_encoder_path), dtype),
              "vae": frozen_vae_bytes(job.vae, dtype)}
    shapes = ", ".join(f"{f}x{h}x{w}" for f, h, w in sorted(set(clips), reverse=True))
    return Probe([Phase("transformer", loss)], tokens=whole.num_video_tokens // cp,
                 samples=len(clips), flops=3 * ctx.model.forward_flops(whole) / cp, frozen=frozen,
                 loader=loader_bytes(job.data, clips), online_text=True,
                 describe=f"{len(clips)} clip(s) ({shapes}, frames x H x W) = {whole.num_video_tokens} "
                          f"video + {whole.num_text_tokens} caption tokens per data-parallel rank")


# The table's rows, in order.
CHECKS = [check_layout, check_batch, check_cpu, check_data, check_text_encoder, check_vae, check_warm_start,
          check_output_dir, check_resume, check_memory, check_step_time]


def sft_warm_starts(job, dims=None) -> None:
    """The sft workflow's rule: it continues a pretrain run."""
    require(job.warm_start.load_transformer_weights, "load_transformer_weights",
            "is false, but the sft workflow continues a pretrain run: set "
            "pretrained_transformer_path to the pretrain run's checkpoint-N/ directory and "
            "load_transformer_weights: true (or use --workflow pretrain).")
