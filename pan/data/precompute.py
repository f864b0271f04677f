"""`pan data precompute`: encode a run's data once, offline, into latents + text features.

    pan data precompute --config X.yaml [--key value ...] --out DIR [--limit N] [--device D] [--shards [SIZE]]

The engine here is every recipe's; what is written is the run's recipe's: its `precompute` hook
(pan/recipe.py) gives a `PrecomputeFormat` for the job, which names the sources it encodes, the
settings its files depend on, its encoders (loaded through the recipe's own code, so that a
precomputed row trains exactly as the online one), a row's files and each source's index. The
engine reads every row with the data pipeline's own reader (`SampleReader`: the run's buckets, fps
and frame rules), skips the rows whose files exist, shares the others among the processes, writes
the indexes, and lists every row that could not be decoded or encoded. Written under DIR by every
format:
- `failures.csv`: csv, row, reason, detail of every row that could not be encoded;
- `precompute.json`: the settings the files depend on; a rerun with other settings is refused.

The two indexes the data pipeline reads are written here for the formats:
- pan's precomputed CSVs (`CsvFormat`, with the Pan recipe's encoders: pan/recipes/pan/precompute.py):
  `<csv stem>/<row>.safetensors` holding `latent` [C, T, H, W] and `text` [L, D], fp32, and
  `<csv stem>.csv`: the source's columns (`path` re-pointed from DIR) plus `latent_path`, one row
  per clip that has a latent; train from it by listing it in `video_csv_paths`;
- annotation JSONLs (`write_annotation_jsonl`): one row per sample whose `latent` and `text_fea`
  files exist, pointing at them (Pyramid-Flow's format: pan/recipes/pyramid_flow/precompute.py);
  train from them with `annotation_paths`.

With `--shards [SIZE]` a CSV format writes its latents into tar shards of about SIZE (1GB when
not given) instead of one file per clip: `<csv stem>/shard-rRRR-NNNNNN.tar`, each with its member
list `shard-rRRR-NNNNNN.index.json` (pan/data/shards.py), and the precomputed CSV gains the columns
`latent_offset` and `latent_size` (`latent_path` names the shard). DIR may be a URL (s3://...,
gs://...; pan/data/storage.py) for a CSV format: shards are put there as each is finished, the
other files once written, and the CSV's paths are absolute (clips) and URLs (latents).

Each file is written to a temporary name and renamed, and rows whose files exist (or that a finished
shard holds) are skipped, so a killed precompute continues where it stopped. Image tars are not
precomputed: keep them in `image_tar_paths` next to the precomputed files and they are decoded online.

Under torchrun (`torchrun --nproc_per_node 8 -m pan.cli data precompute ...`) each process encodes
every WORLD_SIZE-th missing row on its own GPU (cuda:LOCAL_RANK); rank 0 writes the files every row
shares before the rows (the format's `start`), and the indexes and the merged failures once all are
done. The output is the same as one process's, whatever the recipe.
"""

from __future__ import annotations

import abc
import argparse
import csv
import dataclasses
import io
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save, save_file
from torch.utils.data import DataLoader
from tqdm import tqdm

from pan.config import ConfigError, load_config_or_exit
from pan.config.arguments import COUNT, ValueType, looked_up, output_folder
from pan.data.decode import FrameRules, SkipSample
from pan.data.plan import Ref
from pan.data.reader import Loaded, RowSource, SampleReader, stream_name
from pan.data.shards import DEFAULT_SHARD_BYTES, ShardWriter, member_key, parse_size, read_indexes
from pan.data.sources import AnnotationSource, SourceError, VideoCsvSource
from pan.data.storage import PathLike, StorageError, is_url, join, known_store, storage
from pan.logging import quiet_library_progress_bars
from pan.parallel.world import close_world, start_process_group
from pan.recipe import get_recipe

