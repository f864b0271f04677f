"""The Pan recipe: flow matching for PanVideoDiffusionTransformer on packed video + image batches."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from pan.data.build import build_data_loader
from pan.data.fit import SampleFit
from pan.diffusion.conditioning import condition_frames, model_input_latent
from pan.diffusion.flow import FlowConfig, add_noise, output_velocity, sample_timesteps, velocity_target
from pan.encoders.text import TextEncoder, frozen_dtype
from pan.encoders.vae import build_vae
from pan.data.media import to_uint8_frames, write_gif, write_mp4
from pan.models.packing import PackInfo, patchify
from pan.models.pan_dit import PanVideoDiffusionTransformer
from pan.recipes.packed import PackedInputs, PackedTask, to_device
from pan.recipes.pan.config import PanJobConfig
from pan.recipes.pan.sample import SampleSettings, sample_latent
from pan.task import PartSpec, autocast_context, global_sums

# ------------------------------------------------------------------------------------------------
# Training: raw batch -> model inputs -> loss
# ------------------------------------------------------------------------------------------------

@dataclass
class ModelInputs(PackedInputs):
    """One packed micro-batch of the Pan recipe (this process's rows of it):

        x           [Nv, in_ch * p]  noisy latents (+ condition latents + mask) as patch tokens
        target      [Nv, out_ch * p] velocity target
        weight      [Nv] 1 where the token counts in the loss, 0 on given (condition) frames
        timesteps   [B] sigma in [0, 1]
        text        [Nt, text_dim] caption features
    """


class PanTask(PackedTask):
    """Everything the Pan recipe adds to the packed-DiT loop (pan.recipes.packed): its model,
    encoders, data and loss.

    Only cp rank 0 of each context-parallel group reads data and runs the frozen encoders; the
    prepared micro-batch is broadcast to the group and each rank keeps its strided share. Noise,
    timesteps, caption dropout and condition frames are drawn from the streams `seed_draws_for`
    seeds afresh for each micro-batch.
    """

    def __init__(self, job: PanJobConfig, world, dims, cp=None):
        super().__init__(job, world, dims, cp)
        self.arch = job.model.transformer_config_overrides
        self.text_encoder = self.vae = None
        self._empty_text: Tensor | None = None

    # -- what gets built -------------------------------------------------------------------------
    def part_specs(self) -> list[PartSpec]:
        """One part, the transformer, trained by the default step with the run's optimizer keys."""
        lora = self.job.lora if self.job.lora.enabled else None
        return [PartSpec("transformer", self.build_model, self.job.optim, warm_start=True, lora=lora)]

    def build_model(self) -> PanVideoDiffusionTransformer:
        """The transformer on the meta device (the trainer parallelises and initialises it)."""
        with torch.device("meta"):
            self.model = PanVideoDiffusionTransformer(
                self.arch, zero_init_modulation=self.job.model.zero_init_modulation,
                attention_backend=self.job.model.attention_backend)
        return self.model

    def load_encoders(self) -> None:
        """Frozen text encoder and VAE, on the processes that read data: in bf16 on a GPU (their
        outputs are used in fp32), in fp32 on the CPU."""
        if not self.reads_data:
            return

        device = self.world.device
        self.text_encoder = TextEncoder(self.job.text_encoder, device=device)
        self.vae = build_vae(self.job.vae, device=device, dtype=frozen_dtype(device))
        self._empty_text = self.text_encoder.empty_embedding().float()

    def latent_tokens_of(self, t: int, h: int, w: int) -> int:
        pt, ph, pw = self.arch.patch_size
        return (t // pt) * (h // ph) * (w // pw)

    def sample_fit(self) -> SampleFit:
        """The transformer's latents (out_channels, whole patches) and caption width; annotation
        rows' Pyramid-Flow latents are not taken (another VAE's, unnormalised)."""
        arch = self.arch
        return dataclasses.replace(super().sample_fit(), channels=arch.out_channels, unit=tuple(arch.patch_size),
                                   unit_from=f"patch_size {list(arch.patch_size)}", text_width=arch.text_embed_dim,
                                   raw_latents=False)

    # -- one micro-batch -------------------------------------------------------------------------
    def sample_latent(self, sample) -> Tensor:
        """A sample's clean latent [C, T, H, W] (fp32) on this process's device: precomputed (read
        on the host), or encoded from its frames by the VAE."""
        if getattr(sample, "latent", None) is not None:
            return to_device(sample.latent, self.world.device).float()
        if getattr(sample, "raw_latent", None) is not None:
            raise ValueError(f"{sample.sample_id} carries a Pyramid-Flow latent (unnormalised, for that "
                             "model's VAE): the Pan recipe encodes frames with its own VAE or reads pan's "
                             "precomputed CSVs. Remove annotation rows with `latent` from this run.")
        frames = to_device(sample.frames, self.world.device).float().div(127.5).sub(1.0)  # uint8 -> [-1, 1]
        with torch.no_grad():
            return self.vae.encode(frames).float()

    def caption_features(self, samples, drop: bool = True) -> list[Tensor]:
        """Caption features per sample (fp32, on this process's device: precomputed rows arrive on
        the host, encoded ones on the encoder's device); with probability cfg_drop_prob, the empty
        caption's."""
        device = self.world.device
        texts = [getattr(s, "text", None) for s in samples]
        need = [i for i, t in enumerate(texts) if t is None]
        if need:
            encoded = self.text_encoder.encode([samples[i].caption for i in need])
            for i, features in zip(need, encoded):
                texts[i] = features
        p = self.job.tasks.cfg_drop_prob if drop else 0.0
        return [to_device(self._empty_text if self.rng.random() < p else t, device).float() for t in texts]

    def prepare(self, batch, fixed_sigma: float | None = None, training: bool = True) -> ModelInputs:
        """Raw packed batch -> noisy inputs, targets and loss weights (all samples, all tokens).

        Validation passes `fixed_sigma` and `training=False`: no caption dropout, no condition frames.
        """
        patch = self.arch.patch_size
        samples = batch.samples
        latents = [self.sample_latent(s) for s in samples]
        texts = self.caption_features(samples, drop=training)
        grids = [(t // patch[0], h // patch[1], w // patch[2]) for _, t, h, w in (x.shape for x in latents)]
        token_counts = [gt * gh * gw for gt, gh, gw in grids]
        if fixed_sigma is None:
            sigmas = sample_timesteps(self.job.flow, len(samples), token_counts, self.generator)
        else:
            sigmas = torch.full((len(samples),), float(fixed_sigma))
        xs, targets, weights = [], [], []
        for x0, sigma in zip(latents, sigmas):
            noise = to_device(torch.randn(x0.shape, generator=self.generator), x0.device)
            given = condition_frames(self.job.tasks, x0.shape[1], self.rng) if training else 0
            x_t = add_noise(x0, noise, sigma.item())
            xs.append(patchify(model_input_latent(x_t, x0, given, self.job.tasks.conditioning_schema), patch))
            targets.append(patchify(velocity_target(x0, noise), patch))
            frame_weight = torch.ones(x0.shape[1], device=x0.device)
            frame_weight[:given] = 0.0  # given frames are inputs, not predictions
            w = frame_weight[:, None, None].expand(x0.shape[1:])[None]
            weights.append(patchify(w, patch).amax(dim=1))
        pack = PackInfo.build(grids, [t.shape[0] for t in texts])
        self.bad_samples += sum(batch.skipped.values())
        return ModelInputs(
            x=torch.cat(xs), target=torch.cat(targets), weight=torch.cat(weights),
            timesteps=sigmas.to(xs[0].device), text=torch.cat(texts), pack=pack,
            sample_ids=[s.sample_id for s in samples], samples=len(samples), tokens=sum(token_counts),
            packing=batch.packing_efficiency, bad_samples=self.bad_samples)

    def loss_count(self, inputs: ModelInputs) -> float:
        """Loss elements of this process's rows (summed over ranks to normalise the loss)."""
        return float(inputs.weight.sum().item()) * inputs.target.shape[1]

    def loss_sum(self, model, inputs: ModelInputs) -> Tensor:
        return loss_sum(model, inputs, self.job.flow)

    # -- validation ----------------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self, parts, step: int, output_dir) -> dict:
        """Held-out loss at fixed timesteps and samples of the validation prompts.

        Every rank takes part (sharded models need all ranks in each forward); only the main
        process writes files.
        """
        model = parts["transformer"].model
        results = {}
        if self.job.validation.validation_csv:
            results.update(self.heldout_loss(model))
        if self.job.validation.validation_prompts:
            self.write_samples(model, step, Path(output_dir) / "samples" / f"step-{step:08d}")
        return results

    def validation_precision(self):
        """The training step's precision for the transformer's forwards in validation (bf16
        autocast with `dtype: bf16`), on one process as under FSDP; the frozen encoders run as in
        `prepare`."""
        return autocast_context(self.job.trainer.dtype, self.world.device)

    def heldout_loss(self, model) -> dict:
        """Loss on the first held-out batch of this rank at each of validation_timesteps, with the
        same clips and noise every time, so values are comparable across a run."""

        cfg = dataclasses.replace(self.job.data, video_csv_paths=[self.job.validation.validation_csv],
                                  video_csv_weights=None, annotation_paths=[], annotation_weights=None,
                                  image_tar_paths=[], image_sample_prob=0.0,
                                  packed_dataloader_num_workers=0)
        out = {}
        batch = None
        if self.reads_data:
            loader = build_data_loader(cfg, tokens_of=self.tokens_of, dp_rank=self.dp_rank,
                                       dp_size=self.dims.dp, seed=self.job.trainer.seed,
                                       latent_tokens_of=self.latent_tokens_of, fit=self.sample_fit())
            batch = next(iter(loader))
            loader.close()
        for sigma in self.job.validation.validation_timesteps:
            inputs = None
            if self.reads_data:  # (each training micro-batch seeds its own draws again)
                self.generator.manual_seed(self.job.validation.validation_noise_seed)
                self.rng.seed(self.job.validation.validation_noise_seed)
                inputs = self.prepare(batch, fixed_sigma=sigma, training=False)
            inputs = self.share(inputs)
            with self.validation_precision():
                sse = self.loss_sum(model, inputs).item()
            sse, count = global_sums([sse, self.loss_count(inputs)])
            out[f"heldout_loss@{sigma:g}"] = sse / count
        return out

    def prompt_features(self, prompts: list[str]) -> tuple[list[Tensor], Tensor]:
        """Caption features of `prompts` and of the empty caption on every rank of the cp group
        (only cp rank 0 holds the text encoder; it sends them, on the host, to the others)."""
        feats = None
        if self.reads_data:
            feats = ([t.float().cpu() for t in self.text_encoder.encode(prompts)], self._empty_text.cpu())
        if self.cp is not None and self.cp.size > 1:
            box = [feats]
            dist.broadcast_object_list(box, group=self.cp.group, group_src=0, device=self.cp.device)
            feats = box[0]
        return [t.to(self.world.device) for t in feats[0]], feats[1].to(self.world.device)

    def write_samples(self, model, step: int, out_dir: Path) -> list[Path]:
        """Sample every validation prompt (all ranks together: the model is sharded), then decode and
        write the videos, the prompts shared out over the data-reading ranks (each holds a VAE and
        every sampled latent). Decoding and video encoding are the long single-rank work of a
        validation; split this way no rank keeps the others waiting in the next collective for
        more than its share. Returns the videos this rank wrote."""

        v = self.job.validation
        texts, empty = self.prompt_features(v.validation_prompts)
        shape = self.geometry.latent_shape(v.sample_num_frames, v.sample_height, v.sample_width)
        settings = SampleSettings(v.sample_num_frames, v.sample_height, v.sample_width, v.sample_steps,
                                  v.sample_guidance_scale, v.sample_shift, seed=self.job.trainer.seed,
                                  fresh_noise=v.sample_fresh_noise)
        with self.validation_precision():
            latents = [sample_latent(model, schema=self.job.tasks.conditioning_schema, flow=self.job.flow,
                                     patch=self.arch.patch_size, latent_shape=shape, text=text,
                                     empty_text=empty, settings=dataclasses.replace(settings, seed=settings.seed + i),
                                     device=self.world.device)
                       for i, text in enumerate(texts)]
        written = []
        for i in prompts_written_by(len(latents), self.dp_rank, self.dims.dp) if self.reads_data else ():
            out_dir.mkdir(parents=True, exist_ok=True)
            frames = to_uint8_frames(self.vae.decode(latents[i]))
            stem = out_dir / f"{i:02d}"
            write_mp4(stem.with_suffix(".mp4"), frames, fps=v.sample_fps)
            write_gif(stem.with_suffix(".gif"), frames, fps=v.sample_fps)
            stem.with_suffix(".txt").write_text(v.validation_prompts[i] + "\n")
            written.append(stem.with_suffix(".mp4"))
        return written


def loss_sum(model, inputs: ModelInputs, flow: FlowConfig) -> Tensor:
    """Sum of squared velocity errors over the loss elements of this process's rows (its cp share:
    `pack.video_sample` names each row's sample)."""
    out = model(inputs.x, inputs.timesteps, inputs.text, inputs.pack).float()
    x_t = inputs.x[:, :out.shape[1]]  # a token's first values are x_t's (channel-major patches)
    pred = output_velocity(flow, out, x_t, inputs.timesteps[inputs.pack.video_sample])
    err = (pred - inputs.target).square().sum(dim=1)
    return (err * inputs.weight).sum()


def prompts_written_by(num_prompts: int, reader: int, readers: int) -> range:
    """The validation prompts data-reading rank `reader` (its dp rank) of `readers` decodes and writes."""
    return range(reader, num_prompts, readers)
