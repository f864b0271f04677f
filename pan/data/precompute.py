"""`pan data precompute`: encode a run's video CSVs once, offline, into latents + text features.

    pan data precompute --config X.yaml [--key value ...] --out DIR [--limit N]

For every row of every `video_csv_paths` CSV the clip is decoded by the data pipeline's own reader
(`SampleReader`, the run's buckets, fps and frame rules), normalised uint8 -> [-1, 1] and encoded by
the run's VAE, and the caption by the run's text encoder, exactly as online training does it
(`PanTask.sample_latent`, `caption_features`). Written under DIR:
- `<csv stem>/<row>.safetensors`: `latent` [C, T, H, W] and `text` [L, D], fp32;
- `<csv stem>.csv`: the source's columns (`path` re-pointed from DIR) plus `latent_path`, one row
  per clip that has a latent; train from it by listing it in `video_csv_paths`;
- `failures.csv`: csv, row, reason, detail of every row that could not be encoded;
- `precompute.json`: the settings the latents depend on; a rerun with other settings is refused.

Each file is written to a temporary name and renamed, and rows whose latent exists are skipped, so
a killed precompute continues where it stopped. Image tars are not precomputed: keep them in
`image_tar_paths` next to the precomputed CSVs and they are decoded online.

Under torchrun (`torchrun --nproc_per_node 8 -m pan.cli data precompute ...`) each process encodes
every WORLD_SIZE-th missing row on its own GPU (cuda:LOCAL_RANK); rank 0 writes the CSVs and the
merged failures once all are done. The output is the same as one process's.

For a Pyramid-Flow job (`recipe: pyramid_flow`, or a recipe whose job extends it) the command
writes Pyramid-Flow's format instead, with `precompute_pyramid`: unnormalised latent `.pt` files,
text feature `.pt` files, the empty caption's features and a JSONL per source (video CSVs and
annotation files) pointing at them; train from those with `annotation_paths`. Its encoders are the
recipe's own (`pyramid_encoders`): the latents are what online training computes
(`vae.unnormalize(vae.encode(frames))`), the text features the released encoders'
(`PyramidTextEncoder`). It runs in one process.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader
from tqdm import tqdm

from pan.data.decode import FrameRules, SkipSample
from pan.data.loader import (TEXT_FEATURE_DIMS, Loaded, Ref, RowSource, SampleReader, rules_of,
                             stream_name)
from pan.data.sources import AnnotationSource, SourceError, VideoCsvSource, read_video_csv
from pan.parallel.world import close_world, start_process_group

LATENT_COLUMN = "latent_path"
FAILURE_COLUMNS = ("csv", "row", "reason", "detail")
SETTINGS_FILE = "precompute.json"


class PrecomputeError(ValueError):
    """A precompute that cannot start (the message says how to fix it)."""


@dataclass
class Failure:
    csv: str      # source CSV path
    row: int      # row 0 = first row after the header (as in sample ids)
    reason: str   # a data skip reason (docs/data.md), or vae_shape / encode_error
    detail: str


@dataclass
class PrecomputeReport:
    written: int = 0                       # latents encoded by this run
    existing: int = 0                      # rows skipped because their latent was already there
    failures: list[Failure] = field(default_factory=list)
    csvs: list[Path] = field(default_factory=list)  # the precomputed CSVs written under DIR
    written_by_rank: list[int] = field(default_factory=list)  # under torchrun: latents per process
    annotations: list[Path] = field(default_factory=list)  # Pyramid-Flow format: the JSONLs under DIR
    empty_text: Path | None = None         # Pyramid-Flow format: the empty caption's features


@dataclass(frozen=True)
class Share:
    """This process's share of the rows: every `world`-th missing row, starting at `rank`."""
    rank: int = 0
    world: int = 1

    @classmethod
    def from_env(cls) -> Share:
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def from_rank0(self, obj):
        """Rank 0's `obj`, on every process (the others pass anything)."""
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj) -> list:
        """Every process's `obj`, by rank (on every process)."""
        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out