LATENT_COLUMN = "latent_path"
SHARD_COLUMNS = ("latent_offset", "latent_size")   # where a sharded row's bytes are in its shard
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
    written: int = 0                       # rows encoded by this run
    existing: int = 0                      # rows skipped because their files were already there
    failures: list[Failure] = field(default_factory=list)
    csvs: list[Path] = field(default_factory=list)  # the precomputed CSVs written under DIR
    written_by_rank: list[int] = field(default_factory=list)  # under torchrun: rows per process
    annotations: list[Path] = field(default_factory=list)  # the annotation JSONLs written under DIR
    empty_text: Path | None = None         # the empty caption's features, where the format writes them
    shards: list[PathLike] = field(default_factory=list)   # the shards this run wrote (--shards)


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


# ----------------------------------------------------------------------------------------------
# What a recipe writes
# ----------------------------------------------------------------------------------------------

class PrecomputeFormat(abc.ABC):
    """What `pan data precompute` writes for a job: a recipe's `precompute` hook, called with the
    job, returns one. The engine calls, in this order: `sources()` and `settings()` (before any
    encoder loads, so a refusal costs nothing), `load_encoders(device)` on every process, `start()`
    on rank 0, `encode()` then `save()` for each row of this process's share, and `write_index()`
    for each source on rank 0 once every process is done."""

    source_kind = "source"     # what the sources are called in messages
    unit = "row"               # what the progress bars count
    use_precomputed = True     # whether rows are read from the latents they already name
    shardable = False          # `save` writes what `encode` returns (tensors): it may go into shards
    rules: FrameRules          # the frame rules rows are decoded with

    @abc.abstractmethod
    def sources(self) -> list[RowSource]:
        """The sources to encode (PrecomputeError or SourceError when the job cannot be precomputed)."""

    def settings(self) -> dict | None:
        """Every key a written file depends on (a rerun into DIR must match them); None: unchecked."""
        return None

    def load_encoders(self, device: torch.device) -> None:
        """Load the frozen encoders on `device`."""

    def start(self, out_dir: Path, report: PrecomputeReport) -> None:
        """Write what every row shares, before the rows (rank 0 only)."""

    @abc.abstractmethod
    def files(self, source: RowSource, row: int) -> tuple[str, ...]:
        """A row's files, relative to DIR: a row whose files all exist is not encoded again."""

    @abc.abstractmethod
    def encode(self, source: RowSource, row: int, sample, out_dir: Path):
        """Encode one decoded sample. A ValueError means its shape does not fit the encoders (the row
        fails as vae_shape), any other exception fails it as encode_error; the other rows go on. A
        format may write files here: those it wrote before a later part failed are kept."""

    def save(self, encoded, source: RowSource, row: int, out_dir: Path) -> None:
        """Write what `encode` returned (an error here stops the precompute)."""

    @abc.abstractmethod
    def write_index(self, source: RowSource, rows: range, out_dir: Path, report: PrecomputeReport) -> None:
        """Write the source's index of `rows` (those whose files exist) and list it in `report`."""


class CsvFormat(PrecomputeFormat):
    """pan's precomputed CSVs of video CSVs: one `<csv stem>/<row>.safetensors` per clip with what
    `encode` returns (`latent` and `text`), and `<csv stem>.csv` with `latent_path`. A recipe gives
    the sources, settings and encoders (the Pan recipe's: pan/recipes/pan/precompute.py)."""

    source_kind = "video CSV"
    unit = "clip"
    shardable = True

    def files(self, source: VideoCsvSource, row: int) -> tuple[str, ...]:
        return (latent_file(source, row),)

    def save(self, encoded: dict[str, torch.Tensor], source: VideoCsvSource, row: int, out_dir: Path) -> None:
        save_atomic(encoded, out_dir / latent_file(source, row))

    def write_index(self, source: VideoCsvSource, rows: range, out_dir: PathLike, report: PrecomputeReport) -> None:
        report.csvs.append(write_precomputed_csv(source, rows, out_dir))


def output_format(job) -> PrecomputeFormat:
    """The format the run's recipe writes (its `precompute` hook)."""
    make = get_recipe(job.recipe).hook("precompute")
    if make is None:
        raise PrecomputeError(f"the {job.recipe} recipe has nothing to precompute (its RECIPE names no "
                              "`precompute` hook): train on its sources as they are.")
    return make(job)


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------

def latent_file(source: VideoCsvSource, row: int) -> str:
    """Where a row's latent goes, relative to DIR (and so to the precomputed CSV beside it)."""
    return f"{source.name}/{row:08d}.safetensors"


