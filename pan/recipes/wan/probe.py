"""The memory and step-time probe of the Wan recipe (its `probe` hook, pan/estimate/), and what the
Wan rows of `pan check` count by hand.

The probe is the data budget's fullest micro-batch of the largest clips (`largest_batch`), every
caption at `max_text_tokens` rows (what the transformer sees: WanPipeline's zero padding), run through
each trained expert's loss on fake tensors by the shared estimate (pan/estimate/trace.py: the run's
activation checkpointing, FSDP's gradient share, Ulysses for cp > 1). With both A14B experts trained,
each expert runs the whole micro-batch in its own phase: a micro-batch may hold only one expert's
samples, and under several processes an expert without a sample still runs a stand-in, so this bounds
the step from above (its time counts both experts' passes).

Frozen encoders count where training loads them (WanTask.load_encoders): the VAE (fp32) and, for Wan 2.1
I2V, the CLIP image encoder (fp32) when some rows are encoded online, umT5 (bf16 on a GPU) also when the
empty caption's features are not precomputed.

`hand_count` is the same model counted from the folder's config.json values alone, layer by layer, so
that `pan check` (and docs/wan.md) can show the arithmetic beside the estimate, and a test can hold
the two equal.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from pan.config.core import ConfigError
from pan.data.sources import SourceError, read_video_csv
from pan.encoders.text import frozen_dtype
from pan.estimate import (FP32_BYTES, Phase, Probe, frozen_vae_bytes, largest_batch, loader_bytes, module_bytes,
                          run_device)
from pan.models.packing import PackInfo
from pan.recipes.wan.model import WanConfig
from pan.recipes.wan.precompute import saved_empty_text
from pan.recipes.wan.task import ModelInputs
from pan.recipes.wan.weights import load_config

# ------------------------------------------------------------------------------------------------
# What training loads beside the transformer(s)
# ------------------------------------------------------------------------------------------------

def encodes_online(job) -> bool:
    """Whether some rows are encoded while training (a source CSV, annotations, image tars); a CSV that
    cannot be read counts as online (the data row says what is wrong with it)."""
    data = job.data
    if data.image_tar_paths or data.annotation_paths:
        return True
    try:
        return not all(read_video_csv(p).precomputed for p in data.video_csv_paths)
    except (SourceError, OSError):
        return True


def loads_text_encoder(job) -> bool:
    """umT5 is loaded where captions are encoded online, or where the caption dropout needs the empty
    caption's features and `pan data precompute` did not write them."""
    return encodes_online(job) or (job.tasks.text_dropout_prob > 0 and saved_empty_text(job) is None)


@functools.cache   # building even a meta model imports transformers' modeling code: once per process
def text_encoder_bytes(folder: Path, dtype: torch.dtype) -> int:
    """The folder's umT5 encoder (transformers' UMT5EncoderModel, as Wan loads it) in `dtype`."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config.from_pretrained(folder / "text_encoder", local_files_only=True)
    return module_bytes(lambda: UMT5EncoderModel(config), dtype)


def image_encoder_bytes(vision_config: dict) -> int:
    """Wan 2.1 I2V's CLIP vision model (image_encoder/), fp32 as WanEncoders loads it."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(**{k: v for k, v in vision_config.items() if not k.startswith("_")})
    return module_bytes(lambda: CLIPVisionModel(config), torch.float32)


def frozen_encoders(job) -> dict[str, int]:
    """Bytes of the frozen encoders on a data-reading rank, by name."""
    out = {}
    if encodes_online(job):
        out["vae"] = frozen_vae_bytes(job.vae, torch.float32)   # WanEncoders keeps the VAE in fp32
        folder = job.model.folder()
        if job.model.resolved_conditioning() == "i2v" and folder.image_encoder:   # the first frames' CLIP rows
            out["image encoder"] = image_encoder_bytes(folder.image_encoder)
    if loads_text_encoder(job):
        out["text encoder"] = text_encoder_bytes(job.model.folder().path, frozen_dtype(run_device()))
    return out


# ------------------------------------------------------------------------------------------------
# The probe
# ------------------------------------------------------------------------------------------------