def latent_file(source: VideoCsvSource, row: int) -> str:
    """Where a row's latent goes, relative to DIR (and so to the precomputed CSV beside it)."""
    return f"{source.name}/{row:08d}.safetensors"


def settings_of(job) -> dict:
    """Every key a latent or text feature depends on: a rerun into DIR must match them."""
    return {**latent_settings(job), "text_encoder": dataclasses.asdict(job.text_encoder)}


def latent_settings(job) -> dict:
    """The data and VAE keys a latent depends on."""
    data = job.data
    return {"data": {k: getattr(data, k) for k in ("resolution_buckets", "allow_upscale", "target_fps",
                                                   "min_frames", "max_frames", "frames_mod",
                                                   "frames_remainder")},
            "vae": dataclasses.asdict(job.vae)}


def check_settings(out_dir: Path, settings: dict) -> None:
    """Refuse to mix latents of different settings in one DIR (resume would reuse stale ones)."""
    path = out_dir / SETTINGS_FILE
    if path.is_file():
        before = json.loads(path.read_text())
        if before != settings:
            changed = sorted(f"{section}.{k}" for section in settings for k in settings[section]
                             if before.get(section, {}).get(k) != settings[section][k])
            raise PrecomputeError(f"{out_dir} holds latents made with other settings "
                             f"({', '.join(changed)} changed): use a new --out folder.")
    else:
        write_atomic_text(path, json.dumps(settings, indent=2) + "\n")


def write_atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def save_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A reader (or a resumed run) sees the whole file or none of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


class Encoders:
    """The run's frozen VAE and text encoder, used the way PanTask uses them."""

    def __init__(self, job, device: torch.device):
        from pan.encoders.text import TextEncoder
        from pan.encoders.vae import build_vae

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


def _keep(item: Loaded) -> Loaded:
    return item


def source_rows(source: VideoCsvSource, limit: int | None) -> range:
    return range(min(len(source), limit) if limit is not None else len(source))


def missing_rows(source: VideoCsvSource, out_dir: Path, limit: int | None) -> list[int]:
    return [i for i in source_rows(source, limit) if not (out_dir / latent_file(source, i)).is_file()]


def precompute_csv(source: VideoCsvSource, reader: SampleReader, encoders: Encoders, out_dir: Path,
                   report: PrecomputeReport, *, missing: list[int], workers: int, prefetch: int,
                   share: Share = Share()) -> None:
    """Encode this process's share of the rows of one CSV whose latents are missing."""
    stream = f"video:{source.name}"
    todo = [Ref(i, stream, 0, i, i) for i in missing[share.rank::share.world]]
    decoded = DataLoader(reader, batch_size=None, sampler=todo, collate_fn=_keep, num_workers=workers,
                         prefetch_factor=prefetch if workers else None)
    for got in tqdm(decoded, total=len(todo), desc=source.name, unit="clip", file=sys.stderr, disable=None):
        row = got.ref.index
        if got.sample is None:
            report.failures.append(Failure(str(source.path), row, got.reason, got.detail))
            continue
        try:
            tensors = encoders.encode(got.sample.frames, got.sample.caption)
        except ValueError as e:  # the clip's shape does not fit the VAE
            report.failures.append(Failure(str(source.path), row, "vae_shape", str(e)))
            continue
        except Exception as e:  # noqa: BLE001 - one clip's encoder error must not stop the others
            report.failures.append(Failure(str(source.path), row, "encode_error", f"{type(e).__name__}: {e}"))
            continue
        save_atomic(tensors, out_dir / latent_file(source, row))
        report.written += 1