def latent_settings(job) -> dict:
    """The data and VAE keys a latent depends on."""
    data = job.data
    return {"data": {k: getattr(data, k) for k in ("resolution_buckets", "allow_upscale", "target_fps",
                                                   "min_frames", "max_frames", "frames_mod",
                                                   "frames_remainder")},
            "vae": dataclasses.asdict(job.vae)}


def check_settings(out_dir: PathLike, settings: dict) -> None:
    """Refuse to mix latents of different settings in one DIR (resume would reuse stale ones)."""
    path = join(out_dir, SETTINGS_FILE)
    if storage().exists(path):
        before = json.loads(storage().read_text(path))
        if before != settings:
            changed = sorted(f"{section}.{k}" for section in settings for k in settings[section]
                             if before.get(section, {}).get(k) != settings[section][k])
            raise PrecomputeError(f"{out_dir} holds latents made with other settings "
                             f"({', '.join(changed)} changed): use a new --out folder.")
    else:
        storage().write_text(path, json.dumps(settings, indent=2) + "\n")


def save_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A reader (or a resumed run) sees the whole file or none of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def save_pt_atomic(obj, path: Path) -> None:
    """`torch.save`, atomically (as `save_atomic`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def source_rows(source: RowSource, limit: int | None) -> range:
    return range(min(len(source), limit) if limit is not None else len(source))


def written_files(fmt: PrecomputeFormat, source: RowSource, out_dir: PathLike, rows: range) -> set[str]:
    """The files (relative to DIR) of `rows` that exist: one listing per folder, not a look-up per
    file (a request per row on an object store)."""
    folders = {os.path.dirname(f) for i in rows for f in fmt.files(source, i)}
    return {f"{d}/{n}" if d else n for d in folders for n in storage().listdir(join(out_dir, d) if d else out_dir)}


def missing_rows(fmt: PrecomputeFormat, source: RowSource, out_dir: PathLike, limit: int | None) -> list[int]:
    """The rows of `source` (its first `limit`) some file of which is not written yet (and that no
    finished shard holds)."""
    rows = source_rows(source, limit)
    there = written_files(fmt, source, out_dir, rows)
    sharded = read_indexes(join(out_dir, source.name)) if fmt.shardable else {}
    return [i for i in rows if i not in sharded and not all(f in there for f in fmt.files(source, i))]


def write_precomputed_csv(source: VideoCsvSource, rows: range, out_dir: PathLike) -> PathLike:
    """The source's columns plus latent_path (and, where some row is in a shard, latent_offset and
    latent_size), for the rows whose latent exists; `path` is re-pointed so that it still names the
    clip from the new CSV's folder. In a remote DIR, clips are absolute paths and latents URLs."""
    remote = is_url(out_dir)
    sharded = read_indexes(join(out_dir, source.name))
    files = set(storage().listdir(join(out_dir, source.name)))
    path_at = source.columns["path"]
    lines = []
    for i in rows:
        member = sharded.get(i)
        name = f"{source.name}/{member.shard}" if member else latent_file(source, i)
        if member is None and os.path.basename(name) not in files:
            continue
        row = list(source.rows[i]) + [""] * (len(source.columns) - len(source.rows[i]))
        clip = source.field(row, "path")
        where = source.resolve(clip) if clip is not None else None
        if is_url(where):   # a relative cell of a manifest at a URL: its full URL
            row[path_at] = where
        elif where is not None:
            row[path_at] = str(where.resolve()) if remote else os.path.relpath(where.resolve(), Path(out_dir).resolve())
        located = str(join(out_dir, name)) if remote else name
        lines.append(row[:len(source.columns)] + [located]
                     + ([str(member.offset), str(member.size)] if member else ["", ""]))
    header = list(source.columns) + [LATENT_COLUMN] + list(SHARD_COLUMNS)
    if not sharded:  # the one-file-per-sample layout's CSV, as it always was
        header, lines = header[:-2], [line[:-2] for line in lines]
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(header)
    writer.writerows(lines)
    out = join(out_dir, f"{source.name}.csv")
    storage().write_text(out, text.getvalue())
    return out


