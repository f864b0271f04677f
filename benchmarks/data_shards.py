"""Reading precomputed latents: tar shards against one file per sample, and S3 against local disk.

The same N samples (a latent and its text features, safetensors) are laid out three ways: one file
per sample on local disk (what `pan data precompute` writes without --shards), tar shards on local
disk (`--shards`), and the same shards in a loopback S3 server (moto, started and stopped here).
Each layout is read as a decoding worker reads it (`ChunkReader` over a `SampleReader`, manifests as
precompute writes them: messages of MAX_SAMPLES_PER_MESSAGE visits, the members of remote shards in
each read ahead, concurrently, PAN_DATA_READ_AHEAD at a time), every sample once per round in a
seeded random order (what the shuffled sampler asks for), by 1 reader and by 4 concurrent readers
(decoding workers wait on I/O, not on the interpreter), the layouts timed round-robin in one run,
for two sample sizes. The table gives samples per second and the ratios against the file-per-sample
layout (goal >= 2x for local shards) and against local shards (goal >= 0.5x for S3), and the
process's CPU time per sample, which other jobs on a shared machine do not inflate (wall time they
do; an S3 read's wait is no CPU time). S3 is timed three times: its first epoch (an empty local
cache: every member one ranged GET, one HEAD per shard) with read-ahead and without it
(PAN_DATA_READ_AHEAD=0: one request at a time per reader), and its later epochs (members from the
local cache, pan/data/storage.py). For the first epochs the S3 server's own CPU time per sample is
kept too (`server_cpu_us_per_sample`): moto is a Python server, and on a small machine its CPU and
the client's, not the wait for an answer, bound the rate. The local layouts are read from the page
cache (the files were just written): what is measured is the per-file cost (open, stat, map, close)
against one pread from an open shard; on a parallel file system those calls cost more.

    OMP_NUM_THREADS=1 python -m benchmarks.data_shards [--samples 400] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import torch
from safetensors.torch import save

try:
    from benchmarks.common import interleaved_times, median, print_table, time_call, write_json
except ModuleNotFoundError:  # run as `python benchmarks/data_shards.py`: its folder is on the path
    from common import interleaved_times, median, print_table, time_call, write_json
from pan.data.decode import FrameRules
from pan.data.packed import MAX_SAMPLES_PER_MESSAGE, ChunkReader
from pan.data.plan import Ref
from pan.data.reader import SampleReader, stream_name
from pan.data.shards import ShardWriter, read_indexes
from pan.data.sources import read_video_csv
from pan.data.storage import join, storage


LABELS = {"files": "local files", "shards": "local shards", "s3": "s3 later epochs"}
FIRST, FIRST_ONE_AT_A_TIME = "s3 first epoch", "s3 first epoch, no read-ahead"
# precomputed rows are not decoded: the frame rules are not used
RULES = FrameRules(buckets=((32, 32),), allow_upscale=True, target_fps=None, min_frames=1, max_frames=5,
                   frames_mod=4, frames_remainder=1)


def sample_bytes(i: int, latent: tuple[int, ...], text: tuple[int, int]) -> bytes:
    g = torch.Generator().manual_seed(i)
    return save({"latent": torch.randn(latent, generator=g), "text": torch.randn(text, generator=g)})


def write_manifest(path: Path, rows: list[list]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["latent_path", "latent_offset", "latent_size", "caption"] if len(rows[0]) == 4
                        else ["latent_path", "caption"])
        writer.writerows(rows)
    return path


def lay_out(folder: Path, count: int, latent, text, shard_bytes: int, bucket: str | None) -> dict[str, Path]:
    """The manifests of the three layouts (the S3 one when `bucket` is given)."""
    files, shards = folder / "files", folder / "shards"
    files.mkdir(parents=True)
    writers = {"local": ShardWriter(shards, "shard-r000", shard_bytes)}
    if bucket:
        writers["s3"] = ShardWriter(join(bucket, "shards"), "shard-r000", shard_bytes)
    for i in range(count):
        data = sample_bytes(i, latent, text)
        (files / f"{i:08d}.safetensors").write_bytes(data)
        for writer in writers.values():
            writer.add(f"{i:08d}", data)
    for writer in writers.values():
        writer.close()
    manifests = {"files": write_manifest(folder / "m-files" / "clips.csv",
                                         [[str(files / f"{i:08d}.safetensors"), f"clip {i}"] for i in range(count)])}
    for name, where in (("shards", str(shards)), ("s3", join(bucket, "shards") if bucket else None)):
        if where is None:
            continue
        members = read_indexes(where)
        manifests[name] = write_manifest(folder / f"m-{name}" / "clips.csv",
                                         [[f"{where}/{members[i].shard}", members[i].offset, members[i].size,
                                           f"clip {i}"] for i in range(count)])
    return manifests


def reading(manifest: Path, count: int, threads: int, seed: int):
    """One pass over every sample in a seeded random order, by `threads` readers, each reading
    messages of MAX_SAMPLES_PER_MESSAGE visits as a decoding worker does (ChunkReader: the remote
    members of a message read ahead)."""
    source = read_video_csv(manifest)
    reader = ChunkReader(SampleReader({stream_name(source): source}, None, RULES))
    stream = stream_name(source)
    order = list(range(count))
    random.Random(seed).shuffle(order)
    messages = [[Ref(i, stream, 0, i, i) for i in order[at:at + MAX_SAMPLES_PER_MESSAGE]]
                for at in range(0, count, MAX_SAMPLES_PER_MESSAGE)]

    def read(visits: list[Ref]) -> None:
        for got in reader[visits]:
            assert got.sample is not None, (got.reason, got.detail)

    def one_pass() -> None:
        if threads == 1:
            for visits in messages:
                read(visits)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(read, messages))
    return one_pass


def first_epoch(one_pass, cache: Path, read_ahead: str, server: psutil.Process) -> tuple[float, float, float]:
    """(wall s, client CPU s, server CPU s) of one pass from an empty local cache (a new Storage:
    its shards' versions unknown, so one HEAD per shard as well)."""
    os.environ.update(PAN_DATA_CACHE=str(cache), PAN_DATA_READ_AHEAD=read_ahead)
    before = server.cpu_times()
    wall, cpu = time_call(one_pass)
    after = server.cpu_times()
    return wall, cpu, (after.user + after.system) - (before.user + before.system)


def start_s3(cache: Path) -> subprocess.Popen:
    """moto's S3 server on a free loopback port; the environment points this process's clients at it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1", PAN_DATA_CACHE=str(cache))
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            return server
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise SystemExit("moto's S3 server did not start") from None
            time.sleep(0.05)


def measure_size(tmp: Path, name: str, shapes, args, bucket: str | None) -> list[dict]:
    """The rows of one sample size: every layout by 1 and by 4 readers."""
    latent, text = shapes
    manifests = lay_out(tmp / name, args.samples, latent, text, args.shard_mb << 20,
                        join(bucket, name) if bucket else None)
    size = f"{name} ({len(sample_bytes(0, latent, text)) / 1024:.0f} KiB)"
    rows = []
    read_ahead = os.environ.get("PAN_DATA_READ_AHEAD", "16")
    for threads in (1, 4):
        candidates = {layout: reading(m, args.samples, threads, seed=threads) for layout, m in manifests.items()}
        rate, cpu, server_cpu = {}, {}, {}
        if "s3" in candidates:  # the first epoch: an empty cache, every member a ranged GET
            for label, ahead in ((FIRST_ONE_AT_A_TIME, "0"), (FIRST, read_ahead)):
                wall, cpu[label], server_cpu[label] = first_epoch(
                    candidates["s3"], tmp / f"cache-{name}-{threads}-{ahead}", ahead, args.server)
                rate[label] = args.samples / wall
        times = interleaved_times(candidates, repeats=args.rounds)
        rate.update({LABELS[layout]: args.samples / median(t["wall"]) for layout, t in times.items()})
        cpu.update({LABELS[layout]: median(t["cpu"]) for layout, t in times.items()})
        files, shards = LABELS["files"], LABELS["shards"]
        for layout, value in rate.items():
            rows.append({"sample": size, "layout": layout, "readers": threads, "samples_per_s": round(value, 1),
                         "vs_files": round(value / rate[files], 2), "vs_local_shards": round(value / rate[shards], 2),
                         "cpu_us_per_sample": round(cpu[layout] / args.samples * 1e6, 1),
                         "cpu_vs_files": round(cpu[files] / cpu[layout], 2),
                         "server_cpu_us_per_sample": (round(server_cpu[layout] / args.samples * 1e6, 1)
                                                      if layout in server_cpu else None)})
    return rows


def measure(args, sizes: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        server = None if args.no_s3 else start_s3(Path(tmp) / "cache")
        args.server = psutil.Process(server.pid) if server is not None else None
        try:
            bucket = None
            if server is not None:
                import fsspec
                fsspec.filesystem("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).mkdir("bench")
                bucket = "s3://bench"
                for ahead in ("0", os.environ.get("PAN_DATA_READ_AHEAD", "16")):  # both settings' clients
                    os.environ["PAN_DATA_READ_AHEAD"] = ahead                   # made before any timing
                    storage().listdir(bucket)
            return [row for name, shapes in sizes.items()
                    for row in measure_size(Path(tmp), name, shapes, args, bucket)]
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=10)


# (latent [C, T, H, W], text [L, D]) of each sample size, fp32: a small latent (an image or a
# low-resolution clip: per-file costs dominate) and a 5-frame 256-pixel clip (copying dominates)
SIZES = {"small": ((16, 1, 8, 8), (16, 64)), "clip": ((16, 5, 32, 32), (64, 384))}
QUICK = {"tiny": ((4, 1, 4, 4), (3, 16))}


def markdown(rows: list[dict]) -> str:
    lines = ["| sample | layout | readers | samples/s | vs files | vs local shards | CPU µs per sample |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['sample']} | {r['layout']} | {r['readers']} | {r['samples_per_s']:.0f} | {r['vs_files']:.2f} "
              f"| {r['vs_local_shards']:.2f} | {r['cpu_us_per_sample']:.0f} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=400, help="samples of each size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shard-mb", type=int, default=8,
                        help="shard size in MiB (moto's ranged GETs slow down with the object's size, "
                             "which a real store's do not: 8 keeps that artefact small)")
    parser.add_argument("--no-s3", action="store_true", help="skip the loopback S3 server")
    parser.add_argument("--quick", action="store_true", help="a few tiny samples, one round (a smoke run)")
    parser.add_argument("--out", default=None, help="the JSON written (default: benchmarks/results/"
                        "data_shards.json, whose rows docs/data.md shows; data_shards_quick.json with --quick)")
    args = parser.parse_args()
    sizes = SIZES
    if args.quick:
        args.samples, args.rounds, args.shard_mb, sizes = 24, 1, 1, QUICK
    out = args.out or f"benchmarks/results/data_shards{'_quick' if args.quick else ''}.json"

    rows = measure(args, sizes)
    print(f"{args.samples} samples of each size, shards of {args.shard_mb} MiB, median of {args.rounds} rounds "
          "(the s3 first epoch: one pass)")
    print_table(rows, ["sample", "layout", "readers", "samples_per_s", "vs_files", "vs_local_shards",
                       "cpu_us_per_sample", "cpu_vs_files", "server_cpu_us_per_sample"])
    print("\nfor docs/data.md (Sharded latents and object storage):\n" + markdown(rows))
    path = write_json(out, {"samples": args.samples, "shard_MiB": args.shard_mb, "rounds": args.rounds,
                                 "read_ahead": os.environ.get("PAN_DATA_READ_AHEAD", "16"),
                                 "sizes": {k: {"latent": list(v[0]), "text": list(v[1])} for k, v in sizes.items()},
                                 "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
