"""`pan data precompute` for the Pan recipe (its `precompute` hook): pan's precomputed CSVs.

For every row of every `video_csv_paths` CSV the engine (pan/data/precompute.py) decodes the clip
with the data pipeline's reader; here it is normalised uint8 -> [-1, 1] and encoded by the run's
VAE, and its caption by the run's text encoder, exactly as online training does it
(`PanTask.sample_latent`, `caption_features`). The files and the CSVs with `latent_path` are the
engine's `CsvFormat`.
"""

from __future__ import annotations

import dataclasses

import torch

from pan.data.precompute import CsvFormat, PrecomputeError, latent_settings
from pan.data.reader import rules_of
from pan.data.sources import VideoCsvSource, read_video_csv
from pan.encoders.text import TextEncoder
from pan.encoders.vae import build_vae


def settings_of(job) -> dict:
    """Every key a latent or text feature depends on: a rerun into DIR must match them."""
    return {**latent_settings(job), "text_encoder": dataclasses.asdict(job.text_encoder)}


class Encoders:
    """The run's frozen VAE and text encoder, used the way PanTask uses them."""

    def __init__(self, job, device: torch.device):

        self.device = device
        self.text_encoder = TextEncoder(job.text_encoder, device=device)
        self.vae = build_vae(job.vae, device=device)

    @torch.no_grad()
    def encode(self, frames: torch.Tensor, caption: str) -> dict[str, torch.Tensor]:
        error = self.vae.geometry.clip_shape_error(frames.shape[0], frames.shape[2], frames.shape[3])
        if error:
            raise ValueError(error)
        pixels = frames.to(self.device).float().div(127.5).sub(1.0)  # uint8 -> [-1, 1]
        latent = self.vae.encode(pixels).float()                     # [C, T', H', W']
        text = self.text_encoder.encode([caption])[0].float()        # [L, D]
        return {"latent": latent.cpu().contiguous(), "text": text.cpu().contiguous()}


class PanFormat(CsvFormat):
    """A Pan job's video CSVs, encoded by its VAE and text encoder (`Encoders`)."""

    def __init__(self, job):
        self.job, self.rules, self.encoders = job, rules_of(job.data), None

    def sources(self) -> list[VideoCsvSource]:
        job = self.job
        if job.data.annotation_paths:  # silently encoding only the CSVs would lose those rows
            raise PrecomputeError(f"annotation_paths is set ({', '.join(job.data.annotation_paths)}): the Pan "
                                  "recipe precomputes video CSVs only. Train on the annotation files "
                                  "directly, or list the clips in a CSV (path, caption) in video_csv_paths.")
        sources = [read_video_csv(p) for p in job.data.video_csv_paths]
        for source in sources:
            if source.precomputed:
                raise PrecomputeError(f"{source.path} is already precomputed (it has a latent_path column); "
                                      "list the source CSVs in video_csv_paths.")
        return sources

    def settings(self) -> dict:
        return settings_of(self.job)

    def load_encoders(self, device: torch.device) -> None:
        self.encoders = Encoders(self.job, device)

    def encode(self, source: VideoCsvSource, row: int, sample, out_dir) -> dict[str, torch.Tensor]:
        return self.encoders.encode(sample.frames, sample.caption)
