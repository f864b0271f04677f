"""The Wan recipe's keys: the job config and the components only this recipe reads.

The model is a diffusers Wan folder (`model_path`, read by pan/recipes/wan/folder.py): the transformer(s)
to fine-tune, the VAE and umT5 text encoder that `pan data precompute` encodes with, and the scheduler
whose `flow_shift` training uses too. Nothing is downloaded.

Timesteps (`WanFlowConfig`, YAML section `diffusion`) reuse pan.diffusion.flow's sampler; the keys map
one to one except the shift:

    this recipe          pan.diffusion.flow.FlowConfig
    -----------          -----------------------------
    flow_shift           train_timestep_shift, with train_timestep_shift_mode: fixed (null here = the
                         folder's scheduler flow_shift, which Wan's sampler uses at every step)
    flow_snr_type        flow_snr_type (default here: uniform, Wan's own)
    flow_lognorm_loc     flow_lognorm_loc
    flow_lognorm_scale   flow_lognorm_scale
    flow_mode_scale      flow_mode_scale
    (none)               prediction_type: Wan predicts the velocity noise - x0
    (none)               dynamic shift: Wan's shift is the scheduler's constant

Experts (A14B): `transformer` denoises t >= boundary_ratio (high noise), `transformer_2` the rest, as
diffusers' pipeline switches them. `wan_experts: both` trains both parts, each sample's (shifted) t
picking its expert; `high_noise` / `low_noise` train one, with t drawn from the same distribution
restricted to that expert's range (redrawn until inside it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch

from pan.checkpoint.manager import CheckpointConfig
from pan.config import JobConfig
from pan.config.core import ConfigError, ConfigErrors, knob, reject_unused, require
from pan.data.config import DataConfig, parse_bucket
from pan.diffusion.flow import MODE_SCALE_MAX, FlowConfig
from pan.encoders.vae import VAEConfig
from pan.lora.adapters import LoraConfig, candidate_names
from pan.optim.config import prefixed_optim_config
from pan.parallel.dims import ParallelConfig
from pan.parallel.world import ProcessConfig
from pan.recipes.wan.folder import EXPERT_NAMES, VAE_CLASS, WanFolder, missing_weights, read_folder
from pan.recipes.wan.model import WanTransformer
from pan.runtime.metrics import MetricsConfig
from pan.runtime.watchdog_config import WatchdogConfig
from pan.trainer import TrainerConfig

# The optimizer keys of every trained expert (A14B both: each its own optimizer with these keys). AdamW:
# the transformer declares no hidden matrices for Muon.
WanOptimConfig = prefixed_optim_config("", "training", "each trained expert's optimizer keys (AdamW)",
                                       use_muon=False)


@dataclass(kw_only=True)
class WanModelConfig:
    SECTION: ClassVar[str] = "model"

    model_path: str | None = knob(
        None, "local diffusers Wan folder (model_index.json, transformer/ [+ transformer_2/], vae/, text_encoder/, "
              "tokenizer/, scheduler/), e.g. Wan2.1-T2V-1.3B-Diffusers; its transformer(s) are the warm start, "
              "loaded strictly; never downloaded", non_empty=True)
    wan_experts: Literal["high_noise", "low_noise", "both"] | None = knob(
        None, "A14B folders (transformer + transformer_2): which expert(s) to train: high_noise (`transformer`, "
              "t >= boundary_ratio), low_noise (`transformer_2`), both (two parts, each sample's t picks one); "
              "null = every transformer of the folder (one for 2.1 and TI2V folders, both for A14B)")
    conditioning: Literal["t2v", "ti2v", "i2v"] | None = knob(
        None, "what the model is trained to do: t2v (text only), ti2v (Wan 2.2 TI2V: the first latent frame is "
              "given clean at timestep 0 with probability image_cond_prob), i2v (Wan 2.1 I2V / 2.2 I2V A14B: every "
              "clip conditioned on its first frame through the mask and condition channels, and CLIP rows "
              "where the folder has an image encoder); null = the folder's (ti2v where model_index.json sets "
              "expand_timesteps, i2v where the transformer takes condition channels, else t2v)")
    max_text_tokens: int = knob(
        512, "umT5 tokens per caption (truncated; the features after the real tokens are zero rows, as "
             "WanPipeline pads them; the transformer sees this many rows per caption)", ge=1)
    attention_backend: Literal["auto", "sdpa", "flex", "varlen"] = knob(
        "auto", "self-attention kernel: sdpa (CPU and reference), flex (CUDA), varlen (CUDA), auto (the fastest "
                "exact one, measured on the first pack and kept in the checkpoint)")

    def folder(self) -> WanFolder:
        return read_folder(self.model_path)

    def trained_experts(self) -> tuple[str, ...]:
        """The transformer subfolders this run trains (part names), high-noise first."""
        folder = self.folder()
        if self.wan_experts in (None, "both"):
            return folder.experts
        return (EXPERT_NAMES[self.wan_experts],)

    def resolved_conditioning(self) -> str:
        return self.conditioning or self.folder().derived_conditioning

    def check(self, job) -> None:
        folder = self.folder()
        require(self.wan_experts is None or len(folder.experts) == 2, "wan_experts",
                f"is {self.wan_experts}, but {folder.path} holds one transformer (no transformer_2 and "
                "boundary_ratio: not an A14B release). Remove wan_experts.")
        missing = []   # the weights the run loads at start: refused here, before any model is built
        for name in self.trained_experts():
            what = missing_weights(folder, name)
            if what is not None:
                role = (f" (the {'high' if name == 'transformer' else 'low'}-noise expert)"
                        if len(folder.experts) == 2 else "")
                missing.append(ConfigError(
                    "model_path", f"{what}: the run trains {name}/{role} and loads its weights when it starts. "
                                  f"Put the release's {name}/ folder there whole (config.json with "
                                  "diffusion_pytorch_model.safetensors, or the index and every shard it names), or "
                                  "point model_path at a complete folder."))
        if missing:
            raise missing[0] if len(missing) == 1 else ConfigErrors(missing)
        derived = folder.derived_conditioning
        chosen = self.resolved_conditioning()
        require(derived != "i2v" or chosen == "i2v", "conditioning",
                f"is {chosen}, but {folder.path} is an image-to-video release (its transformer takes "
                f"{folder.transformer.in_channels} channels: noisy latent, mask and condition latent). Use i2v "
                "(or null).")
        require(derived != "i2v" or folder.transformer.pos_embed_seq_len is None, "model_path",
                f"{folder.path} is a first-last-frame (FLF2V) release (pos_embed_seq_len "
                f"{folder.transformer.pos_embed_seq_len}): its training is not built. Use an I2V, T2V or TI2V folder.")
        require(chosen != "i2v" or derived == "i2v", "conditioning",
                f"is i2v, but the transformer of {folder.path} takes only the noisy latent "
                f"({folder.transformer.in_channels} channels): it is a {derived} release. Use {derived} (or null).")
        if chosen == "ti2v":
            require(folder.expand_timesteps, "conditioning",
                    f"is ti2v, but {folder.path}/model_index.json does not set expand_timesteps: only Wan 2.2 "
                    "TI2V models were trained with a clean first frame at timestep 0. Use t2v (or null).")
            require(folder.transformer.patch_size[0] == 1, "conditioning",
                    f"is ti2v, which gives the first latent frame's tokens timestep 0, but patch_size "
                    f"{folder.transformer.patch_size} puts several latent frames in one token. Use t2v.")
        check_buckets(job, folder)
        check_shared_keys(job)


def check_buckets(job, folder: WanFolder) -> None:
    """Buckets in whole transformer patches of the VAE's latent cells, and clip lengths the VAE encodes."""
    factor = 2 ** (len(folder.vae["dim_mult"]) - 1) * (folder.vae.get("patch_size") or 1)
    _, ph, pw = folder.transformer.patch_size
    bad = []
    for text in job.data.resolution_buckets:
        try:
            height, width = parse_bucket(text)
        except ValueError:
            continue  # the data config's own check reports it
        if height % (factor * ph) or width % (factor * pw):
            bad.append(text)
    require(not bad, "resolution_buckets",
            f"{', '.join(bad)}: with this Wan folder a bucket's width must be a multiple of {factor * pw} and its "
            f"height of {factor * ph} pixels (the VAE divides them by {factor}, patch_size "
            f"{folder.transformer.patch_size} groups {ph}x{pw} latent cells). Use such buckets.")
    temporal = 2 ** sum(folder.vae["temperal_downsample"])
    counts = job.data.frame_count_range()
    wrong = [n for n in counts if (n - 1) % temporal]
    require(not wrong, "frames_mod",
            f"is {job.data.frames_mod} with frames_remainder {job.data.frames_remainder}, which allows clips of "
            f"{', '.join(map(str, wrong[:4]))} frames; Wan's VAE ({temporal}x in time) encodes 1 + {temporal}k "
            f"frames. Set frames_mod: {temporal} and frames_remainder: 1.")


