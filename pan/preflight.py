"""`pan check`: everything that can stop a run, checked before any process group or weight exists.

    pan check --config config/X.yaml [--key value ...] [--nodes N] [--gpus-per-node G]

The preflight loads the config (every ConfigError of the loader), then runs a list of small checks,
each returning rows of `check | pass/warn/fail | detail`; a failed row says how to fix it. Checks
read files and metadata only: the model is built on the meta device, checkpoints and state dicts are
compared by their recorded shapes, media are decoded with the data pipeline's own functions. Nothing
is trained and no process group is started.

Exit codes: 0 when nothing failed (warnings allowed), 1 when a check failed, 2 when the config does not
load at all (the loader's error is then the only config row; fix it and run again to see the rest).

Checks are registered per recipe in `CHECKS` (recipe name -> list of checks); the environment checks
in `ENVIRONMENT_CHECKS` run for every recipe, even when the config does not load. A later recipe adds
its own list with `register_check("<recipe>")`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from pan.config import ConfigError, load_job_config
from pan.estimate import (
    Phase,
    Probe,
    frozen_vae_bytes,
    hf_model_bytes,
    largest_batch,
    loader_bytes,
    register_probe,
    run_device,
)

Status = Literal["pass", "warn", "fail"]
EXIT_OK, EXIT_FAILED, EXIT_CONFIG_ERROR = 0, 1, 2
DEFAULT_SAMPLE_ROWS = 4
# Bytes per parameter kept in a checkpoint (see `checkpoint_bytes`).
FP32_BYTES = 4


@dataclass
class Row:
    """One line of the preflight table; `fix` is set for every warning and failure."""
    check: str
    status: Status
    detail: str
    fix: str = ""


@dataclass
class Preflight:
    """What the checks look at: the loaded job and the planned layout. Expensive things (the meta
    model, the parallel layout) are built once, on first use."""
    job: object                 # the recipe's job config (None when it did not load)
    nodes: int
    gpus_per_node: int
    sample_rows: int = DEFAULT_SAMPLE_ROWS
    notes: dict = field(default_factory=dict)
    device_memory: float | None = None   # GiB per device to plan for (--device-memory); None: this machine's

    def with_job(self, job) -> Preflight:
        """The same planned layout for another job (a suggested change of keys)."""
        return Preflight(job, self.nodes, self.gpus_per_node, self.sample_rows, device_memory=self.device_memory)

    @functools.cached_property
    def estimate(self):
        """Memory per device and step time of the job on this layout (pan/estimate.py)."""
        from pan.estimate import estimate_run
        return estimate_run(self, self.device_memory)

    @functools.cached_property
    def fitting_changes(self) -> list:
        """Single changes of keys that make a run that does not fit fit, cheapest first."""
        from pan.estimate import fitting_changes
        return [] if self.estimate.fits else fitting_changes(self, self.estimate, self.with_job)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @functools.cached_property
    def dims(self):
        """ParallelDims of the planned world; raises ConfigError for an impossible layout."""
        from pan.parallel.dims import ParallelDims
        return ParallelDims.from_config(self.job.parallel, self.world_size, self.gpus_per_node)

    @functools.cached_property
    def task(self):
        """The recipe's task as rank 0 of the planned world builds it (nothing heavy is loaded)."""
        from pan.parallel.world import World
        from pan.recipes import get_recipe
        world = World(rank=0, size=self.world_size, local_rank=0, local_size=self.gpus_per_node,
                      device=torch.device("cpu"))
        return get_recipe(self.job.recipe).task(self.job, world, self.dims, None)

    @functools.cached_property
    def part_specs(self) -> list:
        return self.task.part_specs()

    @functools.cached_property
    def models(self) -> dict[str, torch.nn.Module]:
        """The recipe's parts on the meta device (shapes only, no memory), as the trainer builds them.
        The task is made first, outside the meta device: its constructor may compute real values."""
        specs = self.part_specs
        with torch.device("meta"):
            return {spec.name: spec.build() for spec in specs}

    @property
    def model(self) -> torch.nn.Module:
        """The main part's model on the meta device."""
        return next(iter(self.models.values()))

    @functools.cached_property
    def model_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.model.state_dict().items()}


Check = Callable[[Preflight], list[Row]]
ENVIRONMENT_CHECKS: list[Check] = []       # run for every recipe, with or without a job
CHECKS: dict[str, list[Check]] = {}        # recipe name -> its checks, in table order


def register_check(*recipes: str) -> Callable[[Check], Check]:
    """Add a check to the recipes' lists (no names: to the environment checks of every recipe)."""
    def add(fn: Check) -> Check:
        for recipe in recipes:
            CHECKS.setdefault(recipe, []).append(fn)
        if not recipes:
            ENVIRONMENT_CHECKS.append(fn)
        return fn
    return add


