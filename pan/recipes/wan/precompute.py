"""`pan data precompute` for the Wan recipe (its `precompute` hook): pan's precomputed CSVs, encoded
by the folder's own encoders.

For every row of every `video_csv_paths` CSV the engine (pan/data/precompute.py) decodes the clip with
the data pipeline's reader (the run's buckets, fps and frame rules); here its frames, uint8 -> [-1, 1],
are encoded by the folder's AutoencoderKLWan (fp32; the posterior mode, normalised per channel with
the VAE config's latents_mean / latents_std as diffusers' Wan pipelines do: (z - mean) / std) and its
caption by the folder's umT5 as WanPipeline encodes prompts (pan/recipes/wan/text.py). Written, as the
Pan recipe's are: `<csv stem>/<row>.safetensors` holding `latent` [C, T, H, W] and `text` [L, D]
(fp32, the L real token rows), `<csv stem>.csv` with `latent_path`, and once per folder
`empty_text.safetensors` (`text`: the empty caption's features), which training reads for the caption
dropout instead of loading umT5.

An I2V run's rows hold what WanImageToVideoPipeline conditions on besides (the reader passes them to
the task as the sample's `extras`, SampleFit.extras):
    condition      [C, T, H, W]  the VAE's normalised encoding of the clip's first frame followed by
                                 zero frames (the pipeline's `video_condition`), the latent's shape
    image_embeds   [Li, Di]      Wan 2.1 I2V: the CLIP image encoder's penultimate hidden states of
                                 the first frame (the pipeline's `encode_image`)
The mask channels are not stored: they follow from the latent's shape (first latent frame 1, else 0).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from pan.data.precompute import CsvFormat, Failure, PrecomputeError, PrecomputeReport, latent_settings, save_atomic
from pan.data.reader import rules_of
from pan.data.sources import VideoCsvSource, read_video_csv
from pan.encoders.text import frozen_dtype
from pan.encoders.vae import build_vae
from pan.recipes.wan.text import UMT5Encoder

EMPTY_TEXT = "empty_text.safetensors"
CONDITION, IMAGE_EMBEDS = "condition", "image_embeds"   # an I2V row's extra tensors (module docstring)


def settings_of(job) -> dict:
    """Every key a latent or text feature depends on: a rerun into DIR must match them."""
    folder = job.model.folder()
    settings = {**latent_settings(job),
                "text": {"text_encoder": str(folder.text_encoder_dir), "tokenizer": str(folder.tokenizer_dir),
                         "max_text_tokens": job.model.max_text_tokens}}
    if job.model.resolved_conditioning() == "i2v":   # (the keys of a T2V run's rows stay as they were)
        settings["i2v"] = {"image_encoder": str(folder.image_encoder_dir) if folder.image_encoder else None}
    return settings


def saved_empty_text(job) -> Path | None:
    """The empty caption's features `pan data precompute` wrote beside the run's first precomputed CSV
    that has them (None: none has)."""
    for path in job.data.video_csv_paths:
        saved = Path(path).parent / EMPTY_TEXT
        if saved.is_file():
            return saved
    return None


def read_empty_text(path: Path) -> torch.Tensor:
    return load_file(str(path))["text"]


class WanEncoders:
    """The folder's frozen VAE (fp32: Wan's own advice) and umT5 (bf16 on a GPU, fp32 on the CPU),
    used the same way online (WanTask) and here."""

    def __init__(self, job, device: torch.device, text: bool = True, vae: bool = True):
        folder = job.model.folder()
        self.device = device
        self.vae = build_vae(job.vae, device=device, dtype=torch.float32) if vae else None
        self.text = (UMT5Encoder(folder.path, job.model.max_text_tokens, device=device, dtype=frozen_dtype(device))
                     if text else None)
        self.i2v = job.model.resolved_conditioning() == "i2v"
        self.image = ClipImageEncoder(folder, device) if vae and self.i2v and folder.image_encoder else None

    @torch.no_grad()
    def latent(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 frames [T, 3, H, W] -> normalised latent [C, T', H', W'] (fp32, on the encoder's device)."""
        error = self.vae.geometry.clip_shape_error(frames.shape[0], frames.shape[2], frames.shape[3])
        if error:
            raise ValueError(error)
        pixels = frames.to(self.device).float().div(127.5).sub(1.0)  # uint8 -> [-1, 1]
        return self.vae.encode(pixels).float()

    def captions(self, captions: list[str]) -> list[torch.Tensor]:
        """Each caption's real-token features [L, D], fp32."""
        return [t.float() for t in self.text.encode(captions)]

    def condition(self, frames: torch.Tensor) -> dict[str, torch.Tensor]:
        """An I2V clip's extra tensors (module docstring) from its uint8 frames [T, 3, H, W]; {} for
        other runs."""
        if not self.i2v:
            return {}
        # the first frame in [-1, 1], then frames of 0 (the pipeline's zeros, after its [-1, 1] scaling)
        pixels = torch.zeros(frames.shape, device=self.device)
        pixels[0] = frames[0].to(self.device).float().div(127.5).sub(1.0)
        out = {CONDITION: self.vae.encode(pixels).float()}
        if self.image is not None:
            out[IMAGE_EMBEDS] = self.image.encode(frames[0])
        return out


