"""One bad annotation row never stops a run (issue 28, finding 4).

A row that reads but holds what the run's model cannot take is a bad sample, found when it is read
(pan/data/fit.py, with what the model takes given by the recipe's task): skipped with its reason,
counted, recorded once in output_dir/bad_samples/, and its batch filled with other samples. For
each recipe a tiny run on data with one poison row of each kind trains to the end:

- pyramid_flow and pyramid_flow_ar: precomputed latents with the wrong channel count (4 where the
  tiny DiT takes 3), with H, W that do not cut into the pyramid's stage unit (30 x 30 with 3 stages
  of 2x2 patches), full of NaN, and text features of the wrong width;
- pan: pan's precomputed latents of the wrong channel count, of sizes that do not cut into its
  patches, full of NaN, or with caption features of the wrong width; an annotation row's
  Pyramid-Flow latent; a clip that decodes to a size its patches cannot cut;
- causal_vae: clips and images that decode to a size the VAE cannot encode.

And a bad row is read once even when the decoding workers keep more visits in flight than the data
has rows (one loader, or the shards of a rank sharing its record).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

import pan.data.reader as reader_module
from pan.config import load_job_config
from pan.data.build import build_data_loader, build_sharded_loader
from pan.data.synth import synth_dataset
from pan.trainer import build_trainer
from pyramid_tiny import load
from pyramid_tiny import released_fixture  # noqa: F401  (a fixture)
from test_data_sources import CARPHONE, image_bytes, real_video, small_config, tokens_of

REPO = Path(__file__).resolve().parents[1]


def latent_tokens_of(t: int, h: int, w: int) -> int:
    return t * (h // 2) * (w // 2)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------
# Read once, with more visits in flight than rows
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def opened(tmp_path, monkeypatch) -> Path:
    """A log of every latent file opened, by any process (the workers fork after the patch)."""
    log = tmp_path / "opened.log"
    log.touch()
    real = reader_module.read_raw_latent

    def logged(path):
        with open(log, "a") as f:
            f.write(f"{Path(path).name}\n")
        return real(path)

    monkeypatch.setattr(reader_module, "read_raw_latent", logged)
    return log


@pytest.mark.parametrize("shards", [1, 2])
def test_a_bad_row_is_read_once_with_more_visits_in_flight_than_rows(tmp_path, opened, shards):
    for i in range(3):
        torch.save(randn(4, 1, 4, 4, seed=i), tmp_path / f"good{i}.pt")
    torch.save({"not": "a latent"}, tmp_path / "bad.pt")
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"latent": f"good{i}.pt", "text": f"row {i}"} for i in range(3)]
                       + [{"latent": "bad.pt", "text": "a file that holds no tensor"}])
    cfg = small_config(annotation_paths=[str(rows)], max_samples_per_batch=4, packing_lookahead=4,
                       packed_dataloader_num_workers=2 * shards, packed_dataloader_prefetch_factor=2)

    def batches(cfg) -> tuple[list[list[str]], int]:
        loader = build_sharded_loader(cfg, tokens_of=tokens_of, latent_tokens_of=latent_tokens_of, dp_rank=0,
                                      dp_size=1, seed=0, accumulation=shards)
        try:
            ids = [[s.sample_id for s in next(loader).samples] for _ in range(8)]
        finally:
            loader.close()
        skips = sum(shard.skipped_total["decode_error"] for shard in loader.loaders.values())
        assert set(loader.bad_samples) == {"rows:3"}
        return ids, skips

    with_workers, skips = batches(cfg)
    in_flight = sum(s.samples_in_flight() for s in build_sharded_loader(
        cfg, tokens_of=tokens_of, latent_tokens_of=latent_tokens_of, dp_rank=0, dp_size=1, seed=0,
        accumulation=shards).loaders.values())
    assert in_flight > 4  # more visits in flight than rows
    reads = opened.read_text().split()
    assert skips > 3, skips  # met on pass after pass...
    assert reads.count("bad.pt") == 1, reads  # ...and read once
    assert min(reads.count(f"good{i}.pt") for i in range(3)) > 3
    # The same batches as without workers (where each visit is read when it is needed).
    assert batches(dataclasses.replace(cfg, packed_dataloader_num_workers=0))[0] == with_workers


# ------------------------------------------------------------------------------------------------
# A tiny run of each recipe on data with poison rows
# ------------------------------------------------------------------------------------------------

class Collected(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def run_to_end(job) -> dict:
    """Train `job` to its max_steps; what the run wrote of its data: the bad samples it listed
    ({id: (reason, detail)}), each step's sample ids, its last metrics row, and the ids of the
    skip warnings it logged."""
    collected, pan_logger = Collected(), logging.getLogger("pan")  # (pan's logger does not propagate)
    pan_logger.addHandler(collected)
    try:
        build_trainer(job).fit()
    finally:
        pan_logger.removeHandler(collected)
    out = Path(job.checkpoint.output_dir)
    listed = [line.split("\t") for line in (out / "bad_samples" / "0.tsv").read_text().splitlines()[1:]]
    steps = [line.split()[1:] for line in (out / "consumed" / "0.txt").read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r.getMessage().split()[1] for r in collected.records if r.getMessage().startswith("skipping")]
    assert len(listed) == len({sample_id for sample_id, *_ in listed}), listed  # each listed once
    assert metrics[-1]["step"] == job.trainer.max_steps and len(steps) == job.trainer.max_steps
    return {"bad": {sample_id: (reason, detail) for sample_id, reason, detail in listed}, "steps": steps,
            "last": metrics[-1], "logged": logged}


def assert_skipped(run: dict, poison: dict[str, tuple[str, str]]) -> None:
    """Each poison row listed with its reason and the words that say why, logged once, never trained;
    the run met the poison rows more often than it read them."""
    assert set(run["bad"]) == set(poison), run["bad"]
    for sample_id, (reason, words) in poison.items():
        assert run["bad"][sample_id][0] == reason and words in run["bad"][sample_id][1], (sample_id, run["bad"])
    assert sorted(run["logged"]) == sorted(poison)
    trained = {sample_id.split("#")[0] for ids in run["steps"] for sample_id in ids}
    assert not trained & set(poison)
    assert run["last"]["bad_samples_distinct"] == len(poison) and run["last"]["bad_samples"] > len(poison)
    assert run["last"]["skipped_steps"] == 0  # a NaN latent is a bad sample, not a skipped step


@pytest.fixture(scope="module")
def pyramid_rows(tmp_path_factory) -> Path:
    """8 good latent rows (3 channels, 4 frames of 16 x 16: the identity VAE's pixels) and 4 poison
    rows, in one annotation file; captions encoded by the tiny text encoders."""
    root = tmp_path_factory.mktemp("pyramid_rows")
    rows = []
    for i in range(8):
        torch.save(randn(1, 3, 4, 16, 16, seed=i), root / f"good{i}.pt")  # as the extraction tool saves it
        rows.append({"latent": f"good{i}.pt", "text": f"good clip {i}"})
    torch.save(randn(4, 4, 16, 16, seed=10), root / "channels.pt")
    torch.save(randn(3, 4, 30, 30, seed=11), root / "geometry.pt")
    torch.save(torch.full((3, 4, 16, 16), float("nan")), root / "nan.pt")
    torch.save({"prompt_embed": randn(1, 6, 7, seed=12), "prompt_attention_mask": torch.ones(1, 6, dtype=torch.long),
                "pooled_prompt_embed": randn(1, 20, seed=13)}, root / "narrow-text.pt")
    rows += [{"latent": "channels.pt", "text": "a latent of another VAE"},
             {"latent": "geometry.pt", "text": "30 x 30: no whole stage units"},
             {"latent": "nan.pt", "text": "a latent full of NaN"},
             {"latent": "good0.pt", "text": "text features of another encoder", "text_fea": "narrow-text.pt"}]
    return write_jsonl(root / "rows.jsonl", rows)


PYRAMID_POISON = {"rows:8": ("unfit", "4 channels"), "rows:9": ("unfit", "30 x 30"),
                  "rows:10": ("not_finite", "NaN"), "rows:11": ("unfit", "7 wide")}


# pan's transformer in the Pyramid-Flow recipe: 3 channels, 2x2 patches, captions 24 wide.
PAN_DIT = {"in_channels": 3, "out_channels": 3, "patch_size": [1, 2, 2], "hidden_size": 32, "num_attention_heads": 2,
           "num_layers": 1, "num_single_layers": 0, "num_refiner_layers": 1, "mlp_ratio": 2.0,
           "text_mlp_ratio": 2.0, "refiner_mlp_ratio": 2.0, "text_embed_dim": 24, "rope_axes_dim": [4, 6, 6]}


@pytest.mark.parametrize("recipe, model", [("pyramid_flow", "pyramid_flux"), ("pyramid_flow_ar", "pyramid_flux"),
                                           ("pyramid_flow", "pan")])
def test_pyramid_runs_skip_poison_latents_and_train_the_rest(tmp_path, released, pyramid_rows, recipe, model):
    ar = recipe == "pyramid_flow_ar"
    dit = {"transformer_config_overrides": PAN_DIT} if model == "pan" else {}
    cfg = {"recipe": recipe,
           "model": {"model_name": model, "model_path": str(released), "vae_type": "identity", **dit},
           "training": {"learning_rate": 1e-3, "max_steps": 5, "dtype": "fp32", "use_muon": False,
                        "gradient_accumulation_steps": 2 if ar else 1},  # AR: one sync group of 2 slots
           "data": {"video_csv_paths": [], "annotation_paths": [str(pyramid_rows)],
                    "resolution_buckets": ["16x16"], "min_frames": 1, "max_frames": 4, "frames_mod": 1,
                    "frames_remainder": 0, "max_tokens_per_batch": 4000, "max_samples_per_batch": 4,
                    "packed_dataloader_num_workers": 0},
           "output": {"output_dir": str(tmp_path / "run"), "save_interval": 100, "log_interval": 1,
                      "progress_bar": False}}
    if ar:
        cfg["autoregressive"] = {"frame_per_unit": 1, "video_sync_group": 2}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    run = run_to_end(load(tmp_path / "run.yaml"))
    assert_skipped(run, PYRAMID_POISON)
    # Every step trained 4 clips: the batches that met a poison row were filled from the next rows.
    assert all(len({i.split("#")[0] for i in ids}) == 4 for ids in run["steps"]), run["steps"]


def write_precomputed(root: Path, name: str, shape: tuple[int, ...], seed: int, text_width: int = 384,
                      fill: float | None = None) -> str:
    latent = randn(*shape, seed=seed) if fill is None else torch.full(shape, fill)
    save_file({"latent": latent, "text": randn(6, text_width, seed=seed + 100)}, str(root / f"{name}.safetensors"))
    return f"{name}.safetensors"


def test_a_pan_run_skips_poison_latents_and_clips_and_trains_the_rest(tmp_path):
    """tiny_cpu.yaml (3 channels, patches of 1 x 4 x 4, MiniLM's 384-wide captions): pan's precomputed
    rows, and annotation rows of videos; the buckets are set after the config checks (a hostile
    config), so that a 4:3 clip decodes to 40 x 30, which patches of 4 cannot cut."""
    root = tmp_path / "data"
    root.mkdir()
    rows = [[write_precomputed(root, f"good{i}", (3, 5, 8, 8), seed=i), f"precomputed clip {i}"] for i in range(6)]
    rows += [[write_precomputed(root, "channels", (4, 5, 8, 8), seed=10), "a latent of another VAE"],
             [write_precomputed(root, "geometry", (3, 5, 6, 6), seed=11), "6 x 6: no whole patches"],
             [write_precomputed(root, "nan", (3, 5, 8, 8), seed=12, fill=float("nan")), "a latent full of NaN"],
             [write_precomputed(root, "narrow", (3, 5, 8, 8), seed=13, text_width=100), "caption features 100 wide"]]
    with open(root / "latents.csv", "w", newline="") as f:
        csv.writer(f).writerows([["latent_path", "caption"], *rows])
    videos = synth_dataset(tmp_path / "synth", num_train=4, num_heldout=1, size=32, num_frames=5)["train_csv"]
    with open(videos) as f:
        paths = [str(videos.parent / r["path"]) for r in csv.DictReader(f)]
    torch.save(randn(3, 2, 8, 8, seed=20), root / "pyramid.pt")
    annotations = write_jsonl(root / "clips.jsonl", [{"video": p, "text": f"video {i}"} for i, p in enumerate(paths)]
                              + [{"latent": "pyramid.pt", "text": "a Pyramid-Flow latent"},
                                 {"video": str(real_video(CARPHONE)), "text": "4:3, decodes to 40 x 30"}])
    argv = ["--config", str(REPO / "config/tiny_cpu.yaml"), "--output_dir", str(tmp_path / "run"),
            "--video_csv_paths", str(root / "latents.csv"), "--annotation_paths", str(annotations),
            "--annotation_weights", "[1.0]", "--video_csv_weights", "[1.0]", "--max_samples_per_batch", "2",
            "--max_steps", "8", "--save_interval", "100", "--log_interval", "1"]
    job = load_job_config(argv, warn=lambda m: None)
    job = dataclasses.replace(job, data=dataclasses.replace(job.data, resolution_buckets=["32x32", "40x30"]))
    run = run_to_end(job)
    assert_skipped(run, {"latents:6": ("unfit", "4 channels"), "latents:7": ("unfit", "patch_size"),
                         "latents:8": ("not_finite", "NaN"), "latents:9": ("unfit", "100 wide"),
                         "clips:4": ("unfit", "Pyramid-Flow latent"), "clips:5": ("unfit", "40x30")})
    assert all(len(ids) == 2 for ids in run["steps"]), run["steps"]


def test_a_causal_vae_run_skips_clips_it_cannot_encode_and_trains_the_rest(tmp_path):
    """causal_vae_tiny.yaml (4x in space) with buckets set after the config checks: a 4:3 video and
    a 4:3 image decode to 40 x 30, which the VAE cannot encode."""
    videos = synth_dataset(tmp_path / "synth", num_train=4, num_heldout=1, size=32, num_frames=9)["train_csv"]
    with open(videos) as f:
        paths = [str(videos.parent / r["path"]) for r in csv.DictReader(f)]
    (tmp_path / "wide.jpg").write_bytes(image_bytes(80, 60, 1))
    annotations = write_jsonl(tmp_path / "clips.jsonl", [{"video": p} for p in paths]
                              + [{"video": str(real_video(CARPHONE))}, {"image": str(tmp_path / "wide.jpg")}])
    argv = ["--config", str(REPO / "config/causal_vae_tiny.yaml"), "--output_dir", str(tmp_path / "run"),
            "--video_csv_paths", "[]", "--annotation_paths", str(annotations), "--max_steps", "5",
            "--save_interval", "100", "--log_interval", "1"]
    job = load_job_config(argv, warn=lambda m: None)
    job = dataclasses.replace(job, data=dataclasses.replace(job.data, resolution_buckets=["32x32", "40x30"]))
    run = run_to_end(job)
    assert_skipped(run, {"clips:4": ("unfit", "multiples of 4"), "clips:5": ("unfit", "multiples of 4")})
    assert all(len(ids) == 2 for ids in run["steps"]), run["steps"]


def test_a_loader_skips_what_the_recipe_cannot_count(tmp_path):
    """A recipe's tokens_of that refuses a shape (ValueError) makes a skip, not a crash."""
    (tmp_path / "a.jpg").write_bytes(image_bytes(64, 32, 1))
    (tmp_path / "b.jpg").write_bytes(image_bytes(32, 64, 2))
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"image": "a.jpg", "text": "wide"}, {"image": "b.jpg", "text": "tall"}])

    def refusing(t: int, h: int, w: int) -> int:
        if h > w:
            raise ValueError(f"a clip of {t}x{h}x{w} cannot be encoded")
        return tokens_of(t, h, w)

    loader = build_data_loader(small_config(annotation_paths=[str(rows)]), tokens_of=refusing, dp_rank=0,
                               dp_size=1, seed=0)
    for _ in range(3):
        assert {s.sample_id for s in next(loader).samples} == {"rows:0"}
    assert loader.bad_samples == {"rows:1": ("unfit", "a clip of 1x64x32 cannot be encoded")}