@dataclass(kw_only=True)
class WanFlowConfig:
    """Training timesteps (see the module docstring for the mapping onto pan.diffusion.flow)."""
    SECTION: ClassVar[str] = "diffusion"

    flow_shift: float | None = knob(
        None, "shift s of training timesteps, t' = s t / (1 + (s - 1) t) (t = 1: noise); null = the folder's "
              "scheduler flow_shift (the one Wan samples with: 3.0 for 480p, 5.0 for 720p releases)", gt=0)
    flow_snr_type: Literal["uniform", "lognorm", "mix", "mode"] = knob(
        "uniform", "how t is drawn before the shift: uniform (Wan's), logit-normal, mix (logit-normal with "
                   "probability 0.7, else uniform) or SD3 mode sampling")
    flow_lognorm_loc: float = knob(0.0, "mean of the normal whose sigmoid is t (lognorm and mix)")
    flow_lognorm_scale: float = knob(1.0, "std of the normal whose sigmoid is t (lognorm and mix)", gt=0)
    flow_mode_scale: float = knob(1.29, "scale s of SD3 mode sampling (mode only)", ge=-1.0, le=MODE_SCALE_MAX)

    def shift(self, job) -> float:
        if self.flow_shift is not None:
            return self.flow_shift
        shift = job.model.folder().flow_shift
        if shift is None:
            raise ConfigError("flow_shift", f"is null, and {job.model.folder().path}/scheduler/scheduler_config.json "
                                            "gives none: set flow_shift (Wan: 3.0 at 480p, 5.0 at 720p).")
        return float(shift)

    def flow(self, job) -> FlowConfig:
        """The pan.diffusion.flow config these keys stand for."""
        return FlowConfig(flow_snr_type=self.flow_snr_type, flow_lognorm_loc=self.flow_lognorm_loc,
                          flow_lognorm_scale=self.flow_lognorm_scale, flow_mode_scale=self.flow_mode_scale,
                          train_timestep_shift=self.shift(job), train_timestep_shift_mode="fixed")

    def check(self, job) -> None:
        try:
            job.model.folder()
        except ConfigError:
            return  # the model's own check reports it
        lognorm = self.flow_snr_type in ("lognorm", "mix")
        reject_unused(self, job, "flow_lognorm_loc", lognorm, "applies only with flow_snr_type lognorm or mix")
        reject_unused(self, job, "flow_lognorm_scale", lognorm, "applies only with flow_snr_type lognorm or mix")
        reject_unused(self, job, "flow_mode_scale", self.flow_snr_type == "mode",
                      "applies only with flow_snr_type mode")
        self.shift(job)