def source_row(source: RowSource, i: int) -> dict:
    """A row's fields for the output JSONL, without decoding: kind key -> media path, text, frames."""
    if isinstance(source, AnnotationSource):
        row = source.parse(i)
        entry = {row.kind: row.media, "text": row.caption}
        return entry | ({"frames": list(row.frames)} if row.frames is not None else {})
    cells = source.rows[i]
    path = source.field(cells, "path")
    return {"video": source.resolve(path) if path else None, "text": source.field(cells, "caption")}


def write_annotation_jsonl(source: RowSource, rows: range, out_dir: Path,
                           files_of: Callable[[RowSource, int], tuple[str, str]]) -> Path:
    """`<stem>.jsonl`: the rows whose latent and text features (`files_of(source, row)`, relative to
    DIR) both exist, pointing at them."""
    lines = []
    for i in rows:
        files = files_of(source, i)
        if not all((out_dir / f).is_file() for f in files):
            continue
        try:
            entry = source_row(source, i)
        except SkipSample:  # cannot happen for a row that was encoded; a source edited since, maybe
            continue
        for key in ("video", "image"):  # abspath, not resolve: links in the media's path are kept
            if entry.get(key) is not None and not is_url(entry[key]):
                entry[key] = os.path.relpath(os.path.abspath(entry[key]), os.path.abspath(out_dir))
        entry = {k: v for k, v in entry.items() if v is not None}
        entry["latent"], entry["text_fea"] = files
        lines.append(json.dumps(entry, ensure_ascii=False))
    path = out_dir / f"{source.name}.jsonl"
    storage().write_text(path, "".join(line + "\n" for line in lines))
    return path


def write_failures(failures: list[Failure], out_dir: PathLike) -> PathLike:
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(FAILURE_COLUMNS)
    writer.writerows([f.csv, f.row, f.reason, f.detail] for f in failures)
    path = join(out_dir, "failures.csv")
    storage().write_text(path, text.getvalue())
    return path


# ----------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------

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


def _keep(item: Loaded) -> Loaded:
    return item


def encode_rows(fmt: PrecomputeFormat, source: RowSource, rows: list[int], reader: SampleReader,
                out_dir: Path, report: PrecomputeReport, *, workers: int, prefetch: int,
                shards: ShardWriter | None = None) -> None:
    """Decode `rows` of one source (in worker processes) and encode and write each (into `shards`
    when given, else as the format saves it)."""
    stream = stream_name(source)
    refs = [Ref(i, stream, 0, i, i) for i in rows]
    decoded = DataLoader(reader, batch_size=None, sampler=refs, collate_fn=_keep, num_workers=workers,
                         prefetch_factor=prefetch if workers else None)
    for got in tqdm(decoded, total=len(refs), desc=source.name, unit=fmt.unit, file=sys.stderr, disable=None):
        row = got.ref.index
        if got.sample is None:
            report.failures.append(Failure(str(source.path), row, got.reason, got.detail))
            continue
        try:
            encoded = fmt.encode(source, row, got.sample, out_dir)
        except ValueError as e:  # the clip's shape does not fit the VAE
            report.failures.append(Failure(str(source.path), row, "vae_shape", str(e)))
            continue
        except Exception as e:  # noqa: BLE001 - one row's encoder error must not stop the others
            report.failures.append(Failure(str(source.path), row, "encode_error", f"{type(e).__name__}: {e}"))
            continue
        if shards is not None:
            shards.add(member_key(row), save(encoded))
        else:
            fmt.save(encoded, source, row, out_dir)
        report.written += 1
    if shards is not None:
        shards.close()
        report.shards += shards.finished


def check_layout(fmt: PrecomputeFormat, out_dir: PathLike, shard_bytes: int | None) -> None:
    if shard_bytes is not None and not fmt.shardable:
        raise PrecomputeError(f"--shards: this recipe's format writes its own files per {fmt.unit} (they "
                              "are not what tar shards hold): drop --shards.")
    if is_url(out_dir) and not fmt.shardable:
        raise PrecomputeError(f"--out {out_dir}: this recipe's format writes its files itself, to a local "
                              "folder: give a local --out, then copy the folder to object storage.")


