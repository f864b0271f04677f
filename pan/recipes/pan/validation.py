"""Validation during training: fixed-prompt samples and held-out loss at fixed timesteps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pan.config.core import knob, require


@dataclass(kw_only=True)
class ValidationConfig:
    SECTION: ClassVar[str] = "output"

    validation_interval: int = knob(0, "every this many steps, sample validation_prompts and compute "
                                       "the held-out loss (0: never)", ge=0)
    validation_prompts: list[str] = knob([], "prompts sampled at each validation (videos saved beside "
                                             "the checkpoints)")
    validation_csv: str | None = knob(None, "held-out clips (video CSV) for the validation loss at "
                                            "fixed timesteps")
    validation_timesteps: list[float] = knob([0.25, 0.5, 0.75], "sigmas at which the held-out loss is "
                                             "measured (same noise every time)", ge=0.0, le=1.0)
    validation_noise_seed: int = knob(12345, "seed of the held-out loss's noise and draws (the same at "
                                             "every validation, so values compare across a run)", ge=0)
    sample_steps: int = knob(30, "sampling steps", ge=1)
    sample_guidance_scale: float = knob(2.5, "classifier-free guidance scale when sampling (1: off)",
                                        ge=0.0)
    sample_shift: float = knob(9.0, "timestep shift s of the sampling schedule "
                                    "s*sigma / (1 + (s - 1)*sigma)", gt=0.0)
    sample_fresh_noise: float = knob(0.0, "share of fresh noise in each sampling step: 0 = Euler (the "
                                          "flow's ODE), 1 = re-noise the predicted clean sample with "
                                          "fresh noise only (sharper, less diverse; "
                                          "pan.diffusion.sampler.renoise_step)", ge=0.0, le=1.0)
    sample_num_frames: int = knob(121, "frames of validation samples (pixel frames)", ge=1)
    sample_height: int = knob(704, "height of validation samples in pixels", ge=1)
    sample_width: int = knob(1248, "width of validation samples in pixels", ge=1)
    sample_fps: float = knob(8.0, "frame rate of the validation videos written (MP4 and GIF)", gt=0.0)

    def check(self, job) -> None:
        if self.validation_interval:
            require(bool(self.validation_prompts or self.validation_csv), "validation_interval",
                    "is set but there is nothing to validate: give validation_prompts and/or "
                    "validation_csv, or set validation_interval: 0.")