def check_name(fn: Check) -> str:
    return fn.__name__.removeprefix("check_").replace("_", " ")


def run_check(fn: Check, ctx: Preflight) -> list[Row]:
    """A check's rows; a ConfigError or any other exception it raises becomes one failed row, so one
    broken check never hides the others."""
    try:
        return fn(ctx)
    except ConfigError as e:
        return [Row(check_name(fn), "fail", str(e), "see the message")]
    except Exception as e:  # noqa: BLE001 - report it as a row and keep checking
        return [Row(check_name(fn), "fail", f"{type(e).__name__}: {e}", "see the message")]


def run_preflight(ctx: Preflight) -> list[Row]:
    """Rows of the environment checks, then of the job's recipe checks (when the job loaded)."""
    rows = [row for fn in ENVIRONMENT_CHECKS for row in run_check(fn, ctx)]
    if ctx.job is not None:
        rows += [row for fn in CHECKS.get(ctx.job.recipe, []) for row in run_check(fn, ctx)]
    return said_once(rows)


def said_once(rows: list[Row]) -> list[Row]:
    """A failure that several checks run into (an impossible layout stops the checks that need it)
    is printed in full once; the later rows point to it."""
    first: dict[str, str] = {}
    for row in rows:
        if row.status != "fail":
            continue
        if row.detail in first:
            row.detail, row.fix = f"the same problem as the `{first[row.detail]}` row above.", "see there."
        else:
            first[row.detail] = row.check
    return rows


def format_table(rows: list[Row], width: int = 100) -> str:
    """check | status | detail, wrapped; a warning's or failure's fix on a `fix:` line below it."""
    name_w = max([len("check")] + [len(r.check) for r in rows])
    text_w = max(40, width - name_w - 10)
    lines = [f"{'check':<{name_w}} | status | detail", f"{'-' * name_w}-+--------+-{'-' * text_w}"]
    for r in rows:
        body = textwrap.wrap(r.detail, text_w) or [""]
        if r.fix and r.status != "pass":
            body += textwrap.wrap("fix: " + r.fix, text_w)
        lines.append(f"{r.check:<{name_w}} | {r.status:<6} | {body[0]}")
        lines += [f"{'':<{name_w}} | {'':<6} | {more}" for more in body[1:]]
    counts = {s: sum(r.status == s for r in rows) for s in ("pass", "warn", "fail")}
    lines.append(f"{counts['pass']} passed, {counts['warn']} warnings, {counts['fail']} failed")
    return "\n".join(lines)


# ================================================================================================
# Environment: devices and communication backend (every recipe)
# ================================================================================================

@register_check()
def check_devices(ctx: Preflight) -> list[Row]:
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    planned = f"{ctx.nodes} node(s) x {ctx.gpus_per_node} process(es) = world size {ctx.world_size}"
    if visible == 0:
        detail = f"no CUDA GPU visible: {planned} will train on CPU (gloo)."
        fix = "run on GPU nodes for real training; on CPU keep models tiny"
        dtype = getattr(getattr(ctx.job, "trainer", None), "dtype", None)
        if dtype == "bf16":
            detail += " dtype is bf16, whose matmuls are ~90x slower than fp32 on CPU."
            fix += " and set --dtype fp32"
        return [Row("devices", "warn", detail, fix + ".")]
    if visible < ctx.gpus_per_node:
        return [Row("devices", "fail", f"{visible} GPU(s) visible here, but {planned} needs "
                    f"{ctx.gpus_per_node} per node.", f"use --gpus-per-node {visible} or nodes with "
                    f"{ctx.gpus_per_node} GPUs (check CUDA_VISIBLE_DEVICES).")]
    if visible > ctx.gpus_per_node:
        return [Row("devices", "warn", f"{visible} GPUs visible, {planned} uses only "
                    f"{ctx.gpus_per_node} per node.", f"use --gpus-per-node {visible} to use them all.")]
    return [Row("devices", "pass", f"{visible} x {torch.cuda.get_device_name(0)}; {planned}.")]


@register_check()
def check_backend(ctx: Preflight) -> list[Row]:
    """The backend init_world will pick (NCCL with CUDA, gloo without) must exist in this torch."""
    import torch.distributed as dist
    if not dist.is_available():
        return [Row("backend", "fail", f"this torch ({torch.__version__}) has no torch.distributed.",
                    "install a torch build with distributed support.")]
    if torch.cuda.is_available():
        if not dist.is_nccl_available():
            return [Row("backend", "fail", f"CUDA {torch.version.cuda} is available but this torch "
                        "has no NCCL.", "install a CUDA build of torch with NCCL.")]
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        return [Row("backend", "pass", f"CUDA {torch.version.cuda}, NCCL {nccl}.")]
    if not dist.is_gloo_available():
        return [Row("backend", "fail", "no CUDA and no gloo: multi-process CPU runs cannot start.",
                    "install a torch build with gloo.")]
    return [Row("backend", "pass", f"no CUDA; gloo available (torch {torch.__version__}).")]