def run_format(fmt: PrecomputeFormat, out_dir: PathLike, *, limit: int | None = None,
               device: torch.device | str | None = None, workers: int = 0, prefetch: int = 2,
               share: Share = Share(), shard_bytes: int | None = None) -> PrecomputeReport:
    """Encode every row of the format's sources (the first `limit` rows of each) into `out_dir` (a
    folder or a URL), into tar shards of about `shard_bytes` when given; with several processes
    (`share`), each encodes its share (into its own shards) and all get the merged report."""
    out_dir = out_dir if is_url(out_dir) else Path(out_dir)
    check_layout(fmt, out_dir, shard_bytes)
    sources = fmt.sources()
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise PrecomputeError(f"{fmt.source_kind} file stems must be unique (they name the outputs): {names}")
    # What the format writes itself goes to a local folder: DIR, or one put to the URL DIR at the end.
    work = Path(tempfile.mkdtemp(prefix="pan-precompute-")) if is_url(out_dir) else out_dir
    try:
        return _encode_all(fmt, sources, out_dir, work, limit=limit, device=device, workers=workers,
                           prefetch=prefetch, share=share, shard_bytes=shard_bytes)
    finally:
        if work != out_dir:
            shutil.rmtree(work, ignore_errors=True)


def _encode_all(fmt: PrecomputeFormat, sources: list[RowSource], out_dir: PathLike, work: Path, *,
                limit: int | None, device, workers: int, prefetch: int, share: Share,
                shard_bytes: int | None) -> PrecomputeReport:
    work.mkdir(parents=True, exist_ok=True)
    settings, refusal = fmt.settings(), None
    if share.rank == 0 and settings is not None:  # one process writes or compares the settings
        try:
            check_settings(out_dir, settings)
        except PrecomputeError as e:
            refusal = str(e)
    refusal = share.from_rank0(refusal)  # all hear its verdict
    if refusal:
        raise PrecomputeError(refusal)
    fmt.load_encoders(encoder_device(device))
    mine = PrecomputeReport()
    if share.rank == 0:
        fmt.start(work, mine)
    reader = SampleReader({stream_name(s): s for s in sources}, None, fmt.rules, use_precomputed=fmt.use_precomputed)
    # One list of missing rows, taken by rank 0 before anyone writes, so the shares agree.
    missing = share.from_rank0([missing_rows(fmt, s, out_dir, limit) for s in sources] if share.rank == 0 else None)
    for source, todo in zip(sources, missing):
        shards = (ShardWriter(join(out_dir, source.name), f"shard-r{share.rank:03d}", shard_bytes)
                  if shard_bytes is not None else None)
        encode_rows(fmt, source, todo[share.rank::share.world], reader, work, mine, workers=workers,
                    prefetch=prefetch, shards=shards)
    if work != out_dir:  # each process puts what it wrote itself
        storage().put_tree(work, out_dir)
        if mine.empty_text is not None:
            mine.empty_text = join(out_dir, mine.empty_text.relative_to(work).as_posix())
    everyone = share.gather(mine)
    report = dataclasses.replace(  # what rank 0 wrote first, and every process's rows
        everyone[0], written=sum(r.written for r in everyone),
        existing=sum(len(source_rows(s, limit)) - len(m) for s, m in zip(sources, missing)),
        failures=sorted((f for r in everyone for f in r.failures), key=lambda f: (f.csv, f.row)),
        written_by_rank=[r.written for r in everyone], shards=[p for r in everyone for p in r.shards])
    if share.rank == 0:  # every file is on disk now: list them
        for source in sources:
            fmt.write_index(source, source_rows(source, limit), out_dir, report)
        write_failures(report.failures, out_dir)
    share.barrier()
    return report


def precompute(job, out_dir: PathLike, *, limit: int | None = None,
               device: torch.device | str | None = None, share: Share = Share(),
               shard_bytes: int | None = None) -> PrecomputeReport:
    """Encode the job's data (the first `limit` rows of each source) into `out_dir` in its recipe's
    format (into tar shards of about `shard_bytes`, when given); with several processes (`share`),
    each encodes its share and all get the merged report."""
    return run_format(output_format(job), out_dir, limit=limit, device=device, share=share,
                      workers=job.data.packed_dataloader_num_workers,
                      prefetch=job.data.packed_dataloader_prefetch_factor, shard_bytes=shard_bytes)


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------

