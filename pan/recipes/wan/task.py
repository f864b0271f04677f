"""The Wan recipe's task: flow matching for a diffusers Wan folder's transformer(s) on packed batches.

Parts: one per trained expert, named as the folder names it (`transformer`; A14B's low-noise expert
`transformer_2`), each with its own optimizer, LR schedule and checkpoint folder, and each starting
from the folder's weights (loaded strictly: `PartSpec.pretrained`). A LoRA run puts adapters on that
frozen base.

One micro-batch (`prepare`, on the data-reading rank, its draws seeded from the micro-batch's name):
    x0       each clip's normalised VAE latent [C, T, H, W] (precomputed, or encoded online)
    text     its caption's umT5 rows (precomputed or encoded), replaced by the empty caption's with
             probability text_dropout_prob, then padded with zero rows to max_text_tokens (as WanPipeline)
    t        per clip, drawn by pan.diffusion.flow (flow_snr_type) and shifted by flow_shift; A14B with
             one expert trained: redrawn until inside that expert's range
    noise    N(0, 1) like x0
    x_t      (1 - t) x0 + t noise; the transformer gets timestep 1000 t (Wan's scale: the scheduler's
             num_train_timesteps)
    target   noise - x0 (velocity); the loss is the squared error summed over a token's values and
             averaged over the loss elements of the whole step (as the Pan recipe)
    ti2v     with probability image_cond_prob the first latent frame is given: x_t keeps x0 there, its
             tokens get timestep 0 (per-token timesteps, WanPipeline's expand_timesteps) and weight 0
    i2v      every clip is conditioned on its first frame as WanImageToVideoPipeline conditions: the
             transformer's input is [x_t ; mask ; condition] on the channels (mask: 4 channels, 1 on
             the first latent frame, 0 after; condition: the VAE encoding of the first frame followed by
             zero frames, precomputed), and for Wan 2.1 I2V the first frame's CLIP rows go to the
             cross-attention (`image`); every frame is predicted, as the pipeline denoises every frame
A14B with both experts: the samples with t >= boundary_ratio go to `transformer`, the others to
`transformer_2`; each part's step is the mean over its own samples of the whole step (all ranks, all
micro-batches). A part without a sample in a micro-batch gets a zero-weight stand-in (the batch's first
clip) where other ranks may hold its samples, so that every rank runs the same forwards and backwards; a
part without a sample in the whole step is not stepped (its optimizer does not move; its LR schedule
advances with the run's steps).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from pan.data.fit import SampleFit
from pan.data.sources import read_video_csv
from pan.diffusion.flow import add_noise, sample_timesteps, velocity_target
from pan.models.packing import PackInfo, patchify
from pan.recipes.packed import PackedInputs, PackedTask, to_device
from pan.recipes.wan.config import WanJobConfig
from pan.recipes.wan.context_parallel import share_batch
from pan.recipes.wan.folder import I2V_MASK_CHANNELS
from pan.recipes.wan.model import WanTransformer
from pan.recipes.wan.precompute import CONDITION, IMAGE_EMBEDS, WanEncoders, read_empty_text, saved_empty_text
from pan.recipes.wan.text import padded
from pan.recipes.wan.weights import load_config, read_state_dict
from pan.task import PartSpec, global_sum

# Redraws of a batch's timesteps to land each inside one expert's range (A14B, one expert trained): the
# chance that a draw misses it every time is (1 - p)^MAX_REDRAWS for a range of probability p.
MAX_REDRAWS = 10_000


@dataclass
class ModelInputs(PackedInputs):
    """One part's samples of a packed micro-batch (this process's):

        x           [Nv, in_ch * p]  noisy latents as patch tokens
        target      [Nv, out_ch * p] velocity target
        weight      [Nv] 1 where the token counts in the loss, 0 on a given first frame (and a stand-in)
        timesteps   [B], or [Nv] per token (ti2v), on Wan's 0..1000 scale: what the transformer takes
        text        [B * max_text_tokens, text_dim] caption rows, zero-padded per sample
        sigmas      [B] each sample's t in [0, 1]
        image       [B, Li, image_dim] each sample's CLIP rows (Wan 2.1 I2V), else None
    """
    sigmas: Tensor | None = None
    image: Tensor | None = None

    def to(self, device) -> ModelInputs:
        moved = super().to(device)
        return moved if self.image is None else dataclasses.replace(moved, image=to_device(self.image, device))


@dataclass
class WanBatch:
    """A packed micro-batch split by part: part name -> its samples' ModelInputs."""
    parts: dict[str, ModelInputs]
    sample_ids: list[str]
    samples: int
    tokens: int
    packing: float
    bad_samples: int
    counted: dict[str, int]   # samples of each part (0: its entry is a zero-weight stand-in)

    def to(self, device) -> WanBatch:
        return dataclasses.replace(self, parts={k: v.to(device) for k, v in self.parts.items()})


