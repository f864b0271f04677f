"""`pan data precompute` for the Pyramid-Flow recipes (their `precompute` hook): Pyramid-Flow's format.

For every row of a job's video CSVs and annotation files (the engine, pan/data/precompute.py,
decodes it with the data pipeline's reader and the run's frame rules; an annotation row from its
`video` or `image`, honouring `frames`, never from a latent it already names), written under DIR:
- `latent/<stem>/<row>.pt`: the unnormalised latent [1, C, T, H, W] (image rows too: T = 1);
- `text_fea/<stem>/<row>.pt`: {prompt_embed [1, L, D], prompt_attention_mask [1, L],
  pooled_prompt_embed [1, P]};
- `text_fea/empty.pt`: the empty caption's features, for caption dropout (CFG);
- `<stem>.jsonl`: one row per sample with both files (video or image, text, latent, text_fea,
  and frames when the source row had them), paths relative to DIR; train from it with
  `annotation_paths`.
The encoders are the recipe's own, through its task (`pyramid_encoders`): the latents are what
online training computes (`PyramidTask.raw_latent`: vae.unnormalize(vae.encode(frames))), the text
features the released encoders' (`PyramidTextEncoder`). `precompute_pyramid` writes the format for
any sources and encoders (plain callables, `PyramidEncoders`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pan.data.batch import TEXT_FEATURE_DIMS
from pan.data.decode import FrameRules
from pan.data.precompute import (
    Failure,
    PrecomputeError,
    PrecomputeFormat,
    PrecomputeReport,
    Share,
    latent_settings,
    run_format,
    save_pt_atomic,
    write_annotation_jsonl,
)
from pan.data.reader import RowSource, rules_of
from pan.data.sources import read_annotations, read_video_csv
from pan.encoders.pyramid_text import FEATURE_KEYS
from pan.parallel.world import planned_task

EMPTY_TEXT_FEA = "text_fea/empty.pt"


@dataclass(frozen=True)
class PyramidEncoders:
    """The frozen encoders a Pyramid-Flow precompute calls, as plain callables:
    - latent(uint8 frames [T, 3, H, W]) -> the unnormalised latent [C, T', H', W']; a ValueError
      means the clip's shape does not fit the VAE (reason vae_shape);
    - text(caption) -> {prompt_embed [L, D], prompt_attention_mask [L], pooled_prompt_embed [P]}.
    """
    latent: Callable[[torch.Tensor], torch.Tensor]
    text: Callable[[str], dict[str, torch.Tensor]]


def pyramid_files(source: RowSource, row: int) -> tuple[str, str]:
    """Where a row's latent and text features go, relative to DIR (and so to the JSONL beside them)."""
    return f"latent/{source.name}/{row:08d}.pt", f"text_fea/{source.name}/{row:08d}.pt"


def pyramid_text_record(features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-sample text features -> the dict Pyramid-Flow saves (each with a leading batch dim of 1)."""
    shapes = {k: tuple(t.shape) for k, t in features.items() if isinstance(t, torch.Tensor)}
    ok = (all(len(shapes.get(k, ())) == dims for k, dims in TEXT_FEATURE_DIMS.items())
          and shapes["prompt_attention_mask"][0] == shapes["prompt_embed"][0])
    if not ok:
        raise TypeError(f"the text encoder must return prompt_embed [L, D], prompt_attention_mask [L] and "
                        f"pooled_prompt_embed [P]; it returned {shapes}")
    return {k: features[k].detach().cpu().unsqueeze(0).clone() for k in TEXT_FEATURE_DIMS}


def write_empty_text(encoders: PyramidEncoders, out_dir: Path, report: PrecomputeReport) -> Path | None:
    """The empty caption's features (the original never writes them, so its precomputed-feature
    training fails at the first caption drop)."""
    path = out_dir / EMPTY_TEXT_FEA
    if not path.is_file():
        try:
            save_pt_atomic(pyramid_text_record(encoders.text("")), path)
        except Exception as e:  # noqa: BLE001 - reported like a row's failure
            report.failures.append(Failure(str(path), -1, "encode_error", f"{type(e).__name__}: {e}"))
            return None
    return path


class PyramidFormat(PrecomputeFormat):
    """Pyramid-Flow's format of `sources` (video CSVs and annotation files) with `encoders`; with
    `settings`, a rerun into DIR with other settings is refused."""

    use_precomputed = False  # an annotation row is encoded from its media, not from its `latent`

    def __init__(self, sources: list[RowSource] | None, rules: FrameRules, encoders: PyramidEncoders | None,
                 settings: dict | None = None):
        self._sources, self.rules, self.encoders, self._settings = sources, rules, encoders, settings

    def sources(self) -> list[RowSource]:
        return self._sources

    def settings(self) -> dict | None:
        return self._settings

    def start(self, out_dir: Path, report: PrecomputeReport) -> None:
        report.empty_text = write_empty_text(self.encoders, out_dir, report)

    def files(self, source: RowSource, row: int) -> tuple[str, str]:
        return pyramid_files(source, row)

    def encode(self, source: RowSource, row: int, sample, out_dir: Path) -> None:
        """Write whichever of the row's two files is missing, each as soon as it is encoded."""
        latent_path, text_path = (out_dir / f for f in pyramid_files(source, row))
        if not latent_path.is_file():
            latent = self.encoders.latent(sample.frames).detach().cpu()
            save_pt_atomic(latent.unsqueeze(0).clone(), latent_path)  # clone: only its own storage
        if not text_path.is_file():
            save_pt_atomic(pyramid_text_record(self.encoders.text(sample.caption)), text_path)

    def write_index(self, source: RowSource, rows: range, out_dir: Path, report: PrecomputeReport) -> None:
        report.annotations.append(write_annotation_jsonl(source, rows, out_dir, pyramid_files))


def precompute_pyramid(sources: list[RowSource], rules: FrameRules, encoders: PyramidEncoders,
                       out_dir: str | Path, *, limit: int | None = None, workers: int = 0,
                       prefetch: int = 2, settings: dict | None = None, share: Share = Share()) -> PrecomputeReport:
    """Encode every row of `sources` (video CSVs and annotation files; the first `limit` rows of
    each) into Pyramid-Flow's format under `out_dir` (see the module docstring); `failures.csv`
    lists every row that could not be decoded or encoded, with its reason. Rows are decoded by the
    data pipeline's reader with `rules`. Files are written atomically and rows whose files exist
    are skipped, so a rerun continues; with `settings`, a rerun with other settings is refused.
    With several processes (`share`), each encodes its share: the output is one process's."""
    return run_format(PyramidFormat(sources, rules, encoders, settings), out_dir, limit=limit,
                      workers=workers, prefetch=prefetch, share=share)


# ----------------------------------------------------------------------------------------------
# A Pyramid-Flow job's precompute
# ----------------------------------------------------------------------------------------------

@dataclass
class _Frames:
    """What `PyramidFlowTask.raw_latent` reads of a decoded sample."""
    frames: torch.Tensor


def pyramid_encoders(job, device: torch.device | str) -> PyramidEncoders:
    """The recipe's frozen VAE and text encoders as a precompute's callables, used through the
    recipe's own code so that a precomputed row trains exactly as the online one: the latent is
    `PyramidFlowTask.raw_latent` of the frames (vae.unnormalize(vae.encode(frames))), the text
    features the recipe's `PyramidTextEncoder`'s."""
    # Every caption is encoded (and the empty one): the text encoders must be there, which their
    # files tell before any model loads (ConfigError naming the key: `pan data precompute` refuses).
    from pan.encoders.pyramid_text import check_text_encoders
    m = job.model
    check_text_encoders(job.text, "pyramid_flux" if m.model_name == "pan" else m.model_name, m.model_path or "")
    # The run's recipe's task (pyramid_flow's or pyramid_flow_ar's) in one process, through the registry.
    task = planned_task(job, device=device)
    task.load_encoders()

    def latent(frames: torch.Tensor) -> torch.Tensor:
        task.vae.geometry.check_clip_shape(frames.shape[0], frames.shape[2], frames.shape[3])  # ValueError
        return task.raw_latent(_Frames(frames))

    def text(caption: str) -> dict[str, torch.Tensor]:
        return dict(zip(FEATURE_KEYS, task.text_encoder.encode([caption])[0].tensors()))

    return PyramidEncoders(latent=latent, text=text)


def pyramid_settings(job) -> dict:
    """What a Pyramid-Flow latent or text feature depends on (a rerun into DIR must match)."""
    m = job.model
    encoders = "pyramid_flux" if m.model_name == "pan" else m.model_name  # as the recipe loads them
    return {**latent_settings(job),
            "text": {**dataclasses.asdict(job.text), "encoders": encoders, "model_path": m.model_path}}


class PyramidJobFormat(PyramidFormat):
    """A Pyramid-Flow job's video CSVs and annotation files, with the recipe's encoders (the
    `precompute` hook of both Pyramid-Flow recipes, called with the job)."""

    def __init__(self, job):
        super().__init__(None, rules_of(job.data), None, pyramid_settings(job))
        self.job = job

    def sources(self) -> list[RowSource]:
        job = self.job
        sources: list[RowSource] = [read_video_csv(p) for p in job.data.video_csv_paths]
        for source in sources:
            if source.precomputed:
                raise PrecomputeError(f"{source.path} is already precomputed (pan's format: a latent_path "
                                      "column): list the CSVs of the clips in video_csv_paths.")
        return sources + [read_annotations(p) for p in job.data.annotation_paths]

    def load_encoders(self, device: torch.device) -> None:
        self.encoders = pyramid_encoders(self.job, device)
