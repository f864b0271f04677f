"""`pan check` for the Wan recipe at the releases' real sizes, and its memory figures against what a run
allocates.

The three shipped configs run against folders with the released config.json values
(tests/wan_release_configs.py) and weights that are headers only (tests/wan_tiny.py's
`write_weight_headers`: each file names the tensors of the model its config.json builds, its data a hole
of the right length; the models are built on the meta device), each on the layout its header names: the
verdict, the Wan rows, the estimate against --device-memory, and the figures docs/wan.md prints (its table is read here and compared with `--json`). A layout that does not fit is
refused with the change that makes it fit.

Measured against a run, on a small transformer with the release's encoders and VAE: the estimate's
parameters, frozen parameters and optimizer states equal the bytes of the tensors a real model, its LoRA
adapters and AdamW hold after one step, and the gradients never exceed the gradients that step made. Its
activations (with the attention workspace and the gradients at the peak) bound from above the peak of
the tensors a real forward and backward allocate (torch.profiler's memory timeline), with and without
activation checkpointing: measured over by 11% and 4% (see `test_activations_bound_a_measured_step`).
"""

from __future__ import annotations

import json
import re
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from pan.config import load_job_config
from pan.lora.adapters import LoraConfig, add_adapters
from pan.models.pyramid_io import WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from pan.models.packing import PackInfo
from pan.optim.builder import build_optimizer
from pan.parallel.fsdp import materialize_and_init, parallelize_model
from pan.parallel.precision import compute_precision
from pan.preflight.command import main_check
from pan.preflight.core import Preflight
from pan.recipes.wan.model import WanConfig, WanTransformer
from pan.recipes.wan.probe import lora_parameters, transformer_parameters
from pan.recipes.wan.task import ModelInputs, loss_sum
from pan.recipes.wan.weights import load_config
from wan_release_configs import write_precomputed_rows, write_release_folder
from wan_tiny import write_weight_headers

REPO = Path(__file__).resolve().parents[1]
GIB = 2 ** 30
# config -> the release it fine-tunes, one precomputed latent [C, T, H, W] of its clips, the layout its
# header names
RUNS = {
    "config/wan2.1_t2v_1.3b_lora.yaml": ("wan2.1_t2v_1.3b", (16, 21, 60, 104), ["--device-memory", "24"]),
    "config/wan2.2_a14b_lora.yaml": ("wan2.2_t2v_a14b", (16, 9, 60, 104), ["--device-memory", "80"]),
    "config/wan2.1_t2v_14b.yaml": ("wan2.1_t2v_14b", (16, 21, 90, 160),
                                   ["--gpus-per-node", "8", "--device-memory", "80"]),
}
# the bullet of docs/wan.md that counts each config by hand
HAND_COUNT_BULLETS = {"config/wan2.1_t2v_1.3b_lora.yaml": "- **1.3B, LoRA rank 32**",
                      "config/wan2.2_a14b_lora.yaml": "- **A14B, both experts, LoRA rank 16**",
                      "config/wan2.1_t2v_14b.yaml": "- **14B full fine-tuning on 8 GPUs**"}
SECTION = "Fitting on GPUs: `pan check`, the three configs, context parallel"   # of docs/wan.md
WAN_ROWS = ("layout", "wan folder", "text encoder", "vae", "data", "memory", "memory by hand")


def release_folder(folder: Path, release: str, **transformer) -> Path:
    """write_release_folder's folder with write_weight_headers' weights."""
    return write_weight_headers(write_release_folder(folder, release, **transformer))


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """config -> (its release's config-only folder, a precomputed CSV of one clip of its size)."""
    root = tmp_path_factory.mktemp("wan_releases")
    out = {}
    for config, (release, latent, _) in RUNS.items():
        out[config] = (release_folder(root / release, release),
                       write_precomputed_rows(root / f"pre_{release}", latent))
    return out


@pytest.fixture
def roomy_disk(monkeypatch):
    """A file system with room for the 14B's 160 GiB checkpoints (the output dir row counts them)."""
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2 ** 50, 0, 2 ** 50))


