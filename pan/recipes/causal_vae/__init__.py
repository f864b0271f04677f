"""The causal video VAE recipe: Pyramid-Flow's two-stage VAE training on pan's trainer.

Two trained parts: `vae` (the causal video VAE with the loss's learnable log-variance, which the
original never optimises) and, when `add_discriminator` is on, `discriminator` (a PatchGAN with its
own `disc_*` optimizer keys, LR schedule and checkpoint state). One step:

    VAE:            loss = mean over samples of [ nll + kl_weight * kl + d_weight * g ]
                    nll = per-frame (pixel_weight * pixel + perceptual_weight * LPIPS) / exp(logvar)
                          + logvar, averaged over the sample's frames; kl summed over the sample's
                          latent voxels, averaged over channels; g = -mean D(x_hat) once
                          step >= disc_start, d_weight = the adaptive weight at the decoder's last
                          layer (from the gradients of the whole micro-batch, summed over all ranks)
    discriminator:  hinge loss on x and the detached x_hat (only once step >= disc_start: before,
                    its optimizer is not stepped at all, so weight decay cannot move it; its LR
                    schedule counts the run's steps, as the original's does)

A batch mixes images (1-frame clips) and videos per sample (the original mixes per rank), each
video a random window of `max_frames` frames after `target_fps` resampling, resized and cropped to
a `resolution_buckets` size. With `context_size` > 1 each clip's frames are split in time over a
context group (pan/parallel/vae_context.py): each rank decodes only its own frames and runs the
VAE on them; losses and gradients equal the single-rank result.

Stage 2 warm-starts from a stage-1 checkpoint (`warm_start_checkpoint`), and a stage-2 config whose
`output_dir` holds another run's checkpoints is refused (the original's shared output folder makes
stage 2 resume stage 1 and stop at once). Keys, stages and the original's flags: docs/causal_vae.md.

The package, one job a module: config.py (keys and config-time rules), model.py (the trained parts),
data.py (clips and micro-batches), objective.py (the losses), task.py (the Task), checks.py (`pan
check`), export.py (a checkpoint as a released folder: `python -m pan.recipes.causal_vae export`),
quality.py (PSNR and SSIM), demo.py (`pan demo --recipe causal_vae`).
This module imports only the config (the record names everything else lazily) and sets the
recipe's warning filter.
"""

import warnings

from pan.recipe import Recipe, Workflow
from pan.recipes.causal_vae.config import CausalVAEJobConfig

# Set by any import of the recipe, so before any of its parts trains.
# Before disc_start the discriminator's schedule advances without an optimizer step, on purpose.
warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")

RECIPE = Recipe(
    name="causal_vae", job_config=CausalVAEJobConfig, task="pan.recipes.causal_vae.task:CausalVAETask",
    description="Pyramid-Flow's causal video VAE: reconstruction + LPIPS + KL, then a GAN, with VAE "
                "context parallel",
    checks="pan.recipes.causal_vae.checks:CHECKS", probe="pan.recipes.causal_vae.checks:vae_probe",
    exports={"causal_video_vae": "pan.recipes.causal_vae.export:released_folder_of"},
    demo="pan.recipes.causal_vae.demo:demo",
    workflows=(Workflow(
        name="causal-video-vae", recipe="causal_vae", default_config="config/causal_vae_stage1.yaml",
        script="scripts/train_causal_video_vae.sh",
        description="causal video VAE: stage 1 (images + 17-frame videos), stage 2 (33 frames, context 2, GAN)",
        stages={"1": "config/causal_vae_stage1.yaml", "2": "config/causal_vae_stage2.yaml"},
        check="pan.recipes.causal_vae.checks:check_launch"),))
