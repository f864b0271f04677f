"""The `data` keys: sources, resolution and frame rules, token budgets, workers and resume."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from pan.config.core import ConfigError, knob, require


def parse_bucket(text: str) -> tuple[int, int]:
    """"1248x704" -> (height 704, width 1248). Buckets are written WIDTHxHEIGHT, like ffmpeg."""
    parts = str(text).lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{text!r} is not WIDTHxHEIGHT (for example 1248x704)")
    width, height = (int(p) for p in parts)
    return height, width


def valid_frame_count(n: int, mod: int, remainder: int) -> bool:
    return n % mod == remainder % mod


@dataclass(kw_only=True)
class DataConfig:
    SECTION: ClassVar[str] = "data"
    TRAINING_ONLY: ClassVar[bool] = True  # not checked where a trained model is only used (pan sample)

    # --- sources ---------------------------------------------------------------------------------
    video_csv_paths: list[str] = knob(
        [], "CSV files of video clips (columns path, caption; optional fps, num_frames, width, height, "
            "start_time, end_time) or of precomputed rows (a latent_path column)")
    video_csv_weights: list[float] | None = knob(
        None, "relative sampling weight of each video CSV; null = proportional to its number of rows "
              "(every clip equally likely)", gt=0)
    annotation_paths: list[str] = knob(
        [], "JSONL annotation files as Pyramid-Flow writes them: video rows (video, text; optional "
            "latent, text_fea, frames) and image rows (image, text); paths relative to the file or "
            "absolute")
    annotation_weights: list[float] | None = knob(
        None, "relative sampling weight of each annotation file, on the scale of video_csv_weights "
              "(give both lists or neither); null = proportional to its number of rows", gt=0)
    image_tar_paths: list[str] = knob(
        [], "webdataset tars of images (key.jpg|png|webp + key.txt or key.json caption); an image is "
            "a 1-frame video")
    image_sample_prob: float = knob(
        0.0, "probability that the next sample is an image rather than a video (0 for SFT, 1 for an "
             "image-only run)", ge=0.0, le=1.0)

    # --- what a sample looks like ----------------------------------------------------------------
    resolution_buckets: list[str] = knob(
        ["1248x704", "704x1248", "960x960"], "output sizes WIDTHxHEIGHT; each clip goes to the bucket "
        "nearest its aspect ratio, is resized to cover it (aspect kept) and centre-cropped", non_empty=True)
    allow_upscale: bool = knob(
        True, "resize clips smaller than their bucket up to it; false skips them (reason too_small)")
    target_fps: float | None = knob(
        None, "resample clips to this frame rate by frame selection; null keeps each clip's own rate; "
              "clips slower than it are skipped (reason low_fps)", gt=0)
    min_frames: int = knob(1, "clips with fewer usable frames are skipped (reason too_short)", ge=1)
    max_frames: int = knob(121, "at most this many frames are taken from the start of a clip; pixel "
                                "frames, before the VAE: 1 + f k of them are 1 + k latent frames with a "
                                "VAE of temporal factor f (121 = 16 latent frames at 8x)", ge=1)
    frames_mod: int = knob(4, "frame counts must satisfy count % frames_mod == frames_remainder "
                              "(4 and 1: the 1 + 4k rule of causal VAEs)", ge=1)
    frames_remainder: int = knob(1, "see frames_mod", ge=0)

    # --- batches ---------------------------------------------------------------------------------
    max_tokens_per_batch: int = knob(
        65536, "token budget of one packed batch on one data-parallel rank (model tokens, as the "
               "recipe counts them); a sample larger than it is skipped (reason over_budget)", gt=0)
    max_samples_per_batch: int = knob(64, "at most this many samples in one packed batch", ge=1)
    packing_lookahead: int = knob(
        32, "decoded samples (at least) held back to choose from when filling a batch (best fit); "
            "more packs tighter, costs host memory", ge=1)
    packed_dataloader_num_workers: int = knob(
        4, "decoding processes per rank (0 decodes in the training process); a rank reading several "
           "data shards (Pan, gradient_accumulation_steps > 1) splits them, at least one each", ge=0)
    packed_dataloader_prefetch_factor: int = knob(
        2, "packed batches decoded ahead of the trainer: each decoding process keeps this many "
           "batches' share of samples (max_samples_per_batch / workers) in flight", ge=1)
    sample_cache_mb: float = knob(
        0.0, "MiB of read samples that each decoding process (the training process with no workers) "
             "keeps in memory, the least recently used dropped first: a sample visited again (the "
             "next epoch) is not read or decoded again. For data read many times (fine-tuning on a "
             "small set, the CPU demos); the files must not change during the run. 0: every visit "
             "reads its files", ge=0)

    # --- resume ----------------------------------------------------------------------------------
    resume_video_csv: bool = knob(
        True, "on resume, continue the video CSVs and annotation files where the checkpoint left "
              "them; false restarts them from the top (the image-tar cursor is kept)")
    restart_data_on_dp_change: bool = knob(
        False, "on a resume with a different number of data-parallel ranks, restart every data "
               "stream (true) instead of continuing where the old ranks left them (the Pan recipe); "
               "recipes that cannot continue refuse such a resume unless true")

    def frame_count_range(self) -> list[int]:
        """Every clip length the rules allow, shortest first."""
        return [n for n in range(self.min_frames, self.max_frames + 1)
                if valid_frame_count(n, self.frames_mod, self.frames_remainder)]

    def buckets(self) -> list[tuple[int, int]]:
        """(height, width) of each resolution bucket."""
        return [parse_bucket(b) for b in self.resolution_buckets]

    def check(self, job) -> None:
        self._check_sources()
        from pan.data.storage import Settings  # lazy: the object-store settings of this machine

        try:
            Settings.from_env()
        except ValueError as e:
            raise ConfigError(None, f"{e}.") from None
        for text in self.resolution_buckets:
            try:
                parse_bucket(text)
            except ValueError as e:
                raise ConfigError("resolution_buckets", f"{e}.") from None
        require(self.frames_remainder < self.frames_mod, "frames_remainder",
                f"is {self.frames_remainder}, but it is a remainder of frames_mod "
                f"({self.frames_mod}): use a value below {self.frames_mod}.")
        require(self.min_frames <= self.max_frames, "min_frames",
                f"({self.min_frames}) exceeds max_frames ({self.max_frames}).")
        require(bool(self.frame_count_range()), "max_frames",
                f"no frame count between min_frames {self.min_frames} and max_frames "
                f"{self.max_frames} satisfies count % {self.frames_mod} == {self.frames_remainder}: "
                "widen the range or change frames_mod / frames_remainder.")
        explicit = getattr(job, "explicit_keys", set())
        require(not (self.packed_dataloader_num_workers == 0
                     and "packed_dataloader_prefetch_factor" in explicit),
                "packed_dataloader_prefetch_factor",
                "has no effect with packed_dataloader_num_workers: 0 (nothing decodes ahead): "
                "remove it or use decoding workers.")

    def _check_sources(self) -> None:
        videos, annotations, images = self.video_csv_paths, self.annotation_paths, self.image_tar_paths
        rows = videos + annotations  # the row sources, mixed by weight
        require(bool(rows or images), "video_csv_paths",
                "no data: set video_csv_paths, annotation_paths and/or image_tar_paths.")
        self._check_weights()
        if images:
            require(self.image_sample_prob > 0, "image_tar_paths",
                    "is set but image_sample_prob is 0, so no image would be read: raise "
                    "image_sample_prob or remove image_tar_paths.")
        else:
            require(self.image_sample_prob == 0, "image_sample_prob",
                    f"is {self.image_sample_prob} but image_tar_paths is empty: add image tars or set 0 "
                    "(image rows of annotation files are mixed by annotation_weights).")
        if rows:
            key = "video_csv_paths" if videos else "annotation_paths"
            require(self.image_sample_prob < 1, "image_sample_prob",
                    f"is 1, so the {key} would never be read: lower it or remove them.")
        else:
            require(self.image_sample_prob == 1 or not images, "image_sample_prob",
                    f"is {self.image_sample_prob} but there are no video_csv_paths or annotation_paths: "
                    "set 1.0 for an image-only run.")
        for key, paths in (("video_csv_paths", videos), ("annotation_paths", annotations),
                           ("image_tar_paths", images)):
            for p in paths:
                if _is_url(p):   # looked up when the run opens it (loading a config makes no request)
                    _check_store(key, p)
                elif not Path(p).is_file():
                    raise ConfigError(key, f"{p} does not exist (or is not a file).",
                                      fix=f"point {key} at existing files (a relative path is read from the "
                                          f"folder the command runs in: {Path.cwd()}), or remove {p} from it.")
        for p in videos:
            require(Path(p).suffix.lower() != ".jsonl", "video_csv_paths",
                    f"lists {p}, a JSONL annotation file: list it in annotation_paths.")
        for p in annotations:
            header = None if _is_url(p) else _csv_header_of(Path(p))   # a URL's: when it opens
            require(Path(p).suffix.lower() != ".csv" and header is None, "annotation_paths",
                    f"lists {p}, a video CSV{f' (header {header})' if header else ''}, not a JSONL "
                    "annotation file (one JSON object per line): list it in video_csv_paths.")
        names = [Path(p).stem for p in rows + images]
        dupes = sorted({n for n in names if names.count(n) > 1})
        require(not dupes, "video_csv_paths",
                f"several data files are named {dupes}: sample ids and resume cursors use file "
                "names (without extension), so rename them apart.")

    def _check_weights(self) -> None:
        for key, weights, paths in (("video_csv_weights", self.video_csv_weights, self.video_csv_paths),
                                    ("annotation_weights", self.annotation_weights, self.annotation_paths)):
            if weights is not None:
                require(len(weights) == len(paths), key,
                        f"has {len(weights)} values for {len(paths)} {key.replace('weights', 'paths')}: "
                        f"give one weight per {'CSV' if key == 'video_csv_weights' else 'annotation file'}, "
                        "or null to weigh files by their number of rows.")
        if self.video_csv_paths and self.annotation_paths:
            given = [k for k in ("video_csv_weights", "annotation_weights") if getattr(self, k) is not None]
            require(len(given) != 1, given[0] if given else "video_csv_weights",
                    "is set but the other of video_csv_weights / annotation_weights is null: video CSVs "
                    "and annotation files are mixed on one scale, so give both lists or neither "
                    "(null weighs every file by its number of rows).")


def _is_url(path: str) -> bool:
    from pan.data.storage import is_url  # lazy: loading a config imports no data engine

    return is_url(str(path))


def _check_store(key: str, url: str) -> None:
    """A URL whose store cannot be opened here (its fsspec package missing) is refused by name."""
    from pan.data.storage import known_store  # lazy: loading a config imports no data engine

    try:
        known_store(url)
    except ValueError as e:
        raise ConfigError(key, f"lists {e}: install the fsspec package it names or list a local "
                               "copy.") from None


def _csv_header_of(path: Path) -> list[str] | None:
    """The header of a video CSV given where a JSONL file is expected (its first line), else None."""
    from pan.data.sources import looks_like_csv_header  # lazy: loading a config reads no sources

    try:
        with open(path, "rb") as f:
            first = next((line.strip() for line in f if line.strip()), b"")
    except OSError:
        return None
    return looks_like_csv_header(first) if first else None