def write_precomputed_csv(source: VideoCsvSource, rows: range, out_dir: Path) -> Path:
    """The source's columns plus latent_path, for the rows whose latent exists; `path` is
    re-pointed so that it still names the clip from the new CSV's folder."""
    header = list(source.columns) + [LATENT_COLUMN]
    path_at = source.columns["path"]
    lines = []
    for i in rows:
        name = latent_file(source, i)
        if not (out_dir / name).is_file():
            continue
        row = list(source.rows[i]) + [""] * (len(source.columns) - len(source.rows[i]))
        clip = source.field(row, "path")
        if clip is not None:
            row[path_at] = os.path.relpath(source.resolve(clip).resolve(), out_dir.resolve())
        lines.append(row[:len(source.columns)] + [name])
    out = out_dir / f"{source.name}.csv"
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(lines)
    os.replace(tmp, out)
    return out


def write_failures(failures: list[Failure], out_dir: Path) -> Path:
    path = out_dir / "failures.csv"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(FAILURE_COLUMNS)
        writer.writerows([f.csv, f.row, f.reason, f.detail] for f in failures)
    os.replace(tmp, path)
    return path


def encoder_device(device: torch.device | str | None) -> torch.device:
    """The device this process encodes on: `device`, or by default cuda:LOCAL_RANK (the CPU without a
    GPU). A GPU is made the current device, so that everything the encoders allocate or launch
    without naming a device (and every process's CUDA context) is on this process's GPU, not GPU 0."""
    if device is None:
        device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


def precompute(job, out_dir: str | Path, *, limit: int | None = None,
               device: torch.device | str | None = None, share: Share = Share()) -> PrecomputeReport:
    """Encode every row of the job's video CSVs (the first `limit` rows of each) into `out_dir`;
    with several processes (`share`), each encodes its share and all get the merged report."""
    out_dir = Path(out_dir)
    if job.data.annotation_paths:  # silently encoding only the CSVs would lose those rows
        raise PrecomputeError(f"annotation_paths is set ({', '.join(job.data.annotation_paths)}): the Pan "
                              "recipe precomputes video CSVs only. Train on the annotation files "
                              "directly, or list the clips in a CSV (path, caption) in video_csv_paths.")
    sources = [read_video_csv(p) for p in job.data.video_csv_paths]
    for source in sources:
        if source.precomputed:
            raise PrecomputeError(f"{source.path} is already precomputed (it has a latent_path column); "
                                  "list the source CSVs in video_csv_paths.")
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise PrecomputeError(f"video CSV file stems must be unique (they name the outputs): {names}")
    out_dir.mkdir(parents=True, exist_ok=True)
    refusal = None
    if share.rank == 0:  # one process writes or compares the settings; all hear its verdict
        try:
            check_settings(out_dir, settings_of(job))
        except PrecomputeError as e:
            refusal = str(e)
    refusal = share.from_rank0(refusal)
    if refusal:
        raise PrecomputeError(refusal)
    encoders = Encoders(job, encoder_device(device))
    reader = SampleReader({f"video:{s.name}": s for s in sources}, None, rules_of(job.data))
    # One list of missing rows, taken by rank 0 before anyone writes, so the shares agree.
    missing = share.from_rank0([missing_rows(s, out_dir, limit) for s in sources] if share.rank == 0 else None)
    mine = PrecomputeReport()
    for source, todo in zip(sources, missing):
        precompute_csv(source, reader, encoders, out_dir, mine, missing=todo,
                       workers=job.data.packed_dataloader_num_workers,
                       prefetch=job.data.packed_dataloader_prefetch_factor, share=share)
    everyone = share.gather(mine)
    report = PrecomputeReport(written=sum(r.written for r in everyone),
                              existing=sum(len(source_rows(s, limit)) - len(m) for s, m in zip(sources, missing)),
                              failures=sorted((f for r in everyone for f in r.failures),
                                              key=lambda f: (f.csv, f.row)),
                              written_by_rank=[r.written for r in everyone])
    if share.rank == 0:  # every latent is on disk now: list them
        report.csvs = [write_precomputed_csv(s, source_rows(s, limit), out_dir) for s in sources]
        write_failures(report.failures, out_dir)
    share.barrier()
    return report


# ----------------------------------------------------------------------------------------------
# Pyramid-Flow's format
# ----------------------------------------------------------------------------------------------

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