class WanTask(PackedTask):
    """The Wan recipe on the packed-DiT loop (pan.recipes.packed); see the module docstring."""

    def __init__(self, job: WanJobConfig, world, dims, cp=None):
        super().__init__(job, world, dims, cp)
        self.folder = job.model.folder()
        self.trained = job.model.trained_experts()
        self.conditioning = job.model.resolved_conditioning()
        self.arch = self.folder.transformer
        self.flow = job.flow.flow(job)
        self.models: dict[str, WanTransformer] = {}
        self.encoders: WanEncoders | None = None
        self._empty_text: Tensor | None = None

    # -- what gets built -------------------------------------------------------------------------
    def part_specs(self) -> list[PartSpec]:
        """One part per trained expert, each starting from the folder's weights."""
        lora = self.job.lora if self.job.lora.enabled else None
        return [PartSpec(name, functools.partial(self.build_model, name), self.job.optim,
                         pretrained=functools.partial(read_state_dict, self.folder.expert_dir(name)),
                         pretrained_from=str(self.folder.expert_dir(name)), lora=lora)
                for name in self.trained]

    def build_model(self, name: str) -> WanTransformer:
        """Expert `name`'s transformer on the meta device (the trainer materialises and loads it)."""
        with torch.device("meta"):
            model = WanTransformer(load_config(self.folder.expert_dir(name)),
                                   attention_backend=self.job.model.attention_backend)
        self.models[name] = model
        return model

    def load_encoders(self) -> None:
        """The folder's VAE and umT5 where some rows are not precomputed, on the data-reading ranks;
        the empty caption's features from umT5, or from `pan data precompute`'s file."""
        if not self.reads_data:
            return
        data = self.job.data
        online = bool(data.image_tar_paths or data.annotation_paths) or not all(
            read_video_csv(p).precomputed for p in data.video_csv_paths)
        saved = saved_empty_text(self.job)
        dropout = self.job.tasks.text_dropout_prob > 0
        need_text = online or (dropout and saved is None)
        if online or need_text:
            self.encoders = WanEncoders(self.job, self.world.device, text=need_text, vae=online)
        if need_text:
            self._empty_text = self.encoders.captions([""])[0]
        elif dropout:
            self._empty_text = read_empty_text(saved)

    def latent_tokens_of(self, t: int, h: int, w: int) -> int:
        pt, ph, pw = self.arch.patch_size
        return (t // pt) * (h // ph) * (w // pw)

    def sample_fit(self) -> SampleFit:
        """The folder's latents (z_dim channels, whole patches) and umT5 width; Pyramid-Flow's
        unnormalised annotation latents are not taken."""
        arch = self.arch
        return dataclasses.replace(super().sample_fit(), channels=arch.output_channels, unit=tuple(arch.patch_size),
                                   unit_from=f"patch_size {list(arch.patch_size)}", text_width=arch.text_dim,
                                   raw_latents=False, model="the Wan transformer", extras=self.extras())

    def extras(self) -> dict[str, tuple]:
        """The per-sample tensors an I2V run's precomputed rows carry (pan/recipes/wan/precompute.py)."""
        if self.conditioning != "i2v":
            return {}
        out = {CONDITION: ("C", "T", "H", "W")}
        if self.arch.image_dim is not None:
            out[IMAGE_EMBEDS] = (self.folder.image_rows, self.arch.image_dim)
        return out

    def wants_validation(self, step: int) -> bool:
        return False

    # -- one micro-batch -------------------------------------------------------------------------
    def sample_latent(self, sample) -> Tensor:
        """A sample's clean latent [C, T, H, W] (fp32) on this process's device."""
        if getattr(sample, "latent", None) is not None:
            return to_device(sample.latent, self.world.device).float()
        return self.encoders.latent(sample.frames)

    def caption_features(self, samples) -> list[Tensor]:
        """Each sample's caption rows [max_text_tokens, D] (fp32, zero rows after its real ones); with
        probability text_dropout_prob the empty caption's."""
        device, rows = self.world.device, self.job.model.max_text_tokens
        texts = [getattr(s, "text", None) for s in samples]
        need = [i for i, t in enumerate(texts) if t is None]
        if need:
            for i, features in zip(need, self.encoders.captions([samples[i].caption for i in need])):
                texts[i] = features
        p = self.job.tasks.text_dropout_prob
        return [padded(to_device(self._empty_text if self.rng.random() < p else t, device).float(), rows)
                for t in texts]

    def conditions(self, samples) -> list[dict[str, Tensor]]:
        """Each sample's I2V condition (its precomputed extras, or encoded from its frames), fp32 on this
        process's device; {} per sample for other runs."""
        if self.conditioning != "i2v":
            return [{} for _ in samples]
        out = []
        for sample in samples:
            precomputed = getattr(sample, "latent", None) is not None
            extras = sample.extras if precomputed else self.encoders.condition(sample.frames)
            out.append({k: to_device(extras[k], self.world.device).float() for k in self.extras()})
        return out

    def draw_timesteps(self, token_counts: list[int]) -> Tensor:
        """Each sample's t in [0, 1] (CPU), shifted by flow_shift; with one A14B expert trained, drawn
        again until inside its range (the draws' distribution restricted to it)."""
        n = len(token_counts)
        inside = self.expert_range()
        t = sample_timesteps(self.flow, n, token_counts, self.generator)
        if inside is None:
            return t
        out, need = t.clone(), ~inside(t)
        for _ in range(MAX_REDRAWS):
            if not need.any():
                return out
            t = sample_timesteps(self.flow, n, token_counts, self.generator)
            take = need & inside(t)
            out[take] = t[take]
            need &= ~take
        if need.any():
            raise RuntimeError(f"{MAX_REDRAWS} draws of the timesteps missed {self.trained[0]}'s range: with these "
                               "flow keys (flow_shift, flow_snr_type) it is almost never drawn; train the other "
                               "expert or change them.")
        return out

    def expert_range(self):
        """None, or (one A14B expert trained) the test `t -> t inside its range`."""
        if len(self.folder.experts) < 2 or len(self.trained) == 2:
            return None
        boundary = self.folder.boundary_ratio
        if self.trained[0] == "transformer":
            return lambda t: t >= boundary
        return lambda t: t < boundary

    def expert_of(self, t: float) -> str:
        """The part a sample of timestep t trains (diffusers' switch: high noise t >= boundary_ratio)."""
        if len(self.trained) == 1:
            return self.trained[0]
        return "transformer" if t >= self.folder.boundary_ratio else "transformer_2"

    def prepare(self, batch) -> WanBatch:
        """Raw packed batch -> each part's noisy inputs, targets and loss weights."""
        patch = self.arch.patch_size
        samples = batch.samples
        latents = [self.sample_latent(s) for s in samples]
        texts = self.caption_features(samples)
        conditions = self.conditions(samples)
        grids = [(t // patch[0], h // patch[1], w // patch[2]) for _, t, h, w in (x.shape for x in latents)]
        token_counts = [math.prod(g) for g in grids]
        sigmas = self.draw_timesteps(token_counts)
        scale = self.folder.num_train_timesteps
        per_token = self.conditioning == "ti2v"
        rows = []   # per sample: (x, target, weight, timesteps)
        for x0, sigma, grid, condition in zip(latents, sigmas.tolist(), grids, conditions):
            noise = to_device(torch.randn(x0.shape, generator=self.generator), x0.device)
            # (drawn for every clip, so the stream stays in step; a one-frame clip has nothing else to predict)
            given = per_token and self.rng.random() < self.job.tasks.image_cond_prob and x0.shape[1] > 1
            x_t = add_noise(x0, noise, sigma)
            frame_tokens = grid[1] * grid[2]
            weight = torch.ones(math.prod(grid), device=x0.device)
            timesteps = torch.full((math.prod(grid),), scale * sigma, device=x0.device)
            if given:   # the first latent frame is the condition: clean, at timestep 0, not predicted
                x_t[:, 0] = x0[:, 0]
                weight[:frame_tokens] = 0.0
                timesteps[:frame_tokens] = 0.0
            if CONDITION in condition:   # i2v: [x_t ; mask ; condition] on the channels
                x_t = torch.cat([x_t, first_frame_mask(x0), condition[CONDITION]])
            rows.append((patchify(x_t, patch), patchify(velocity_target(x0, noise), patch), weight, timesteps))
        self.bad_samples += sum(batch.skipped.values())
        parts, counted = {}, {}
        for name in self.trained:
            mine = [i for i, s in enumerate(sigmas.tolist()) if self.expert_of(s) == name]
            counted[name] = len(mine)
            parts[name] = self._inputs(mine or [0], rows, texts, grids, sigmas, per_token, batch,
                                       stand_in=not mine, images=[c.get(IMAGE_EMBEDS) for c in conditions])
        return WanBatch(parts=parts, sample_ids=[s.sample_id for s in samples], samples=len(samples),
                        tokens=sum(token_counts), packing=batch.packing_efficiency, bad_samples=self.bad_samples,
                        counted=counted)

    def _inputs(self, index: list[int], rows, texts, grids, sigmas, per_token: bool, batch,
                stand_in: bool, images: list[Tensor | None]) -> ModelInputs:
        x, target, weight, timesteps = (torch.cat([rows[i][k] for i in index]) for k in range(4))
        if stand_in:
            weight = torch.zeros_like(weight)
        if not per_token:
            timesteps = (sigmas[index] * self.folder.num_train_timesteps).to(x.device)
        text = torch.cat([texts[i] for i in index])
        image = None if images[index[0]] is None else torch.stack([images[i] for i in index])
        return ModelInputs(x=x, target=target, weight=weight, timesteps=timesteps, text=text,
                           pack=PackInfo.build([grids[i] for i in index], [texts[i].shape[0] for i in index]),
                           sample_ids=[batch.samples[i].sample_id for i in index], samples=len(index),
                           tokens=sum(math.prod(grids[i]) for i in index), packing=batch.packing_efficiency,
                           bad_samples=self.bad_samples, sigmas=sigmas[index].to(x.device), image=image)

    def share(self, batch: WanBatch | None) -> WanBatch:
        """cp rank 0's whole micro-batch -> this process's share, on its device (context_parallel.py)."""
        return share_batch(self.cp, batch).to(self.world.device)

    # -- the step --------------------------------------------------------------------------------
    def loss_count(self, inputs: ModelInputs) -> float:
        """Loss elements of these rows (summed over ranks to normalise the loss)."""
        return float(inputs.weight.sum().item()) * inputs.target.shape[1]

    def loss_sum(self, model, inputs: ModelInputs) -> Tensor:
        return loss_sum(model, inputs)

    def train_step(self, ctx, micro_batches: list[WanBatch]) -> dict[str, float]:
        """Each trained part's backward over its samples of every micro-batch and its update (see the
        module docstring); `loss` is the mean over every part's loss elements, `grad_norm` the norm of
        all updated parts' gradients together."""
        out, sums, counts, norms = {}, 0.0, 0.0, []
        distributed = self.world.size > 1
        for name in self.trained:
            part = ctx.parts[name]
            batches = [mb.parts[name] for mb in micro_batches]
            count = global_sum(sum(self.loss_count(b) for b in batches))
            samples = global_sum(sum(mb.counted[name] for mb in micro_batches))
            if count == 0:   # no sample of this expert in the whole step, on any rank
                part.optimizer.zero_grad(set_to_none=True)
                with warnings.catch_warnings():   # torch's "scheduler before optimizer": on purpose here
                    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
                    part.scheduler.step()
                continue
            if not distributed:   # stand-ins only keep the ranks' collectives in step
                batches = [b for b, mb in zip(batches, micro_batches) if mb.counted[name]]
            loss = ctx.backward_mean(part, batches, self.loss_sum, self.loss_count)
            norm = ctx.update(part, loss)
            sums, counts = sums + loss * count, counts + count
            norms.append(norm)
            if len(self.trained) > 1:
                out.update({f"loss/{name}": loss, f"grad_norm/{name}": norm, f"samples/{name}": samples})
        out["loss"] = sums / counts if counts else float("nan")
        out["grad_norm"] = math.sqrt(sum(n * n for n in norms))
        return out

    def flops(self, batches: list[WanBatch]) -> float:
        """Training FLOPs this process executes for these micro-batches (3x forward; stand-ins too)."""
        return sum(3 * self.models[name].forward_flops(
                       inputs.pack, 0 if inputs.image is None else inputs.image.shape[1])
                   for b in batches for name, inputs in b.parts.items()
                   if b.counted[name] or self.world.size > 1)


def loss_sum(model, inputs: ModelInputs) -> Tensor:
    """Sum of squared velocity errors over the loss elements of these rows, in fp32 at least."""
    out = model(inputs.x, inputs.timesteps, inputs.text, inputs.pack, image=inputs.image)
    dtype = torch.promote_types(out.dtype, torch.float32)
    err = (out.to(dtype) - inputs.target.to(dtype)).square().sum(dim=1)
    return (err * inputs.weight.to(dtype)).sum()


def first_frame_mask(x0: Tensor) -> Tensor:
    """WanImageToVideoPipeline's mask channels for a latent [C, T, H, W]: [4, T, H, W], 1 on the first
    latent frame (the given image's four pixel-frame slots), 0 on the others."""
    mask = x0.new_zeros(I2V_MASK_CHANNELS, *x0.shape[1:])
    mask[:, 0] = 1.0
    return mask