def print_report(report: PrecomputeReport, out_dir: PathLike) -> None:
    by_rank = (f" (by rank: {', '.join(map(str, report.written_by_rank))})"
               if len(report.written_by_rank) > 1 else "")
    print(f"precompute: {report.written} latents written{by_rank}, {report.existing} already there, "
          f"{len(report.failures)} rows failed")
    for f in report.failures:
        print(f"  failed: {f.csv} row {f.row}: {f.reason}: {f.detail}")
    if report.failures:
        print(f"failures listed in {join(out_dir, 'failures.csv')}")
    if report.shards:
        print(f"shards: {len(report.shards)} written by this run")
    for path in report.csvs:
        print(f"precomputed CSV: {path}")
    for path in report.annotations:
        print(f"annotation file: {path}")
    if report.empty_text is not None:
        print(f"empty caption's text features: {report.empty_text}")


def device_name(text: str) -> str:
    """`--device`: a torch device this machine has (cpu, cuda, cuda:N)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"{text!r} is not a device: give cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{text!r}: no CUDA device is visible here; give cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{text!r}: the encoders run on cpu or cuda")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pan data precompute", allow_abbrev=False,
        description="Encode the run's video CSVs (and, for a Pyramid-Flow job, its annotation files) "
                    "into latents + text features (see docs/data.md). Other options are the run's "
                    "config (--config X.yaml) and key overrides.")
    parser.add_argument("--out", required=True, type=OUT, help="folder (or URL: s3://bucket/prefix, "
                        "gs://...) for the latents and precomputed CSVs")
    parser.add_argument("--limit", type=COUNT, default=None, help="only the first N rows of each CSV")
    parser.add_argument("--device", type=looked_up("device", device_name), default=None,
                        help="encoder device (default: cuda if present, else cpu)")
    parser.add_argument("--shards", nargs="?", const=DEFAULT_SHARD_BYTES, default=None, metavar="SIZE",
                        type=ValueType("size", parse_size, "size", refuses=("0", "1XB")),
                        help="write the latents into tar shards of about SIZE each (e.g. 256MB; 1GB when "
                             "SIZE is not given) instead of one file per clip: the layout for large sets "
                             "and object storage (docs/data.md)")
    return parser


_LOCAL_OUT = output_folder("the folder to write the latents into")
# `--out`: a local folder (made when missing), or a URL of a store fsspec can open here
OUT = ValueType("output folder", lambda text: known_store(text) if is_url(text) else _LOCAL_OUT.convert(text),
                "output_folder")


def main(argv: list[str] | None = None) -> int:
    """`pan data precompute --config X.yaml [--key value ...] --out DIR [--limit N] [--device D]`;
    exit 0 when some row has a latent, 1 when none has, 2 when the precompute cannot start."""
    args, rest = build_parser().parse_known_args(argv)
    quiet_library_progress_bars()
    job = load_config_or_exit(rest)
    share = Share.from_env()
    if share.world > 1:  # torchrun: gloo is enough to hand round the small reports
        start_process_group("gloo")
    try:
        return _run(job, args, share)
    finally:
        close_world()


def _run(job, args, share: Share) -> int:
    if job.data.image_tar_paths and share.rank == 0:
        print("precompute: image tars are not precomputed; keep image_tar_paths in the training "
              "config and they are decoded online.", file=sys.stderr)
    try:
        report = precompute(job, args.out, limit=args.limit, device=args.device, share=share,
                            shard_bytes=args.shards)
    except (PrecomputeError, SourceError) as e:
        print(f"pan data precompute: {e}", file=sys.stderr)
        return 2
    except StorageError as e:  # the store stayed unreachable through every retry
        print(f"pan data precompute: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:  # an encoder the config names cannot be loaded (text encoders, VAE)
        print(f"pan data precompute: refused: {e}", file=sys.stderr)
        return 2
    if share.rank == 0:
        print_report(report, args.out)
    return 0 if report.written + report.existing > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