def save_pt_atomic(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def pyramid_text_record(features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-sample text features -> the dict Pyramid-Flow saves (each with a leading batch dim of 1)."""
    shapes = {k: tuple(t.shape) for k, t in features.items() if isinstance(t, torch.Tensor)}
    ok = (all(len(shapes.get(k, ())) == dims for k, dims in TEXT_FEATURE_DIMS.items())
          and shapes["prompt_attention_mask"][0] == shapes["prompt_embed"][0])
    if not ok:
        raise TypeError(f"the text encoder must return prompt_embed [L, D], prompt_attention_mask [L] and "
                        f"pooled_prompt_embed [P]; it returned {shapes}")
    return {k: features[k].detach().cpu().unsqueeze(0).clone() for k in TEXT_FEATURE_DIMS}


def source_row(source: RowSource, i: int) -> dict:
    """A row's fields for the output JSONL, without decoding: kind key -> media path, text, frames."""
    if isinstance(source, AnnotationSource):
        row = source.parse(i)
        entry = {row.kind: row.media, "text": row.caption}
        return entry | ({"frames": list(row.frames)} if row.frames is not None else {})
    cells = source.rows[i]
    path = source.field(cells, "path")
    return {"video": source.resolve(path) if path else None, "text": source.field(cells, "caption")}


def precompute_pyramid(sources: list[RowSource], rules: FrameRules, encoders: PyramidEncoders,
                       out_dir: str | Path, *, limit: int | None = None, workers: int = 0,
                       prefetch: int = 2, settings: dict | None = None) -> PrecomputeReport:
    """Encode every row of `sources` (video CSVs and annotation files; the first `limit` rows of
    each) into Pyramid-Flow's format under `out_dir`:
    - `latent/<stem>/<row>.pt`: the unnormalised latent [1, C, T, H, W] (image rows too: T = 1);
    - `text_fea/<stem>/<row>.pt`: {prompt_embed [1, L, D], prompt_attention_mask [1, L],
      pooled_prompt_embed [1, P]};
    - `text_fea/empty.pt`: the empty caption's features, for caption dropout (CFG);
    - `<stem>.jsonl`: one row per sample with both files (video or image, text, latent, text_fea,
      and frames when the source row had them), paths relative to out_dir;
    - `failures.csv`: every row that could not be decoded or encoded, with its reason.
    Rows are decoded by the data pipeline's reader with `rules` (annotation rows from their video or
    image, never from a latent they name). Files are written atomically and rows whose files exist
    are skipped, so a rerun continues; with `settings`, a rerun with other settings is refused.
    """
    out_dir = Path(out_dir)
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise PrecomputeError(f"source file stems must be unique (they name the outputs): {names}")
    out_dir.mkdir(parents=True, exist_ok=True)
    if settings is not None:
        check_settings(out_dir, settings)
    report = PrecomputeReport()
    report.empty_text = write_empty_text(encoders, out_dir, report)
    reader = SampleReader({stream_name(s): s for s in sources}, None, rules, use_precomputed=False)
    for source in sources:
        rows = source_rows(source, limit)
        todo = [i for i in rows if not all((out_dir / f).is_file() for f in pyramid_files(source, i))]
        report.existing += len(rows) - len(todo)
        encode_pyramid_rows(source, todo, reader, encoders, out_dir, report, workers=workers,
                            prefetch=prefetch)
        report.annotations.append(write_pyramid_jsonl(source, rows, out_dir))
    report.failures.sort(key=lambda f: (f.csv, f.row))
    write_failures(report.failures, out_dir)
    return report


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


def encode_pyramid_rows(source: RowSource, rows: list[int], reader: SampleReader,
                        encoders: PyramidEncoders, out_dir: Path, report: PrecomputeReport, *,
                        workers: int, prefetch: int) -> None:
    """Decode `rows` (in worker processes) and write whichever of their two files is missing."""
    stream = stream_name(source)
    refs = [Ref(i, stream, 0, i, i) for i in rows]
    decoded = DataLoader(reader, batch_size=None, sampler=refs, collate_fn=_keep, num_workers=workers,
                         prefetch_factor=prefetch if workers else None)
    for got in tqdm(decoded, total=len(refs), desc=source.name, unit="row", file=sys.stderr, disable=None):
        row = got.ref.index
        if got.sample is None:
            report.failures.append(Failure(str(source.path), row, got.reason, got.detail))
            continue
        latent_path, text_path = (out_dir / f for f in pyramid_files(source, row))
        try:
            if not latent_path.is_file():
                latent = encoders.latent(got.sample.frames).detach().cpu()
                save_pt_atomic(latent.unsqueeze(0).clone(), latent_path)  # clone: only its own storage
            if not text_path.is_file():
                save_pt_atomic(pyramid_text_record(encoders.text(got.sample.caption)), text_path)
        except ValueError as e:  # the clip's shape does not fit the VAE
            report.failures.append(Failure(str(source.path), row, "vae_shape", str(e)))
            continue
        except Exception as e:  # noqa: BLE001 - one row's encoder error must not stop the others
            detail = f"{type(e).__name__}: {e}"
            report.failures.append(Failure(str(source.path), row, "encode_error", detail))
            continue
        report.written += 1


def write_pyramid_jsonl(source: RowSource, rows: range, out_dir: Path) -> Path:
    """`<stem>.jsonl`: the rows whose latent and text features both exist, pointing at them."""
    lines = []
    for i in rows:
        files = pyramid_files(source, i)
        if not all((out_dir / f).is_file() for f in files):
            continue
        try:
            entry = source_row(source, i)
        except SkipSample:  # cannot happen for a row that was encoded; a source edited since, maybe
            continue
        for key in ("video", "image"):  # abspath, not resolve: links in the media's path are kept
            if entry.get(key) is not None:
                entry[key] = os.path.relpath(os.path.abspath(entry[key]), os.path.abspath(out_dir))
        entry = {k: v for k, v in entry.items() if v is not None}
        entry["latent"], entry["text_fea"] = files
        lines.append(json.dumps(entry, ensure_ascii=False))
    path = out_dir / f"{source.name}.jsonl"
    write_atomic_text(path, "".join(line + "\n" for line in lines))
    return path


def print_report(report: PrecomputeReport, out_dir: Path) -> None:
    by_rank = (f" (by rank: {', '.join(map(str, report.written_by_rank))})"
               if len(report.written_by_rank) > 1 else "")
    print(f"precompute: {report.written} latents written{by_rank}, {report.existing} already there, "
          f"{len(report.failures)} rows failed")
    for f in report.failures:
        print(f"  failed: {f.csv} row {f.row}: {f.reason}: {f.detail}")
    if report.failures:
        print(f"failures listed in {out_dir / 'failures.csv'}")
    for path in report.csvs:
        print(f"precomputed CSV: {path}")
    for path in report.annotations:
        print(f"annotation file: {path}")
    if report.empty_text is not None:
        print(f"empty caption's text features: {report.empty_text}")


def main(argv: list[str] | None = None) -> int:
    """`pan data precompute --config X.yaml [--key value ...] --out DIR [--limit N] [--device D]`;
    exit 0 when some row has a latent, 1 when none has, 2 when the precompute cannot start."""
    parser = argparse.ArgumentParser(
        prog="pan data precompute", allow_abbrev=False,
        description="Encode the run's video CSVs (and, for a Pyramid-Flow job, its annotation files) "
                    "into latents + text features (see docs/data.md). Other options are the run's "
                    "config (--config X.yaml) and key overrides.")
    parser.add_argument("--out", required=True, help="folder for the latents and precomputed CSVs")
    parser.add_argument("--limit", type=int, default=None, help="only the first N rows of each CSV")
    parser.add_argument("--device", default=None, help="encoder device (default: cuda if present, else cpu)")
    args, rest = parser.parse_known_args(argv)
    from pan.logging import quiet_library_progress_bars
    quiet_library_progress_bars()
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    from pan.cli import load_config_or_exit

    job = load_config_or_exit(rest)
    share = Share.from_env()
    if share.world > 1:  # torchrun: gloo is enough to hand round the small reports
        start_process_group("gloo")
    try:
        return _run(job, args, share)
    finally:
        close_world()


def _run(job, args, share: Share) -> int:
    if is_pyramid_job(job):
        return _run_pyramid(job, args, share)
    if job.data.image_tar_paths and share.rank == 0:
        print("precompute: image tars are not precomputed; keep image_tar_paths in the training "
              "config and they are decoded online.", file=sys.stderr)
    try:
        report = precompute(job, args.out, limit=args.limit, device=args.device, share=share)
    except (PrecomputeError, SourceError) as e:
        print(f"pan data precompute: {e}", file=sys.stderr)
        return 2
    if share.rank == 0:
        print_report(report, Path(args.out))
    return 0 if report.written + report.existing > 0 else 1


# ----------------------------------------------------------------------------------------------
# `pan data precompute` for a Pyramid-Flow job
# ----------------------------------------------------------------------------------------------

def is_pyramid_job(job) -> bool:
    from pan.recipes.pyramid_flow import PyramidJobConfig
    return isinstance(job, PyramidJobConfig)


@dataclass
class _Frames:
    """What `PyramidFlowTask.raw_latent` reads of a decoded sample."""
    frames: torch.Tensor


def pyramid_encoders(job, device: torch.device | str) -> PyramidEncoders:
    """The recipe's frozen VAE and text encoders as a precompute's callables, used through the
    recipe's own code so that a precomputed row trains exactly as the online one: the latent is
    `PyramidFlowTask.raw_latent` of the frames (vae.unnormalize(vae.encode(frames))), the text
    features the recipe's `PyramidTextEncoder`'s."""
    from pan.encoders.pyramid_text import FEATURE_KEYS
    from pan.parallel.dims import ParallelDims
    from pan.parallel.world import World
    from pan.recipes import get_recipe

    device = torch.device(device)
    world = World(rank=0, size=1, local_rank=0, local_size=1, device=device)
    one_process = ParallelDims(world_size=1, local_world_size=1, cp=1, dp_replicate=1, dp_shard=1)
    task = get_recipe(job.recipe).task(job, world, one_process)
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


def precompute_pyramid_job(job, out_dir: str | Path, *, limit: int | None = None,
                           device: torch.device | str | None = None) -> PrecomputeReport:
    """Every row of the job's video CSVs and annotation files, in Pyramid-Flow's format."""
    from pan.data.sources import read_annotations
    sources: list[RowSource] = [read_video_csv(p) for p in job.data.video_csv_paths]
    for source in sources:
        if source.precomputed:
            raise PrecomputeError(f"{source.path} is already precomputed (pan's format: a latent_path "
                                  "column): list the CSVs of the clips in video_csv_paths.")
    sources += [read_annotations(p) for p in job.data.annotation_paths]
    out_dir, settings = Path(out_dir), pyramid_settings(job)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_settings(out_dir, settings)  # before the encoders load: a refusal costs nothing
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    encoders = pyramid_encoders(job, device)
    return precompute_pyramid(sources, rules_of(job.data), encoders, out_dir, limit=limit,
                              workers=job.data.packed_dataloader_num_workers,
                              prefetch=job.data.packed_dataloader_prefetch_factor, settings=settings)


def _run_pyramid(job, args, share: Share) -> int:
    if share.world > 1:
        print("pan data precompute: a Pyramid-Flow precompute runs in one process; start it without "
              "torchrun.", file=sys.stderr)
        return 2
    if job.data.image_tar_paths:
        print("precompute: image tars are not precomputed; keep image_tar_paths in the training "
              "config and they are decoded online.", file=sys.stderr)
    try:
        report = precompute_pyramid_job(job, args.out, limit=args.limit, device=args.device)
    except (PrecomputeError, SourceError) as e:
        print(f"pan data precompute: {e}", file=sys.stderr)
        return 2
    print_report(report, Path(args.out))
    return 0 if report.written + report.existing > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
