"""Flow matching: training timesteps and noising (`flow`), and the Euler + CFG sampler (`sampler`)."""

from pan.diffusion.flow import FlowConfig, add_noise, dynamic_shift, sample_timesteps, shift_timesteps, velocity_target
from pan.diffusion.sampler import euler_sample, guided_velocity, known_frames, sampling_sigmas

__all__ = ["FlowConfig", "add_noise", "dynamic_shift", "sample_timesteps", "shift_timesteps",
           "velocity_target", "euler_sample", "guided_velocity", "known_frames", "sampling_sigmas"]