@dataclass(kw_only=True)
class WanTaskConfig:
    SECTION: ClassVar[str] = "tasks"

    text_dropout_prob: float = knob(
        0.1, "probability that a caption is replaced by the empty caption's features (WanPipeline's default "
             "negative prompt), for classifier-free guidance", ge=0.0, le=1.0)
    image_cond_prob: float = knob(
        0.5, "ti2v: probability that a clip trains image-to-video (its first latent frame given clean at timestep "
             "0 and left out of the loss); the others train text-to-video", ge=0.0, le=1.0)

    def check(self, job) -> None:
        try:
            job.model.folder()
        except ConfigError:
            return  # the model's own check reports it
        reject_unused(self, job, "image_cond_prob", job.model.resolved_conditioning() == "ti2v",
                      "applies only with conditioning ti2v (a Wan 2.2 TI2V folder)")


@dataclass(kw_only=True)
class WanJobConfig(JobConfig):
    READS_PREDICTION_TYPE: ClassVar[bool] = False   # Wan predicts the velocity
    model: WanModelConfig = knob(WanModelConfig(), "")
    flow: WanFlowConfig = knob(WanFlowConfig(), "")
    tasks: WanTaskConfig = knob(WanTaskConfig(), "")
    trainer: TrainerConfig = knob(TrainerConfig(), "")
    watchdog: WatchdogConfig = knob(WatchdogConfig(), "")
    optim: WanOptimConfig = knob(WanOptimConfig(), "")
    data: DataConfig = knob(DataConfig(), "")
    parallel: ParallelConfig = knob(ParallelConfig(), "")
    process: ProcessConfig = knob(ProcessConfig(), "")
    checkpoint: CheckpointConfig = knob(CheckpointConfig(), "")
    logging: MetricsConfig = knob(MetricsConfig(), "")
    lora: LoraConfig = knob(LoraConfig(), "")

    @property
    def vae(self) -> VAEConfig:
        """The folder's VAE as pan's frozen-VAE config (what the packed loop, the data geometry and
        `pan data precompute`'s settings read): not keys of their own, the folder decides."""
        path = None if self.model.model_path is None else str(Path(self.model.model_path).expanduser() / "vae")
        return VAEConfig(vae_type="diffusers", vae_path=path, vae_class=VAE_CLASS)

    def attention_heads(self) -> int | None:
        try:
            return self.model.folder().transformer.num_attention_heads
        except ConfigError:
            return None

    def lora_candidates(self) -> list[str]:
        """The linears `lora_target_modules` may name (the transformer built on the meta device)."""
        with torch.device("meta"):
            return candidate_names(WanTransformer(self.model.folder().transformer))


def check_shared_keys(job: WanJobConfig) -> None:
    """Rules on shared keys that only this recipe's model imposes (called from WanModelConfig's check)."""
    require(not job.optim.use_muon, "use_muon",
            "is true, but Wan's transformer declares no hidden matrices for Muon: set use_muon: false (AdamW).")