def largest_pack(ctx) -> tuple[list[tuple[int, int, int]], PackInfo]:
    """The fullest micro-batch's clips (frames, H, W) and their whole pack (captions at max_text_tokens)."""
    job, task = ctx.job, ctx.task
    clips = largest_batch(job.data, task.tokens_of, images=bool(job.data.image_tar_paths))
    if not clips:
        raise ConfigError("max_tokens_per_batch", "no clip of the buckets and frame rules fits the token "
                          "budget: raise max_tokens_per_batch or use smaller buckets or fewer frames.")
    pt, ph, pw = task.arch.patch_size
    grids = []
    for frames, height, width in clips:
        _, t, h, w = task.geometry.latent_shape(frames, height, width)
        grids.append((t // pt, h // ph, w // pw))
    return clips, PackInfo.build(grids, [job.model.max_text_tokens] * len(clips))


def wan_probe(ctx) -> Probe:
    """One phase per trained expert, each the loss of the fullest micro-batch (see the module docstring)."""
    job, task, cp = ctx.job, ctx.task, ctx.dims.cp
    clips, whole = largest_pack(ctx)
    pack = whole.shard(0, cp) if cp > 1 else whole   # cp rank 0 holds the most rows
    arch = task.arch
    # I2V: each sample's CLIP rows (FLF2V: its two images' rows, the position table's length)
    image_rows = None if arch.image_dim is None else (arch.pos_embed_seq_len or task.folder.image_rows)

    def loss(part: str, models):
        nv, b, p = pack.num_video_tokens, whole.num_samples, arch.patch_volume
        image = None if image_rows is None else torch.empty(b, image_rows, arch.image_dim)
        inputs = ModelInputs(x=torch.empty(nv, arch.in_channels * p), target=torch.empty(nv, arch.output_channels * p),
                             weight=torch.empty(nv), timesteps=torch.empty(b),
                             # the captions are whole on every cp rank (the cross-attention's keys)
                             text=torch.empty(whole.num_text_tokens, arch.text_dim), pack=pack, sample_ids=[],
                             samples=b, tokens=whole.num_video_tokens, packing=1.0, bad_samples=0, image=image)
        return task.loss_sum(models[part], inputs)

    # this rank's share under cp
    forward = ctx.models[task.trained[0]].forward_flops(pack, image_rows or 0)
    shapes = ", ".join(f"{f}x{h}x{w}" for f, h, w in sorted(set(clips), reverse=True))
    experts = " and ".join(task.trained)
    return Probe([Phase(name, functools.partial(loss, name)) for name in task.trained],
                 tokens=pack.num_video_tokens, samples=len(clips), flops=3 * forward * len(task.trained),
                 frozen=frozen_encoders(job), loader=loader_bytes(job.data, clips),
                 online_text=loads_text_encoder(job),
                 describe=f"{len(clips)} clip(s) ({shapes}, frames x H x W) = {whole.num_video_tokens} video "
                          f"tokens + {whole.num_text_tokens} caption rows per data-parallel rank, through "
                          f"{experts}")


# ------------------------------------------------------------------------------------------------
# The hand count
# ------------------------------------------------------------------------------------------------

def linear(n_in: int, n_out: int) -> tuple[int, int]:
    """(matrix, vector) parameters of a Linear with bias."""
    return n_in * n_out, n_out


def _add(*counts: tuple[int, int]) -> tuple[int, int]:
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def transformer_parameters(c: WanConfig) -> tuple[int, int]:
    """(matrix, vector) parameters of a Wan transformer from its config.json values, diffusers' layers
    one by one: tensors of 2 or more dims (weights, modulation tables: what a LoRA base keeps at
    lora_base_dtype) and vectors (biases, norm scales: kept fp32)."""
    d, f, p = c.inner_dim, c.ffn_dim, c.patch_volume
    norm = (0, d)
    attention = _add(*[linear(d, d)] * 4, norm, norm)                  # q, k, v, out; RMSNorm of q and k
    cross = _add(attention, *([linear(d, d)] * 2 + [norm] if c.added_kv_proj_dim else []))  # + image k/v
    block = _add(attention, cross, (0, 2 * d) if c.cross_attn_norm else (0, 0),   # LayerNorm before cross
                 linear(d, f), linear(f, d), (6 * d, 0))                           # MLP; modulation table
    embed = _add(linear(c.in_channels * p, d), linear(c.freq_dim, d), linear(d, d), linear(d, 6 * d),
                 linear(c.text_dim, d), linear(d, d))
    if c.image_dim:
        embed = _add(embed, (0, 2 * c.image_dim), linear(c.image_dim, c.image_dim), linear(c.image_dim, d),
                     (0, 2 * d), ((c.pos_embed_seq_len or 0) * c.image_dim, 0))
    head = _add(linear(d, c.output_channels * p), (2 * d, 0))
    layers = (c.num_layers * block[0], c.num_layers * block[1])
    return _add(layers, embed, head)


def lora_parameters(c: WanConfig, rank: int) -> int:
    """Adapters of `rank` on every linear of every block (lora_target_modules: null): r x (in + out)
    each, for the 8 attention projections (plus I2V's 2 image ones) and the MLP's 2."""
    d, f = c.inner_dim, c.ffn_dim
    per_block = rank * ((8 + (2 if c.added_kv_proj_dim else 0)) * 2 * d + 2 * (d + f))
    return c.num_layers * per_block


@dataclass
class HandCount:
    """One run's static bytes per device, counted from config.json values (see `hand_count`)."""
    experts: int
    base: int            # parameters of one expert (their mean, where experts differ)
    trained: int         # trained parameters of all experts (adapters, or every weight)
    frozen_matrices: int  # frozen parameters of all experts (a LoRA base): its tensors of >= 2 dims,
    frozen_vectors: int   # at `matrix_bytes` each, and its vectors, kept fp32
    matrix_bytes: int
    shard: int           # FSDP shard degree

    @property
    def bytes(self) -> dict[str, int]:
        """Per device: parameters (fp32 master weights of the trained ones), frozen parameters,
        gradients at most (fp32, all at once: the trace says how many exist at the peak), optimizer
        states (AdamW's two fp32 moments)."""
        frozen = self.frozen_matrices * self.matrix_bytes + self.frozen_vectors * FP32_BYTES
        return {"parameters": FP32_BYTES * self.trained // self.shard,
                "frozen parameters": frozen // self.shard,
                "gradients": FP32_BYTES * self.trained // self.shard,
                "optimizer states": 2 * FP32_BYTES * self.trained // self.shard}

    def arithmetic(self) -> str:
        """The count in words and numbers, as docs/wan.md shows it."""
        b, shard = self.bytes, f" / {self.shard}" if self.shard > 1 else ""
        lines = [f"{self.experts} x {self.base / 1e9:.3f}B parameters"]
        if self.frozen_matrices:
            lines.append(f"frozen base {self.frozen_matrices / 1e9:.3f}B x {self.matrix_bytes} B + "
                         f"{self.frozen_vectors / 1e6:.2f}M vectors x 4 B{shard} = {_gib(b['frozen parameters'])}")
        lines += [f"trained {self.trained / 1e6:,.1f}M x 4 B (fp32){shard} = {_gib(b['parameters'])}",
                  f"AdamW {self.trained / 1e6:,.1f}M x 8 B{shard} = {_gib(b['optimizer states'])}",
                  f"gradients at most {self.trained / 1e6:,.1f}M x 4 B{shard} = {_gib(b['gradients'])}"]
        return "; ".join(lines)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def hand_count(ctx) -> HandCount:
    """The run's parameters by hand: each trained expert's transformer (`transformer_parameters`) and,
    for LoRA, its adapters (`lora_parameters`) on a base whose matrices are kept at lora_base_dtype;
    sharded over the FSDP group (dp_shard x cp; 1 with ddp or in one process)."""
    job, dims = ctx.job, ctx.dims
    folder = job.model.folder()
    archs = [load_config(folder.expert_dir(name)) for name in job.model.trained_experts()]
    counts = [transformer_parameters(arch) for arch in archs]
    matrices, vectors = sum(m for m, _ in counts), sum(v for _, v in counts)
    base = (matrices + vectors) // len(archs)
    shard = 1 if job.parallel.data_parallel_mode == "ddp" or dims.world_size == 1 else dims.dp_shard * dims.cp
    lora = job.lora
    if not lora.enabled:
        return HandCount(len(archs), base, matrices + vectors, 0, 0, 0, shard)
    if lora.lora_target_modules is not None:
        raise ValueError("the hand count covers adapters on every linear of every block only "
                         "(lora_target_modules: null).")
    matrix_bytes = torch.empty(0, dtype=lora.base_dtype(job.trainer.dtype)).element_size()
    adapters = sum(lora_parameters(arch, lora.lora_rank) for arch in archs)
    return HandCount(len(archs), base, adapters, matrices, vectors, matrix_bytes, shard)