class ClipImageEncoder:
    """Wan 2.1 I2V's image features as WanImageToVideoPipeline.encode_image makes them: the folder's
    image processor (the class its model_index.json names, as diffusers loads it) on the image, then
    the CLIP vision model's penultimate hidden states (fp32)."""

    def __init__(self, folder, device: torch.device):
        import transformers

        index = json.loads((folder.path / "model_index.json").read_text())
        processor_class = getattr(transformers, index["image_processor"][1])
        self.processor = processor_class.from_pretrained(str(folder.image_processor_dir), local_files_only=True)
        self.model = transformers.CLIPVisionModel.from_pretrained(str(folder.image_encoder_dir), local_files_only=True)
        self.model.to(device).eval().requires_grad_(False)
        self.device = device

    @torch.no_grad()
    def encode(self, image: torch.Tensor) -> torch.Tensor:
        """uint8 image [3, H, W] -> [Li, Di] (fp32)."""
        from PIL import Image

        pil = Image.fromarray(np.ascontiguousarray(image.permute(1, 2, 0).cpu().numpy()))
        inputs = self.processor(images=pil, return_tensors="pt").to(self.device)
        return self.model(**inputs, output_hidden_states=True).hidden_states[-2][0].float()


class WanFormat(CsvFormat):
    """A Wan job's video CSVs, encoded by its folder's VAE and umT5 (`WanEncoders`)."""

    def __init__(self, job):
        self.job, self.rules, self.encoders = job, rules_of(job.data), None

    def sources(self) -> list[VideoCsvSource]:
        job = self.job
        if job.data.annotation_paths:  # silently encoding only the CSVs would lose those rows
            raise PrecomputeError(f"annotation_paths is set ({', '.join(job.data.annotation_paths)}): the Wan "
                                  "recipe precomputes video CSVs only. List the clips in a CSV (path, caption) "
                                  "in video_csv_paths.")
        sources = [read_video_csv(p) for p in job.data.video_csv_paths]
        for source in sources:
            if source.precomputed:
                raise PrecomputeError(f"{source.path} is already precomputed (it has a latent_path column); "
                                      "list the source CSVs in video_csv_paths.")
        return sources

    def settings(self) -> dict:
        return settings_of(self.job)

    def load_encoders(self, device: torch.device) -> None:
        self.encoders = WanEncoders(self.job, device)

    def start(self, out_dir: Path, report: PrecomputeReport) -> None:
        path = out_dir / EMPTY_TEXT
        if not path.is_file():
            try:
                save_atomic({"text": self.encoders.captions([""])[0].cpu().contiguous()}, path)
            except Exception as e:  # noqa: BLE001 - reported like a row's failure
                report.failures.append(Failure(str(path), -1, "encode_error", f"{type(e).__name__}: {e}"))
                return
        report.empty_text = path

    def encode(self, source: VideoCsvSource, row: int, sample, out_dir) -> dict[str, torch.Tensor]:
        latent = self.encoders.latent(sample.frames)
        text = self.encoders.captions([sample.caption])[0]
        extras = self.encoders.condition(sample.frames)
        return {"latent": latent.cpu().contiguous(), "text": text.cpu().contiguous(),
                **{k: v.cpu().contiguous() for k, v in extras.items()}}