def check(config: str, folder: Path, clips: Path, out: Path, capsys, *extra: str) -> tuple[int, dict]:
    """`pan check --json` of a shipped config with its placeholders given: (exit code, the JSON)."""
    code = main_check(["--config", str(REPO / config), "--model_path", str(folder), "--video_csv_paths",
                       f"[{clips}]", "--output_dir", str(out), "--sample-rows", "1", "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def rows_of(report: dict) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    for row in report["rows"]:
        rows.setdefault(row["check"], []).append(row)
    return rows


def docs_section() -> str:
    """The section of docs/wan.md these tests run: its commands (RUNS, with their layouts), its table
    and its hand counts."""
    text = (REPO / "docs/wan.md").read_text()
    start = text.index(f"### {SECTION}\n")
    return text[start:text.index("\n## ", start)]


def docs_table() -> dict[str, dict[str, str]]:
    """The section's memory table: config -> column -> cell."""
    lines = [line for line in docs_section().splitlines() if line.startswith("| ")]
    header = next(line for line in lines if line.startswith("| config |"))
    names = [c.strip() for c in header.strip("|").split("|")]
    table = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == len(names) and cells[0].startswith("`config/wan"):
            table[cells[0].strip("`")] = dict(zip(names, cells))
    return table


def gib(cell: str) -> float:
    return float(re.match(r"\*?\*?([\d.,]+) GiB", cell).group(1).replace(",", ""))


def docs_bullet(start: str) -> str:
    """The text of the section's bullet that starts with `start` (up to the next bullet or blank line)."""
    text = docs_section()
    at = text.index(start)
    return re.split(r"\n(?:- |\n)", text[at + 2:], maxsplit=1)[0]


def test_the_docs_commands_are_these_runs():
    block = docs_section().split("```bash\n")[1].split("```")[0]
    assert block.splitlines() == [f"pan check --config {config} {' '.join(args)}" for config, (_, _, args) in RUNS.items()]


@pytest.mark.parametrize("config", list(RUNS))
def test_shipped_config_fits_its_layout(config, releases, tmp_path, capsys, roomy_disk):
    folder, clips = releases[config]
    code, report = check(config, folder, clips, tmp_path / "out", capsys, *RUNS[config][2])
    rows = rows_of(report)
    failed = [r for r in report["rows"] if r["status"] == "fail"]
    assert code == 0 and not failed, failed
    for name in WAN_ROWS:
        assert rows[name] and all(r["status"] == "pass" for r in rows[name]), rows.get(name)
    est = report["estimate"]
    assert est["fits"] and est["total"] <= est["capacity"]
    device = est["device"]
    assert device["activations"] > 0 and device["optimizer states"] > 0
    # the figures docs/wan.md prints for this config are this run's
    documented = docs_table()[config]
    for column, key in (("trained (fp32)", "parameters"), ("frozen base", "frozen parameters"),
                        ("AdamW states", "optimizer states"), ("activations", "activations")):
        assert gib(documented[column]) == pytest.approx(device.get(key, 0) / GIB, abs=0.05), (column, documented)
    assert gib(documented["total"]) == pytest.approx(est["total"] / GIB, abs=0.05)
    assert gib(documented["of"]) == pytest.approx(est["capacity"] / GIB, abs=0.05)
    # block inputs, by hand: blocks x tokens per rank x width x 4 B (the fp32 residual stream), part of
    # the traced activations
    arch = json.loads((folder / "transformer/config.json").read_text())
    cp = int(report["rows"][[r["check"] for r in report["rows"]].index("layout")]["detail"].split("x cp ")[1][0])
    latent = RUNS[config][1]
    tokens = latent[1] * latent[2] // 2 * latent[3] // 2
    kept = arch["num_layers"] * tokens // cp * arch["num_attention_heads"] * arch["attention_head_dim"] * 4
    assert gib(documented["block inputs"]) == pytest.approx(kept / GIB, abs=0.005)
    assert kept < device["activations"]
    # the hand count's figures (the `memory by hand` row) are the ones its docs bullet shows
    figures = re.findall(r"\d[\d,]*\.\d\d GiB|\d[\d,]*\.\dM", rows["memory by hand"][0]["detail"])
    bullet = docs_bullet(HAND_COUNT_BULLETS[config])
    assert figures and all(f in bullet for f in figures), (figures, bullet)


def test_a_layout_that_does_not_fit_is_refused_with_the_change_that_fits(releases, tmp_path, capsys):
    config = "config/wan2.1_t2v_1.3b_lora.yaml"
    folder, clips = releases[config]
    code, report = check(config, folder, clips, tmp_path / "out", capsys, "--gpus-per-node", "2",
                         "--device-memory", "12")
    memory = rows_of(report)["memory"][0]
    assert code == 1 and memory["status"] == "fail" and "does not fit" in memory["detail"]
    assert "--cp_size 2 (~8.2 GiB" in memory["fix"]   # the figure docs/wan.md quotes
    fits = report["fitting_changes"]
    assert fits and fits[0]["keys"] == {"cp_size": 2} and fits[0]["estimate"]["fits"]


# ------------------------------------------------------------------------------------------------
# Weights that are not there: refused when the config loads (exit 2), before any model is built
# ------------------------------------------------------------------------------------------------

def refusal(folder: Path, config: str, tmp_path: Path, capsys) -> tuple[int, list[dict]]:
    """`pan check --json` of `config` on `folder` (one small precomputed clip): the exit code and the
    failed rows."""
    clips = write_precomputed_rows(tmp_path / "pre", (16, 2, 8, 8))
    code, report = check(config, folder, clips, tmp_path / "out", capsys)
    return code, [r for r in report["rows"] if r["status"] == "fail"]


@pytest.mark.parametrize("release, config, without", [
    ("wan2.1_t2v_1.3b", "config/wan2.1_t2v_1.3b_lora.yaml", ["transformer"]),
    ("wan2.2_t2v_a14b", "config/wan2.2_a14b_lora.yaml", ["transformer_2"]),
    ("wan2.2_t2v_a14b", "config/wan2.2_a14b_lora.yaml", ["transformer", "transformer_2"])],
    ids=["t2v", "a14b-low-noise", "a14b-both"])
def test_a_folder_without_weights_is_refused(release, config, without, tmp_path, capsys):
    """config.json files without the safetensors beside them: `pan check` (and train.py, which loads the
    config the same way) refuses before building a model: exit 2, one row per missing part naming
    `model_path`, the part's folder, which expert it is and the fix."""
    folder = release_folder(tmp_path / "wan", release, **SMALL)
    for part in without:
        (folder / part / WEIGHTS_NAME).unlink()
    code, failed = refusal(folder, config, tmp_path, capsys)
    assert code == 2 and len(failed) == len(without), failed
    for part, row in zip(without, failed):
        assert row["check"] == "config" and row["detail"].startswith("`model_path`"), row
        assert f"{folder / part}/ holds no weights" in row["detail"] and f"trains {part}/" in row["detail"], row
        if release.endswith("a14b"):
            assert ("high" if part == "transformer" else "low") + "-noise expert" in row["detail"], row
        assert row["fix"].startswith(f"put the release's {part}/ folder there whole"), row


def test_an_expert_the_run_does_not_train_may_lack_its_weights(tmp_path):
    """A14B training only the high-noise expert loads only transformer/'s weights."""
    folder = release_folder(tmp_path / "wan", "wan2.2_t2v_a14b", **SMALL)
    (folder / "transformer_2" / WEIGHTS_NAME).unlink()
    clips = write_precomputed_rows(tmp_path / "pre", (16, 2, 8, 8))
    job = load_job_config(["--config", str(REPO / "config/wan2.2_a14b_lora.yaml"), "--model_path", str(folder),
                           "--video_csv_paths", f"[{clips}]", "--output_dir", str(tmp_path / "out"),
                           "--wan_experts", "high_noise"], warn=lambda m: None)
    assert job.model.trained_experts() == ("transformer",)


def test_a_shard_index_naming_an_absent_shard_is_refused(tmp_path, capsys):
    """Sharded weights (diffusion_pytorch_model.safetensors.index.json): every shard the index names must
    be there; an index whose shards are all there loads."""
    folder = release_folder(tmp_path / "wan", "wan2.1_t2v_1.3b", **SMALL)
    part = folder / "transformer"
    first, second = (f"diffusion_pytorch_model-0000{i}-of-00002.safetensors" for i in (1, 2))
    (part / WEIGHTS_NAME).rename(part / first)
    with torch.device("meta"):
        names = list(WanTransformer(load_config(part)).state_dict())
    index = {"metadata": {}, "weight_map": {n: first if i % 2 else second for i, n in enumerate(names)}}
    (part / WEIGHTS_INDEX_NAME).write_text(json.dumps(index))
    code, failed = refusal(folder, "config/wan2.1_t2v_1.3b_lora.yaml", tmp_path, capsys)
    assert code == 2 and len(failed) == 1, failed
    detail = failed[0]["detail"]
    assert detail.startswith("`model_path`") and f"{part}/ lacks 1 of the 2 shard files" in detail, detail
    assert f"names ({second}):" in detail, detail
    assert failed[0]["fix"].startswith("put the release's transformer/ folder there whole")
    index["weight_map"] = dict.fromkeys(names, first)    # the one shard, there
    (part / WEIGHTS_INDEX_NAME).write_text(json.dumps(index))
    load_job_config(["--config", str(REPO / "config/wan2.1_t2v_1.3b_lora.yaml"), "--model_path", str(folder),
                     "--video_csv_paths", f"[{write_precomputed_rows(tmp_path / 'pre2', (16, 2, 8, 8))}]",
                     "--output_dir", str(tmp_path / "out")], warn=lambda m: None)


# ------------------------------------------------------------------------------------------------
# The hand count and the model
# ------------------------------------------------------------------------------------------------

CONFIGS = [  # the releases' transformers, and the paths of the other variants (image rows, no norm)
    dict(num_layers=30, num_attention_heads=12, ffn_dim=8960),
    dict(num_layers=40, num_attention_heads=40, ffn_dim=13824),
    dict(num_layers=2, num_attention_heads=2, attention_head_dim=12, ffn_dim=32, in_channels=36, image_dim=10,
         added_kv_proj_dim=24, pos_embed_seq_len=6, cross_attn_norm=False, patch_size=[2, 2, 2], freq_dim=15),
]


@pytest.mark.parametrize("values", CONFIGS)
def test_hand_count_is_the_model(values):
    config = WanConfig(**values)
    with torch.device("meta"):
        model = WanTransformer(config)
    matrices, vectors = transformer_parameters(config)
    assert matrices == sum(p.numel() for p in model.parameters() if p.ndim >= 2)
    assert vectors == sum(p.numel() for p in model.parameters() if p.ndim < 2)
    with torch.device("meta"):
        add_adapters(model, LoraConfig(lora_rank=4), 0, "fp32", None)
    assert lora_parameters(config, 4) == sum(p.numel() for p in model.parameters() if p.requires_grad)


# ------------------------------------------------------------------------------------------------
# Measured: what a run allocates
# ------------------------------------------------------------------------------------------------

SMALL = dict(num_layers=2, num_attention_heads=2, attention_head_dim=16, ffn_dim=64)


def small_job(tmp_path: Path, config: str, *extra: str):
    folder = release_folder(tmp_path / "small", "wan2.1_t2v_1.3b", **SMALL)
    clips = write_precomputed_rows(tmp_path / "pre", (16, 2, 8, 8))
    return load_job_config(["--config", str(REPO / config), "--model_path", str(folder),
                            "--video_csv_paths", f"[{clips}]", "--output_dir", str(tmp_path / "out"),
                            "--resolution_buckets", "[64x64]", "--min_frames", "5", "--max_frames", "5",
                            "--max_tokens_per_batch", "32", "--max_text_tokens", "16", *extra], warn=lambda m: None)


def one_real_step(job, ctx: Preflight) -> dict[str, int]:
    """Bytes a real step's tensors hold, as the trainer builds them (fp32 weights; LoRA adapters on a
    base whose matrices are at lora_base_dtype): trained and frozen parameters, the gradients after the
    backward, AdamW's states after the step (its 0-dim step counters aside)."""
    spec = ctx.part_specs[0]
    model = materialize_and_init(spec.build(), torch.device("cpu"), 0, None)
    if spec.lora is not None:
        add_adapters(model, spec.lora, 0, job.trainer.dtype, None)
    optimizer, _ = build_optimizer(model, spec.optim.optim())
    arch, pack = model.config, PackInfo.build([(2, 4, 4)], [16])   # the small job's one clip, in patches
    p = arch.patch_volume
    inputs = ModelInputs(x=torch.randn(32, arch.in_channels * p), target=torch.randn(32, arch.output_channels * p),
                         weight=torch.ones(32), timesteps=torch.tensor([500.0]), text=torch.randn(16, arch.text_dim),
                         pack=pack, sample_ids=["a"], samples=1, tokens=32, packing=1.0, bad_samples=0)
    with compute_precision(job.trainer.dtype, "cpu"):   # the trainer's autocast
        loss = loss_sum(model, inputs)
    loss.backward()
    optimizer.step()
    params = list(model.parameters())
    states = [t for opt in optimizer.optimizers for s in opt.state.values() for t in s.values()
              if isinstance(t, torch.Tensor) and t.ndim > 0]
    return {"parameters": sum(q.numel() * q.element_size() for q in params if q.requires_grad),
            "frozen parameters": sum(q.numel() * q.element_size() for q in params if not q.requires_grad),
            "gradients": sum(q.grad.numel() * q.grad.element_size() for q in params if q.grad is not None),
            "optimizer states": sum(t.numel() * t.element_size() for t in states)}


@pytest.mark.parametrize("config, extra", [("config/wan2.1_t2v_1.3b_lora.yaml", ()),
                                           ("config/wan2.1_t2v_14b.yaml", ("--cp_size", "1", "--dtype", "fp32"))],
                         ids=["lora-bf16-base", "full-fp32"])
def test_estimate_is_what_a_step_allocates(config, extra, tmp_path):
    job = small_job(tmp_path, config, *extra)
    ctx = Preflight(job, 1, 1, device_memory=24)
    estimated = ctx.estimate.device
    allocated = one_real_step(job, ctx)
    for key in ("parameters", "frozen parameters", "optimizer states"):
        assert estimated.get(key, 0) == allocated[key], key
    assert 0 <= estimated["gradients"] <= allocated["gradients"]


# The estimate is a plan: it must never be under what a step takes, and stay of its size. Measured on
# this small step: 5.69 MB estimated for 5.11 MB allocated with checkpointing (+11%), 15.01 MB for
# 14.42 MB without (+4%); OVERCOUNT is the most the estimate may exceed the step by and still be a plan
# worth reading (it is not noise: the trace counts every storage at its full size where a kernel reuses).
OVERCOUNT = 1.5


@pytest.mark.parametrize("checkpointing", ["true", "false"])
def test_activations_bound_a_measured_step(checkpointing, tmp_path):
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfileTimeline

    folder = release_folder(tmp_path / "small", "wan2.1_t2v_1.3b", **{**SMALL, "num_layers": 3})
    clips = write_precomputed_rows(tmp_path / "pre", (16, 5, 32, 32))
    job = load_job_config(["--config", str(REPO / "config/wan2.1_t2v_14b.yaml"), "--model_path", str(folder),
                           "--video_csv_paths", f"[{clips}]", "--output_dir", str(tmp_path / "out"),
                           "--resolution_buckets", "[256x256]", "--min_frames", "17", "--max_frames", "17",
                           "--max_tokens_per_batch", "1280", "--max_text_tokens", "16", "--cp_size", "1",
                           "--dtype", "fp32", "--enable_gradient_checkpointing", checkpointing], warn=lambda m: None)
    ctx = Preflight(job, 1, 1, device_memory=24)
    device = ctx.estimate.device
    estimated = device["activations"] + device["attention workspace"] + device["gradients"]
    model = materialize_and_init(ctx.part_specs[0].build(), torch.device("cpu"), 0, None)
    model = parallelize_model(model, None, ctx.dims, job.parallel, job.trainer)   # the run's checkpointing
    arch, pack = model.config, PackInfo.build([(5, 16, 16)], [16])   # the probe's clip: 1280 tokens
    p = arch.patch_volume
    inputs = ModelInputs(x=torch.randn(1280, arch.in_channels * p), target=torch.randn(1280, arch.output_channels * p),
                         weight=torch.ones(1280), timesteps=torch.tensor([500.0]), text=torch.randn(16, arch.text_dim),
                         pack=pack, sample_ids=["a"], samples=1, tokens=1280, packing=1.0, bad_samples=0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        loss_sum(model, inputs).backward()
    live = peak = 0
    for _, action, _, size in MemoryProfileTimeline(prof._memory_profile()).timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    assert peak <= estimated <= OVERCOUNT * peak, (peak, estimated)


# ------------------------------------------------------------------------------------------------
# Every variant: the probe runs each one's step (per-token timesteps, image rows, both experts)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["t2v", "ti2v", "a14b", "i2v"])
def test_every_variant_is_estimated(variant, tmp_path, capsys):
    """`pan check` on a tiny folder of each variant, its clips encoded while training: the memory rows
    pass, and the frozen encoders training loads are counted (the VAE, umT5; I2V's CLIP)."""
    from wan_tiny import clip_geometry, write_wan_folder

    from pan.data.synth import synth_dataset

    folder = write_wan_folder(tmp_path / "model", variant)
    geometry = clip_geometry(folder)
    clips = synth_dataset(tmp_path / "clips", num_train=2, num_heldout=0, size=geometry["size"],
                          num_frames=geometry["frames"])["train_csv"]
    config = tmp_path / "wan.yaml"
    config.write_text(f"recipe: wan\nmodel:\n  model_path: {folder}\ndata:\n  resolution_buckets: "
                      f"[\"{geometry['size']}x{geometry['size']}\"]\n  min_frames: {geometry['frames']}\n"
                      f"  max_frames: {geometry['frames']}\n  max_tokens_per_batch: {2 * geometry['tokens']}\n"
                      "  packed_dataloader_num_workers: 0\ntraining:\n  dtype: fp32\n")
    code = main_check(["--config", str(config), "--video_csv_paths", f"[{clips}]", "--output_dir",
                       str(tmp_path / "out"), "--sample-rows", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    rows = rows_of(report)
    assert code == 0, [r for r in report["rows"] if r["status"] == "fail"]
    assert all(r["status"] == "pass" for name in ("memory", "memory by hand", "wan folder") for r in rows[name])
    frozen = {k for k in report["estimate"]["device"] if k.startswith("frozen ")}
    assert frozen == {"frozen vae", "frozen text encoder"} | ({"frozen image encoder"} if variant == "i2v" else set())


def test_a_weights_file_cut_short_is_refused(tmp_path):
    """`pan check` reads the weights' headers only (no mapping of a 57 GB file); a file whose length is
    not its header's (a download cut short) fails the `wan folder` row, named, with the fix."""
    from pan.recipes.wan.checks import check_wan_folder, header_shapes

    folder = release_folder(tmp_path / "wan", "wan2.1_t2v_1.3b", **SMALL)
    path = folder / "transformer" / WEIGHTS_NAME
    assert header_shapes(path)["blocks.0.ffn.net.0.proj.weight"] == (64, 32)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 4)
    clips = write_precomputed_rows(tmp_path / "pre", (16, 2, 8, 8))
    job = load_job_config(["--config", str(REPO / "config/wan2.1_t2v_1.3b_lora.yaml"), "--model_path", str(folder),
                           "--video_csv_paths", f"[{clips}]", "--output_dir", str(tmp_path / "out")],
                          warn=lambda m: None)
    (row,) = check_wan_folder(Preflight(job, 1, 1))
    assert row.status == "fail" and str(path) in row.detail and "incomplete or damaged" in row.detail, row
    assert row.fix == "download the release's transformer/ folder again, whole."