# ================================================================================================
# The Pan recipe
# ================================================================================================

@register_check("pan")
def check_layout(ctx: Preflight) -> list[Row]:
    """cp and data-parallel degrees for the planned world (the trainer's own ParallelDims)."""
    d = ctx.dims
    return [Row("layout", "pass", f"world {ctx.world_size} = dp_replicate {d.dp_replicate} x dp_shard "
                f"{d.dp_shard} x cp {d.cp}; {d.dp} data-parallel ranks.")]


def _source_sizes(ctx: Preflight) -> dict[str, int]:
    """Samples per stream; sources that cannot be read are left to check_data."""
    from pan.data.sources import SourceError, read_image_tars, read_video_csv
    data, sizes = ctx.job.data, {}
    readers = [(Path(p).name, lambda p=p: read_video_csv(p)) for p in data.video_csv_paths]
    if data.image_tar_paths:
        readers.append(("image tars", lambda: read_image_tars(data.image_tar_paths)))
    for name, read in readers:
        try:
            sizes[name] = len(read())
        except (SourceError, OSError, UnicodeDecodeError):
            continue
    return sizes


@register_check("pan")
def check_batch(ctx: Preflight) -> list[Row]:
    """Every stream must give each data-parallel rank a share, and clips must fit the token budget."""
    from pan.encoders.vae import vae_geometry
    data, arch = ctx.job.data, ctx.job.model.transformer_config_overrides
    rows = []
    dp = ctx.dims.dp
    for name, size in _source_sizes(ctx).items():
        if size < dp:
            rows.append(Row("batch", "fail", f"{name} has {size} samples, fewer than the {dp} "
                            "data-parallel ranks that share it.", "add samples or use fewer ranks."))
    geometry = vae_geometry(ctx.job.vae)
    pt, ph, pw = arch.patch_size
    frame_counts = data.frame_count_range()
    too_big = []
    for height, width in data.buckets():
        for label, frames in (("shortest", frame_counts[0]), ("longest", frame_counts[-1])):
            shape_error = geometry.clip_shape_error(frames, height, width)
            if shape_error:
                raise ConfigError("resolution_buckets", f"a {label} clip {frames}x{height}x{width} "
                                  f"(frames x H x W) cannot be encoded: {shape_error}. Fix the buckets "
                                  "or the frame rules.")
            _, t, h, w = geometry.latent_shape(frames, height, width)
            if t % pt or h % ph or w % pw:
                raise ConfigError("resolution_buckets", f"the latent {t}x{h}x{w} of a {label} clip at "
                                  f"{width}x{height} is not divisible by patch_size {arch.patch_size}.")
            tokens = (t // pt) * (h // ph) * (w // pw)
            if tokens > data.max_tokens_per_batch:
                too_big.append((label, frames, height, width, tokens))
    budget = data.max_tokens_per_batch
    if any(label == "shortest" for label, *_ in too_big):
        rows.append(Row("batch", "fail", "even the shortest clip exceeds max_tokens_per_batch "
                        f"{budget} in: " + _clips(too_big, "shortest") + "; every such sample would be "
                        "skipped (over_budget).", "raise max_tokens_per_batch or shrink the buckets."))
    elif too_big:
        rows.append(Row("batch", "warn", f"clips of max_frames exceed max_tokens_per_batch {budget} in: "
                        + _clips(too_big, "longest") + "; they are skipped (over_budget).",
                        "raise max_tokens_per_batch or lower max_frames."))
    if not rows:
        rows.append(Row("batch", "pass", f"{dp} data-parallel ranks, each with {budget} tokens per "
                        f"packed batch; every bucket's longest clip fits."))
    return rows


@register_check("pan")
def check_cpu(ctx: Preflight) -> list[Row]:
    """Cores of this machine against what one node's processes ask for: the training threads plus
    the decoding workers. Oversubscribed, the workers starve and the trainer waits for data
    (measured on a 2-core machine: data wait 1.7% with 1 thread + 1 worker, 18% with 2 + 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = ctx.job.data.packed_dataloader_num_workers
    # torchrun sets OMP_NUM_THREADS=1 for several processes per node unless it is set already.
    threads = int(os.environ.get("OMP_NUM_THREADS", 1 if ctx.gpus_per_node > 1 else torch.get_num_threads()))
    wanted = ctx.gpus_per_node * (threads + workers)
    detail = (f"{ctx.gpus_per_node} process(es) per node x ({threads} training thread(s) + {workers} "
              f"decoding worker(s)) = {wanted} busy processes/threads; {cores} cores here")
    if workers and wanted > cores:
        return [Row("cpu", "warn", detail + ": the decoding workers will compete with training for "
                    "cores, and the trainer will wait for data.",
                    f"lower OMP_NUM_THREADS or packed_dataloader_num_workers so that they fit {cores} "
                    "cores (this counts the machine pan check runs on).")]
    return [Row("cpu", "pass", detail + ".")]


def _clips(found, label: str) -> str:
    return ", ".join(f"{f}x{h}x{w} -> {tok} tokens" for lab, f, h, w, tok in found if lab == label)


@register_check("pan")
def check_data(ctx: Preflight) -> list[Row]:
    """Parse every source, and decode a few samples of each with the data pipeline's reader."""
    from pan.data.loader import IMAGE_STREAM, SampleReader, rules_of
    from pan.data.sources import SourceError, read_image_tars, read_video_csv
    from pan.encoders.vae import vae_geometry

    data = ctx.job.data
    rows, csvs, sources = [], {}, []
    for path in data.video_csv_paths:
        try:
            csvs[f"video:{Path(path).stem}"] = src = read_video_csv(path)
            sources.append((path, f"video:{Path(path).stem}", len(src)))
        except (SourceError, OSError, UnicodeDecodeError) as e:
            rows.append(Row("data", "fail", f"{path}: {e}", "fix or remove the file."))
    tars = None
    if data.image_tar_paths:
        try:
            tars = read_image_tars(data.image_tar_paths)
            sources.append((", ".join(data.image_tar_paths), IMAGE_STREAM, len(tars)))
        except (SourceError, OSError) as e:
            rows.append(Row("data", "fail", str(e), "fix or remove the tar(s)."))
    reader = SampleReader(csvs, tars, rules_of(data))
    geometry = vae_geometry(ctx.job.vae)
    for label, stream, size in sources:
        rows.append(_decode_sample(reader, geometry, label, stream, size, ctx.sample_rows))
    return rows


def _decode_sample(reader, geometry, label: str, stream: str, size: int, count: int) -> Row:
    """Decode `count` samples spread over a source; fail when none is usable."""
    from pan.data.loader import Ref
    n = min(count, size)
    picks = sorted({round(i * (size - 1) / max(n - 1, 1)) for i in range(n)})  # first, last, between
    good, problems = 0, []
    for index in picks:
        got = reader[Ref(seq=0, stream=stream, epoch=0, pos=0, index=index)]
        if got.sample is None:
            problems.append(f"#{index} {got.reason}: {got.detail}")
            continue
        if got.sample.frames is not None:
            t, h, w = got.sample.grid
            error = geometry.clip_shape_error(t, h, w)
            if error:
                problems.append(f"#{index} decodes to {t}x{h}x{w} but {error}")
                continue
        good += 1
    detail = f"{label}: {size} samples; decoded {good}/{len(picks)} of rows {picks}"
    if problems:
        detail += ". Skipped: " + "; ".join(problems)
    if good == 0:
        return Row("data", "fail", detail + ".", "fix the paths, media or frame rules named above.")
    if problems:
        return Row("data", "warn", detail + ".", "such samples are skipped in training; fix or "
                   "remove them.")
    return Row("data", "pass", detail + ".")


@register_check("pan")
def check_text_encoder(ctx: Preflight) -> list[Row]:
    """Config, tokenizer and weight files of the text encoder, offline; its width fits the model."""
    from pan.encoders.text import (
        load_text_config,
        load_tokenizer,
        resolve_text_encoder_path,
        validate_text_encoder,
    )
    cfg = ctx.job.text_encoder
    # The config load already checked the files, the keys and the width against text_embed_dim;
    # this also builds the tokenizer, which catches a broken vocabulary.
    model_dir = resolve_text_encoder_path(cfg.text_encoder_path)
    text_config = load_text_config(model_dir)
    tokenizer = load_tokenizer(model_dir)
    validate_text_encoder(cfg, text_config, tokenizer)
    return [Row("text encoder", "pass", f"{text_config.model_type}, {text_config.num_hidden_layers} "
                f"layers, width {text_config.hidden_size}, tokenizer {type(tokenizer).__name__}; "
                f"loads offline from {model_dir}.")]


@register_check("pan")
def check_vae(ctx: Preflight) -> list[Row]:
    """The VAE's geometry (config only) and its latent channels against the model's."""
    from pan.encoders.vae import vae_geometry
    geometry = vae_geometry(ctx.job.vae)
    arch = ctx.job.model.transformer_config_overrides
    if geometry.latent_channels != arch.out_channels:
        raise ConfigError("transformer_config_overrides.out_channels",
                          f"is {arch.out_channels}, but the VAE ({ctx.job.vae.vae_type}) gives "
                          f"{geometry.latent_channels} latent channels. Set out_channels: "
                          f"{geometry.latent_channels} (and in_channels to match the schema).")
    return [Row("vae", "pass", f"{ctx.job.vae.vae_type}: {geometry.latent_channels} latent channels, "
                f"{geometry.temporal_factor}x temporal, {geometry.spatial_factor}x spatial.")]


def stored_shapes(kind: str, path: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of a warm-start source, read from headers/metadata (no tensor data is read)."""
    from pan.checkpoint import dcp as layout
    from pan.parallel.names import unwrapped_name
    if kind == "checkpoint":
        from pan.checkpoint.warm_start import part_folder
        folder = part_folder(path, layout.TRANSFORMER) or path
        return {k: tuple(size) for k, (size, _) in layout.dcp_tensor_shapes(folder).items()}
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        with safe_open(str(path), framework="pt") as f:
            return {unwrapped_name(k): tuple(f.get_slice(k).get_shape())
                    for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    # mmap: tensors stay on disk; only their headers are read.
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError("pretrained_transformer_path", f"{path} is not a flat state dict of tensors; "
                          "save model.state_dict() itself, or export a checkpoint with `pan export`.")
    return {unwrapped_name(k): tuple(v.shape) for k, v in state.items()}


@register_check("pan")
def check_warm_start(ctx: Preflight) -> list[Row]:
    """The warm-start weights exist and every tensor has the model's shape."""
    from pan.checkpoint.warm_start import resolve_source
    cfg = ctx.job.warm_start
    if not cfg.load_transformer_weights:
        return [Row("warm start", "pass", "none: the model starts from random init.")]
    resume = _latest_checkpoint(ctx)
    if resume is not None:
        return [Row("warm start", "pass", f"not used: output_dir has {resume.name}, which the run "
                    "resumes instead.")]
    kind, path = resolve_source(cfg.pretrained_transformer_path)
    source = stored_shapes(kind, path)
    model = ctx.model_shapes
    mismatched = [f"{n} {source[n]} vs model {model[n]}" for n in model if n in source and source[n] != model[n]]
    missing = [n for n in model if n not in source]
    loaded = len(model) - len(mismatched) - len(missing)
    summary = (f"{path} ({kind}): {loaded}/{len(model)} model tensors match, {len(mismatched)} "
               f"have another shape, {len(missing)} missing")
    if mismatched or loaded == 0:
        return [Row("warm start", "fail", summary + ". " + "; ".join(mismatched[:5]),
                    "point pretrained_transformer_path at weights of this architecture, or make "
                    "transformer_config_overrides match the weights.")]
    if missing:
        return [Row("warm start", "warn", summary + f" (kept at init): {', '.join(missing[:5])}.",
                    "expected only when the architecture grew on purpose.")]
    return [Row("warm start", "pass", summary + ".")]


def state_bytes(model: torch.nn.Module, optim) -> dict[str, int]:
    """Bytes of a part's training state by kind, whole (unsharded), for its OptimConfig `optim`.

    The weights are fp32 master copies (4 B per parameter whatever the compute dtype). AdamW keeps
    two fp32 moments (8 B per parameter), Muon one fp32 momentum buffer (4 B); the split is the
    optimizer's own, over the trainable parameters. An EMA adds another fp32 copy of those.
    """
    from pan.optim.builder import split_parameters
    groups, _, _ = split_parameters(model, optim.use_muon)
    muon = sum(p.numel() for _, p in groups["muon"])
    trained = sum(p.numel() for members in groups.values() for _, p in members)
    total = sum(p.numel() for p in model.parameters())
    return {"weights": FP32_BYTES * total, "muon": FP32_BYTES * muon,
            "adamw": 2 * FP32_BYTES * (trained - muon),
            "ema": FP32_BYTES * trained if optim.ema_decay > 0 else 0}


def checkpoint_bytes(model: torch.nn.Module, job) -> tuple[int, str]:
    """Size of one checkpoint estimated from the parameter count (`state_bytes`), and how it was
    derived. Data cursors, RNG and schedule are kilobytes."""
    state = state_bytes(model, job.optim)
    total, muon = state["weights"] // FP32_BYTES, state["muon"] // FP32_BYTES
    adamw = state["adamw"] // (2 * FP32_BYTES)
    how = (f"{total / 1e6:,.1f}M params x 4 B (fp32 weights) + {muon / 1e6:,.1f}M Muon x 4 B + "
           f"{adamw / 1e6:,.1f}M AdamW x 8 B" + (" + 4 B EMA" if state["ema"] else ""))
    return sum(state.values()), how


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


@register_check("pan")
def check_output_dir(ctx: Preflight) -> list[Row]:
    """output_dir can be created and written, with room for two checkpoints."""
    out = Path(ctx.job.checkpoint.output_dir)
    base = _existing_ancestor(out)
    try:
        if not base.is_dir():
            raise NotADirectoryError(f"{base} is a file")
        with tempfile.NamedTemporaryFile(dir=base, prefix=".pan-check-"):
            pass
    except OSError as e:
        return [Row("output dir", "fail", f"{out} cannot be written ({type(e).__name__}: {e}).",
                    "point output_dir at a writable directory on shared storage.")]
    size, how = checkpoint_bytes(ctx.model, ctx.job)
    free = shutil.disk_usage(base).free
    detail = (f"{out} writable; one checkpoint ~ {_gib(size)} ({how}); {_gib(free)} free on "
              f"{base}")
    if free < 2 * size:
        return [Row("output dir", "fail", detail + f", less than two checkpoints ({_gib(2 * size)}).",
                    "free space, or use a larger file system: a save needs room for the new "
                    "checkpoint next to the previous one.")]
    limit = ctx.job.checkpoint.save_total_limit
    if limit is None or free < (limit + 1) * size:
        kept = "every checkpoint is kept" if limit is None else f"save_total_limit {limit} keeps {limit}"
        return [Row("output dir", "warn", detail + f"; {kept}, plus one being written.",
                    "set save_total_limit so that (limit + 1) checkpoints fit.")]
    return [Row("output dir", "pass", detail + ".")]


def _latest_checkpoint(ctx: Preflight) -> Path | None:
    from pan.checkpoint import dcp as layout
    complete = layout.complete_checkpoints(Path(ctx.job.checkpoint.output_dir))
    return complete[-1] if complete else None


@register_check("pan")
def check_resume(ctx: Preflight) -> list[Row]:
    """The checkpoints already in output_dir: readable, same data-parallel size, same shapes."""
    from pan.checkpoint import dcp as layout
    out = Path(ctx.job.checkpoint.output_dir)
    complete = layout.complete_checkpoints(out)
    if not complete:
        return [Row("resume", "pass", f"no checkpoint in {out}: the run starts fresh.")]
    readable = [(p, layout.verify_checkpoint(p)) for p in reversed(complete)]
    good = next((p for p, problem in readable if problem is None), None)
    bad = [f"{p.name}: {problem}" for p, problem in readable if problem is not None]
    if good is None:
        return [Row("resume", "fail", f"{out} has checkpoints but none is readable ({'; '.join(bad)}); "
                    "the trainer refuses to overwrite them.", "repair them, or move them out of "
                    "output_dir to start fresh.")]
    meta = layout.read_json(good / layout.META)
    rows = []
    if bad:
        rows.append(Row("resume", "warn", f"unreadable, skipped on resume: {'; '.join(bad)}.",
                        "delete or repair them."))
    dp, restart = ctx.dims.dp, ctx.job.data.restart_data_on_dp_change
    layout_text = (f"{good.name} was written by {meta['dp_size']} data-parallel ranks (world "
                   f"{meta['world_size']}, cp {meta['cp_size']}); this layout has {dp}")
    # The Pan recipe keeps one cursor per data shard (dp x accumulation: ShardedLoader) and
    # continues on any layout.
    old_shards = meta.get("data_shards", meta["dp_size"])
    new_shards = dp * ctx.job.trainer.gradient_accumulation_steps
    if old_shards == new_shards and meta["dp_size"] != dp:
        rows.append(Row("resume", "pass", layout_text + f": each of the {new_shards} data shards continues "
                        "exactly (the global batch, its samples and noise are kept)."))
    elif old_shards != new_shards and not restart:
        keep = (f"set gradient_accumulation_steps: {old_shards // dp} to keep it"
                if old_shards % dp == 0 else "no whole gradient_accumulation_steps keeps it")
        rows.append(Row("resume", "warn", layout_text + f": the data continues from every old shard's "
                        f"cursor, but a step trains {new_shards} micro-batches instead of {old_shards}.",
                        keep + " (the LR schedule continues by step)."))
    elif old_shards != new_shards:
        rows.append(Row("resume", "warn", layout_text + ": the data streams restart "
                        "(restart_data_on_dp_change).", "keep the data-parallel size to continue the "
                        "data where it stopped."))
    stored = stored_shapes("checkpoint", good / layout.TRANSFORMER)
    model = ctx.model_shapes
    differ = [f"{n} {stored[n]} vs model {s}" if n in stored else f"{n} not in the checkpoint"
              for n, s in model.items() if stored.get(n) != s]
    if differ:
        rows.append(Row("resume", "fail", f"{good.name} holds another architecture: "
                        + "; ".join(differ[:5]) + ".", "use the architecture of the run in output_dir, "
                        "or a new output_dir (warm start from that checkpoint if wanted)."))
    if not any(r.status == "fail" for r in rows):
        rows.append(Row("resume", "pass", f"resumes {good.name} (step {meta['step']}); "
                        + layout_text.split("; ")[1] + "."))
    return rows


# ================================================================================================
# Memory and step time (pan/estimate.py): what only the Pan recipe knows
# ================================================================================================

def pan_pack(job, task, clips, text_len: int, cp: int):
    """The PackInfo of clips (frames, H, W) with captions of `text_len` rows: whole, and this cp
    rank's share (rank 0, which holds the most rows)."""
    from pan.models.packing import PackInfo
    grids = []
    for frames, height, width in clips:
        _, t, h, w = task.geometry.latent_shape(frames, height, width)
        pt, ph, pw = job.model.transformer_config_overrides.patch_size
        grids.append((t // pt, h // ph, w // pw))
    whole = PackInfo.build(grids, [text_len] * len(clips))
    return whole, (whole.shard(0, cp) if cp > 1 else whole)


@register_probe("pan")
def pan_probe(ctx: Preflight) -> Probe:
    """The Pan recipe's largest micro-batch: the data budget's fullest pack of its largest clips,
    each caption at text_encoder_max_length rows; one phase (the transformer's loss)."""
    from pan.encoders.text import frozen_dtype, resolve_text_encoder_path
    from pan.recipes.pan import ModelInputs

    job, task, cp = ctx.job, ctx.task, ctx.dims.cp
    arch = job.model.transformer_config_overrides
    clips = largest_batch(job.data, task.tokens_of, images=bool(job.data.image_tar_paths))
    if not clips:
        raise ConfigError("max_tokens_per_batch", "no clip of the buckets and frame rules fits the "
                          "token budget (see the batch row).")
    whole, pack = pan_pack(job, task, clips, job.text_encoder.text_encoder_max_length, cp)

    def loss(models):
        nv, nt = pack.num_video_tokens, pack.num_text_tokens
        out = arch.out_channels * arch.patch_volume
        inputs = ModelInputs(x=torch.empty(nv, arch.in_channels * arch.patch_volume),
                             target=torch.empty(nv, out), weight=torch.empty(nv),
                             timesteps=torch.empty(whole.num_samples), text=torch.empty(nt, arch.text_embed_dim),
                             pack=pack, sample_ids=[], samples=whole.num_samples,
                             tokens=whole.num_video_tokens, packing=1.0, bad_samples=0)
        return task.loss_sum(models["transformer"], inputs)

    dtype = frozen_dtype(run_device())
    frozen = {"text encoder": hf_model_bytes(resolve_text_encoder_path(job.text_encoder.text_encoder_path), dtype),
              "vae": frozen_vae_bytes(job.vae, dtype)}
    shapes = ", ".join(f"{f}x{h}x{w}" for f, h, w in sorted(set(clips), reverse=True))
    return Probe([Phase("transformer", loss)], tokens=whole.num_video_tokens // cp,
                 samples=len(clips), flops=ctx.model.flops_per_step(whole) / cp, frozen=frozen,
                 loader=loader_bytes(job.data, clips), online_text=True,
                 describe=f"{len(clips)} clip(s) ({shapes}, frames x H x W) = {whole.num_video_tokens} "
                          f"video + {whole.num_text_tokens} caption tokens per data-parallel rank")


def check_memory(ctx: Preflight) -> list[Row]:
    """The estimated peak memory of one device against what it offers (pan/estimate.py); when it
    does not fit, the single changes of keys that make it fit, cheapest first."""
    est = ctx.estimate
    top = sorted(est.device.items(), key=lambda kv: -kv[1])[:4]
    detail = (f"~{_gib(est.total)} per device of {_gib(est.capacity)} ({est.capacity_source}) for "
              f"{est.batch}; most: " + ", ".join(f"{k} {_gib(v)}" for k, v in top)
              + " (pan check --explain-memory for all)")
    if est.fits:
        return [Row("memory", "pass", detail + ".")]
    changes = ctx.fitting_changes
    fix = ("; or ".join(f"{c.text} (~{_gib(c.estimate.total)}, {c.estimate.tokens_per_second:,.0f} tok/s)"
                        for c in changes) if changes else
           "no single change of activation checkpointing, cp_size, hybrid_shard or max_tokens_per_batch "
           "fits: use a smaller model or devices with more memory")
    return [Row("memory", "fail", detail + ": it does not fit.", fix + ".")]


def check_step_time(ctx: Preflight) -> list[Row]:
    """Estimated step time, throughput, and the wall time and GPU-hours of the whole run."""
    est = ctx.estimate
    parts = ", ".join(f"{k} {v:.3g} s" for k, v in est.time_parts.items() if v > 0)
    steps = ctx.job.trainer.max_steps
    return [Row("step time", "pass", f"~{est.step_time:.3g} s per step ({parts}); "
                f"{est.tokens_per_second:,.0f} tokens/s on {ctx.world_size} device(s); {steps} steps ~ "
                f"{est.run_hours:,.2f} h wall, {est.gpu_hours:,.1f} device-hours; MFU ~{100 * est.mfu:.0f}% "
                f"of the device peak. Rates {est.rates.source}.")]


def format_memory(est) -> str:
    """`pan check --explain-memory`: the breakdown of one device's estimated peak."""
    width = max(len(k) for k in [*est.device, *est.host, "category"])
    lines = [f"{'category':<{width}} | {'per device':>12}", f"{'-' * width}-+-{'-' * 12}"]
    lines += [f"{k:<{width}} | {_gib(v):>12}" for k, v in est.device.items()]
    lines.append(f"{'total':<{width}} | {_gib(est.total):>12}   of {_gib(est.capacity)} ({est.capacity_source})")
    if torch.cuda.is_available():
        lines += [f"{k + ' (host)':<{width}} | {_gib(v):>12}" for k, v in est.host.items()]
    lines.append(f"micro-batch: {est.batch}")
    return "\n".join(lines)


register_check("pan")(check_memory)
register_check("pan")(check_step_time)


# ================================================================================================
# The command
# ================================================================================================

def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="pan check", allow_abbrev=False,
        description="Preflight: validate a config, its data, weights, output_dir and this machine "
                    "for a planned layout, without training. Exit 0: ok (warnings allowed); 1: a "
                    "check failed; 2: the config does not load.",
        usage="pan check --config config/X.yaml [--key value ...] [--nodes N] [--gpus-per-node G] "
              "[--explain-memory] [--json] [--device-memory GIB]")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the planned run (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="processes per node (default: the GPUs visible here, or 1)")
    parser.add_argument("--sample-rows", type=int, default=DEFAULT_SAMPLE_ROWS,
                        help=f"samples decoded per data source (default {DEFAULT_SAMPLE_ROWS})")
    parser.add_argument("--explain-memory", action="store_true",
                        help="also print the estimated memory of one device by category")
    parser.add_argument("--json", action="store_true",
                        help="print every row and the memory / step-time estimate as JSON instead")
    parser.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                        help="memory of one device in GiB to plan for (default: this machine's GPU, or "
                             "its available host memory shared by the node's processes)")
    args, rest = parser.parse_known_args(argv)
    if args.gpus_per_node is None:
        args.gpus_per_node = max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1
    for name in ("nodes", "gpus_per_node", "sample_rows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.device_memory is not None and args.device_memory <= 0:
        parser.error("--device-memory must be > 0 (GiB)")
    return args, rest


def main_check(argv: list[str]) -> int:
    """`pan check`: print the preflight table; the exit code says whether to launch."""
    args, rest = parse_args(argv)
    try:
        job = load_job_config(rest, warn=lambda msg: print(f"pan check: {msg}", file=sys.stderr))
    except ConfigError as e:
        ctx = Preflight(None, args.nodes, args.gpus_per_node, args.sample_rows)
        rows = [Row("config", "fail", str(e), "fix the keys named; every problem found is listed.")]
        report(rows + run_preflight(ctx), None, args)
        return EXIT_CONFIG_ERROR
    ctx = Preflight(job, args.nodes, args.gpus_per_node, args.sample_rows, device_memory=args.device_memory)
    rows = [Row("config", "pass", f"loads: recipe {job.recipe}, {len(job.explicit_keys)} keys set "
                "to non-default values.")]
    rows += run_preflight(ctx)
    report(rows, ctx, args)
    return EXIT_FAILED if any(r.status == "fail" for r in rows) else EXIT_OK


def report(rows: list[Row], ctx: Preflight | None, args: argparse.Namespace) -> None:
    """The table (and with --explain-memory the memory breakdown), or with --json all of it."""
    estimate = ctx.__dict__.get("estimate") if ctx is not None else None  # only if a check made it
    if args.json:
        out = {"rows": [dataclasses.asdict(r) for r in rows],
               "exit_code": EXIT_FAILED if any(r.status == "fail" for r in rows) else EXIT_OK}
        if estimate is not None:
            out["estimate"] = estimate.to_json()
            out["fitting_changes"] = [{"keys": c.keys, "estimate": c.estimate.to_json()}
                                      for c in ctx.__dict__.get("fitting_changes", [])]
        print(json.dumps(out, indent=2, default=str))
        return
    print(format_table(rows, width=shutil.get_terminal_size((100, 20)).columns))
    if args.explain_memory:
        print()
        print(format_memory(estimate) if estimate is not None else
              "no memory estimate: the memory row did not run (see the table).")


if __name__ == "__main__":
    sys.exit(main_check(sys.argv[1:]))
