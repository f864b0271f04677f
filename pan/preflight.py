"""`pan check`: everything that can stop a run, checked before any process group or weight exists.

    pan check --config config/X.yaml [--key value ...] [--nodes N] [--gpus-per-node G]

The preflight loads the config (every ConfigError of the loader), then runs a list of small checks,
each returning rows of `check | pass/warn/fail | detail`; a failed row says how to fix it. Checks
read files and metadata only: the model is built on the meta device, checkpoints and state dicts are
compared by their recorded shapes, media are decoded with the data pipeline's own functions. Nothing
is trained and no process group is started.

Exit codes: 0 when nothing failed (warnings allowed), 1 when a check failed, 2 when the config does not
load at all (the loader's error is then the only config row; fix it and run again to see the rest).

The environment checks (`ENVIRONMENT_CHECKS`) run for every recipe, even when the config does not
load; then the recipe's own list (its `checks` hook, pan/recipe.py), in the order it declares. This
module also holds the run checks any recipe may list (layout, cpu, output dir, resume of every part,
memory, step time); what only one recipe knows lives in that recipe's package.
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
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from pan.checkpoint import dcp as layout
from pan.checkpoint.manager import first_problem
from pan.checkpoint.warm_start import ShapeDiff, part_folder, resolve_source
from pan.config import ConfigError, load_job_config
from pan.config.core import split_fix
from pan.data.sources import AnnotationSource, scan_annotations
from pan.estimate import FP32_BYTES, estimate_run, fitting_changes, probe_of, state_bytes
from pan.logging import get_logger
from pan.lora.adapters import LORA_KEY, add_adapters, base_names, reference_differences
from pan.parallel.dims import ParallelDims
from pan.parallel.fsdp import FULL_INIT_MAX_PARAMS
from pan.parallel.names import unwrapped_name
from pan.parallel.threads import omp_num_threads
from pan.parallel.world import planned_task
from pan.recipe import get_recipe

Status = Literal["pass", "warn", "fail"]
EXIT_OK, EXIT_FAILED, EXIT_CONFIG_ERROR = 0, 1, 2
DEFAULT_SAMPLE_ROWS = 4


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
    at_start: bool = False      # run by train.py on the world it was launched in (`refuse_at_start`)
    previous_stage: object = None   # `pan launch-command --stage both`: the job of the stage run before this one
    elsewhere: bool = False     # planned for other machines (`pan launch-command`): see `check_memory`

    def with_job(self, job) -> Preflight:
        """The same planned layout for another job (a suggested change of keys)."""
        return Preflight(job, self.nodes, self.gpus_per_node, self.sample_rows, device_memory=self.device_memory,
                         at_start=self.at_start, previous_stage=self.previous_stage, elsewhere=self.elsewhere)

    @functools.cached_property
    def estimate(self):
        """Memory per device and step time of the job on this layout (pan/estimate/)."""
        return estimate_run(self, self.device_memory)

    @functools.cached_property
    def fitting_changes(self) -> list:
        """Single changes of keys that make a run that does not fit fit, cheapest first."""
        return [] if self.estimate.fits else fitting_changes(self, self.estimate, self.with_job)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @functools.cached_property
    def dims(self):
        """ParallelDims of the planned world; raises ConfigError for an impossible layout."""
        return ParallelDims.from_config(self.job.parallel, self.world_size, self.gpus_per_node)

    @functools.cached_property
    def task(self):
        """The recipe's task as rank 0 of the planned world builds it (nothing heavy is loaded), built
        once: every check and probe uses this one."""
        return planned_task(self.job, self.dims)

    @functools.cached_property
    def part_specs(self) -> list:
        return self.task.part_specs()

    @functools.cached_property
    def models(self) -> dict[str, torch.nn.Module]:
        """The recipe's parts on the meta device (shapes only, no memory), as the trainer builds them:
        a LoRA part (`spec.lora`) with its adapters injected, its base frozen at the base's dtype
        (`pan.lora.adapters.add_adapters`; meta tensors have no fingerprint). The task is made first,
        outside the meta device: its constructor may compute real values."""
        specs = self.part_specs
        trainer = self.job.trainer
        models = {}
        with torch.device("meta"):
            for spec in specs:
                model = spec.build()
                if spec.lora is not None:
                    add_adapters(model, spec.lora, trainer.seed, trainer.dtype, None)
                models[spec.name] = model
        return models

    @property
    def model(self) -> torch.nn.Module:
        """The main part's model on the meta device."""
        return next(iter(self.models.values()))

    @functools.cached_property
    def model_shapes(self) -> dict[str, tuple[int, ...]]:
        """The main part's tensor shapes under the plain model's names (a LoRA part's base: what
        warm-start sources and released folders hold)."""
        return {k: tuple(v.shape) for k, v in base_names(self.model.state_dict()).items()}


Check = Callable[[Preflight], list[Row]]


def spread_rows(count: int, size: int) -> list[int]:
    """`count` row numbers spread over a source of `size` rows: the first, the last, and between
    (what the data rows of every recipe decode to judge a source)."""
    n = min(count, size)
    return sorted({round(i * (size - 1) / max(n - 1, 1)) for i in range(n)})


def with_annotation_scan(row: Row, source: AnnotationSource) -> Row:
    """A source's data row with every row of the annotation file parsed and its files looked up
    (cheap: nothing is decoded): a warning naming the rows training would skip, a failure when it
    would skip them all."""
    scan = scan_annotations(source)
    if not scan.bad:
        return row
    scanned = "Every row parsed" if scan.rows == scan.total else f"{scan.rows} of its {scan.total} rows parsed"
    detail = (row.detail.rstrip(".") + f". {scanned}: {scan.bad} of {scan.rows} would be skipped in "
              f"training: {scan.summary()}.")
    if scan.bad == scan.rows or row.status == "fail":
        return Row("data", "fail", detail, "an annotation file holds one JSON object per line, "
                   "{\"video\": \"clips/x.mp4\", \"text\": \"a caption\"}, paths relative to the file "
                   "(docs/data.md): fix the rows or the paths.")
    return Row("data", "warn", detail, "fix or remove those rows: training skips them.")



def check_name(fn: Check) -> str:
    return fn.__name__.removeprefix("check_").replace("_", " ")


def config_rows(check: str, error: ConfigError) -> list[Row]:
    """One failed row per problem of a ConfigError: the key, what is wrong, and its fix apart."""
    rows = []
    for problem in error.problems():
        detail, fix = split_fix(problem)
        rows.append(Row(check, "fail", detail, fix))
    return rows


def crash_row(check: str, error: Exception) -> Row:
    """A check that raised something else than a ConfigError: which check, what, and where."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else None
    return Row(check, "fail", f"the `{check}` check crashed with {type(error).__name__}: {error}"
               + (f" (in {where})" if where else "") + ".",
               f"no known refusal covers this: look at the keys the `{check}` row reads (docs/preflight.md, "
               "\"What is checked\"); if they look right, report this row as a bug of the check.")


def run_check(fn: Check, ctx: Preflight) -> list[Row]:
    """A check's rows; a ConfigError it raises becomes one failed row per problem (key, detail,
    fix), any other exception a row saying which check crashed, so one broken check never hides
    the others."""
    try:
        return fn(ctx)
    except ConfigError as e:
        return config_rows(check_name(fn), e)
    except Exception as e:  # noqa: BLE001 - report it as a row and keep checking
        return [crash_row(check_name(fn), e)]


def recipe_checks(recipe: str) -> list[Check]:
    """The checks a recipe declares (its `checks` hook), in table order."""
    return list(get_recipe(recipe).hook("checks") or [])


def run_preflight(ctx: Preflight) -> list[Row]:
    """Rows of the environment checks, then of the job's recipe checks (when the job loaded)."""
    rows = [row for fn in ENVIRONMENT_CHECKS for row in run_check(fn, ctx)]
    if ctx.job is not None:
        rows += [row for fn in recipe_checks(ctx.job.recipe) for row in run_check(fn, ctx)]
    return said_once(rows)


def job_rows(ctx: Preflight) -> list[Row]:
    """The job's own rows (its recipe's checks), without the environment's: what `pan
    launch-command` runs for a layout it prints the commands of, on a machine that is not the one
    they run on."""
    return said_once([row for fn in recipe_checks(ctx.job.recipe) for row in run_check(fn, ctx)])


class StartRefused(ConfigError):
    """train.py's refusal of a launch that `pan check` fails: the failed rows, each with its fix (a
    ConfigError, so the trainer refuses it as it refuses a config: exit 2)."""

    def __init__(self, text: str):
        super().__init__(None, text)


def one_line(text: str) -> str:
    """A row's lines (one problem each) on one log line."""
    return text.replace(":\n", ": ").replace("\n", "; ")


def format_refusal(failed: list[Row]) -> str:
    """The failed rows as train.py prints them: one problem a line, its fix below it."""
    plural = "s" if len(failed) > 1 else ""
    lines = [f"`pan check` fails for this launch ({len(failed)} problem{plural}; nothing was built or written):"]
    for r in failed:
        lines += [f"  {r.check}: {line}" for line in r.detail.splitlines()]
        lines += [f"    fix: {line}" for line in r.fix.splitlines()]
    return "\n".join(lines)


def start_rows(job, world) -> list[Row]:
    """`pan check`'s rows for the world a launch runs in (its nodes x processes per node), as
    train.py runs them before it takes the lease, writes config.yaml or builds a model. Every row of
    `pan check` runs: what it refuses, the launch refuses; the environment rows see the devices of
    rank 0's node (those of the other nodes are checked by `init_world` on each)."""
    return run_preflight(Preflight(job, ctx_nodes(world), world.local_size, at_start=True))


def ctx_nodes(world) -> int:
    return max(world.size // max(world.local_size, 1), 1)


def refuse_at_start(job, world) -> None:
    """Rank 0 runs `start_rows`; its warnings go to the log; when a row fails, every rank raises
    StartRefused with the failed rows (train() exits 2, rank 0 printing them)."""
    log, problem = get_logger(), None
    if world.rank == 0:
        t0 = time.perf_counter()
        try:
            rows = start_rows(job, world)
        except Exception as e:  # noqa: BLE001 - every check is guarded; this is the table itself
            rows = [crash_row("pan check", e)]  # said like any check's crash, and the other ranks are told
        counts = {s: sum(r.status == s for r in rows) for s in ("pass", "warn", "fail")}
        log.info("pan check's %d rows for this launch (%d x %d processes): %d passed, %d warnings, %d "
                 "failed (%.1f s)", len(rows), ctx_nodes(world), world.local_size, counts["pass"],
                 counts["warn"], counts["fail"], time.perf_counter() - t0)
        for r in rows:
            if r.status == "warn":
                log.warning("pan check, %s: %s (fix: %s)", r.check, one_line(r.detail), one_line(r.fix))
        failed = [r for r in rows if r.status == "fail"]
        if failed:
            problem = format_refusal(failed)
    problem = first_problem(problem)  # every rank learns rank 0's verdict
    if problem is not None:
        raise StartRefused(problem)


def said_once(rows: list[Row]) -> list[Row]:
    """A failure that several checks run into (an impossible layout stops the checks that need it)
    is printed in full once; the later rows point to it."""
    first: dict[str, str] = {}
    for row in rows:
        if row.status != "fail":
            continue
        # The same words, or a row that itself names an earlier failed row as its cause ("... (see
        # the batch row)"): the same problem in another wording.
        cause = next((check for check in first.values()
                      if f"see the {check} row" in row.detail or f"see the `{check}` row" in row.detail), None)
        if row.detail in first or cause is not None:
            cause = cause or first[row.detail]
            row.detail, row.fix = f"the same problem as the `{cause}` row above.", "see there."
        else:
            first[row.detail] = row.check
    return rows


def format_table(rows: list[Row], width: int = 100) -> str:
    """check | status | detail, wrapped; a warning's or failure's fix on a `fix:` line below it."""
    name_w = max([len("check")] + [len(r.check) for r in rows])
    text_w = max(40, width - name_w - 10)
    lines = [f"{'check':<{name_w}} | status | detail", f"{'-' * name_w}-+--------+-{'-' * text_w}"]
    for r in rows:
        # A detail or fix of several problems holds one a line ("\n"): each is wrapped by itself.
        body = [w for line in r.detail.splitlines() for w in textwrap.wrap(line, text_w)] or [""]
        if r.fix and r.status != "pass":
            body += [w for line in ("fix: " + r.fix).splitlines()
                     for w in textwrap.wrap(line, text_w)]
        lines.append(f"{r.check:<{name_w}} | {r.status:<6} | {body[0]}")
        lines += [f"{'':<{name_w}} | {'':<6} | {more}" for more in body[1:]]
    counts = {s: sum(r.status == s for r in rows) for s in ("pass", "warn", "fail")}
    lines.append(f"{counts['pass']} passed, {counts['warn']} warnings, {counts['fail']} failed")
    return "\n".join(lines)


# ================================================================================================
# Environment: devices and communication backend (every recipe)
# ================================================================================================

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


ENVIRONMENT_CHECKS: list[Check] = [check_devices, check_backend]


# ================================================================================================
# Run checks any recipe may list
# ================================================================================================

def check_layout(ctx: Preflight) -> list[Row]:
    """cp and data-parallel degrees for the planned world (the trainer's own ParallelDims), and what
    the recipe's task refuses for it (a context group across nodes, ...)."""
    d = ctx.dims
    ctx.task  # noqa: B018 - built here so that its layout refusal is this row's
    return [Row("layout", "pass", f"world {ctx.world_size} = dp_replicate {d.dp_replicate} x dp_shard "
                f"{d.dp_shard} x cp {d.cp}; {d.dp} data-parallel ranks.")]


def check_cpu(ctx: Preflight) -> list[Row]:
    """Cores of this machine against what one node's processes ask for: the training threads plus
    the decoding workers. Oversubscribed, the workers starve and the trainer waits for data
    (measured on a 2-core machine: data wait 1.7% with 1 thread + 1 worker, 18% with 2 + 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = getattr(getattr(ctx.job, "data", None), "packed_dataloader_num_workers", 0)  # none: no data section
    # torchrun sets OMP_NUM_THREADS=1 for several processes per node unless it is set already.
    threads = omp_num_threads() or (1 if ctx.gpus_per_node > 1 else torch.get_num_threads())
    wanted = ctx.gpus_per_node * (threads + workers)
    detail = (f"{ctx.gpus_per_node} process(es) per node x ({threads} training thread(s) + {workers} "
              f"decoding worker(s)) = {wanted} busy processes/threads; {cores} cores here")
    if workers and wanted > cores:
        return [Row("cpu", "warn", detail + ": the decoding workers will compete with training for "
                    "cores, and the trainer will wait for data.",
                    f"lower OMP_NUM_THREADS or packed_dataloader_num_workers so that they fit {cores} "
                    "cores (this counts the machine pan check runs on).")]
    return [Row("cpu", "pass", detail + ".")]


def stored_shapes(kind: str, path: Path, part: str = layout.TRANSFORMER) -> dict[str, tuple[int, ...]]:
    """name -> shape of a warm-start source (of `part` for a checkpoint), read from headers and
    metadata (no tensor data is read)."""
    if kind == "checkpoint":
        folder = part_folder(path, part) or path
        return {k: tuple(size) for k, (size, _) in layout.dcp_tensor_shapes(folder).items()}
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:
            return {unwrapped_name(k): tuple(f.get_slice(k).get_shape())
                    for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    # mmap: tensors stay on disk; only their headers are read.
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError("pretrained_transformer_path", f"{path} is not a flat state dict of tensors; "
                          "save model.state_dict() itself, or export a checkpoint with `pan export`.")
    return {unwrapped_name(k): tuple(v.shape) for k, v in state.items()}


def checkpoint_bytes(ctx: Preflight) -> tuple[int, str]:
    """Size of one checkpoint of every part estimated from the parameter counts (`state_bytes`), and
    how it was derived. A LoRA part's checkpoint holds its adapters and their states only (its
    frozen base is loaded from its source on every launch). Data cursors, RNG and schedule are
    kilobytes."""
    state: dict[str, int] = {}
    for spec in ctx.part_specs:
        for kind, size in state_bytes(ctx.models[spec.name], spec.optim.optim()).items():
            if kind == "frozen" and spec.lora is not None:
                continue
            state[kind] = state.get(kind, 0) + size
    total, muon = state["weights"] // FP32_BYTES, state["muon"] // FP32_BYTES
    adamw = state["adamw"] // (2 * FP32_BYTES)
    lora = any(spec.lora is not None for spec in ctx.part_specs)
    how = (f"{total / 1e6:,.1f}M {'adapter ' if lora else ''}params x 4 B (fp32 weights) + "
           f"{muon / 1e6:,.1f}M Muon x 4 B + {adamw / 1e6:,.1f}M AdamW x 8 B" + (" + 4 B EMA" if state["ema"] else "")
           + (f" + {_gib(state['frozen'])} frozen" if state.get("frozen") else "")
           + ("; the frozen LoRA base is not saved" if lora else ""))
    return sum(state.values()), how


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def check_output_dir(ctx: Preflight) -> list[Row]:
    """output_dir can be created and written, with room for two checkpoints."""
    out = Path(ctx.job.checkpoint.output_dir)
    base = _existing_ancestor(out)
    if not base.is_dir():
        what = "is a file" if base == out.absolute() else f"lies under {base}, which is a file"
        raise ConfigError("output_dir", f"{out} {what}: a run writes a folder of checkpoints there.",
                          fix="choose a folder (a new or existing directory) for output_dir.")
    try:
        with tempfile.NamedTemporaryFile(dir=base, prefix=".pan-check-"):
            pass
    except OSError as e:
        return [Row("output dir", "fail", f"`output_dir`: {out} cannot be written ({type(e).__name__}: "
                    f"{e.strerror or e}).", "point output_dir at a writable directory on shared storage.")]
    size, how = checkpoint_bytes(ctx)
    free = shutil.disk_usage(base).free
    detail = (f"{out} writable; one checkpoint ~ {_gib(size)} ({how}); {_gib(free)} free on "
              f"{base}")
    if free < 2 * size:
        return [Row("output dir", "fail", detail + f", less than two checkpoints ({_gib(2 * size)}).",
                    "free space, or use a larger file system: a save needs room for the new "
                    "checkpoint next to the previous one.")]
    limit = ctx.job.checkpoint.save_total_limit
    saves = -(-ctx.job.trainer.max_steps // ctx.job.checkpoint.save_interval)  # the last step's included
    kept = saves if limit is None else min(limit, saves)   # a short run never reaches its limit
    if free < (kept + 1) * size:
        kept_text = (f"every checkpoint is kept ({saves} in {ctx.job.trainer.max_steps} steps)" if limit is None
                     else f"save_total_limit {limit} keeps {limit}")
        return [Row("output dir", "warn", detail + f"; {kept_text}, plus one being written.",
                    "set save_total_limit so that (limit + 1) checkpoints fit.")]
    return [Row("output dir", "pass", detail + f"; room for the {kept} checkpoint(s) kept, plus one being written.")]


def latest_checkpoint(ctx: Preflight) -> Path | None:
    complete = layout.complete_checkpoints(Path(ctx.job.checkpoint.output_dir))
    return complete[-1] if complete else None


def check_warm_start(ctx: Preflight) -> list[Row]:
    """The warm-start weights (`pretrained_transformer_path`) exist and every tensor has the model's
    shape; for a recipe with these keys (Pan, both Pyramid-Flow recipes)."""
    cfg = ctx.job.warm_start
    if not cfg.load_transformer_weights:
        spec = ctx.part_specs[0]   # the main part: where it starts without a warm start
        start = f"its pretrained weights ({spec.pretrained_from})" if spec.pretrained_from else "its init"
        return [Row("warm start", "pass", f"none: the model starts from {start}.")]
    resume = latest_checkpoint(ctx)
    if resume is not None:
        return [Row("warm start", "pass", f"not used: output_dir has {resume.name}, which the run "
                    "resumes instead.")]
    kind, path = resolve_source(cfg.pretrained_transformer_path)
    model = ctx.model_shapes
    diff = ShapeDiff.of(stored_shapes(kind, path), model)
    mismatched = [f"{n} {a} vs model {b}" for n, a, b in diff.mismatched]
    missing, loaded = diff.missing, len(diff.matching)
    summary = (f"{path} ({kind}): {loaded}/{len(model)} model tensors match, {len(mismatched)} "
               f"have another shape, {len(missing)} missing")
    if mismatched or loaded == 0:
        return [Row("warm start", "fail", summary + ". " + "; ".join(mismatched[:5]),
                    "point pretrained_transformer_path at weights of this architecture, or set the "
                    "model keys (transformer_config_overrides, or model_name and model_path) to theirs.")]
    if missing:
        return [Row("warm start", "warn", summary + f" (kept at init): {', '.join(missing[:5])}.",
                    "expected only when the architecture grew on purpose.")]
    return [Row("warm start", "pass", summary + ".")]


def check_resume(ctx: Preflight) -> list[Row]:
    """The checkpoints already in output_dir: readable, same data-parallel size, every part of the
    same shapes."""
    out = Path(ctx.job.checkpoint.output_dir)
    complete = layout.complete_checkpoints(out)
    if not complete:
        return [Row("resume", "pass", f"no checkpoint in {out}: the run starts fresh.")]
    readable = [(p, layout.verify_checkpoint(p)) for p in reversed(complete)]
    good = next((p for p, problem in readable if problem is None), None)
    bad = [f"{p.name}: {problem}" for p, problem in readable if problem is not None]
    if good is None:
        # The trainer's own words (UnreadableRunError), should its resume get there first.
        return [Row("resume", "fail", f"{out} has checkpoints but none is readable ({'; '.join(bad)}). "
                    "Starting from scratch would overwrite this run.", "repair them, or move them out of "
                    "output_dir to start fresh.")]
    meta = layout.read_json(good / layout.META)
    rows = []
    if bad:
        rows.append(Row("resume", "warn", f"unreadable, skipped on resume: {'; '.join(bad)}.",
                        "delete or repair them."))
    dp = ctx.dims.dp
    restart = getattr(getattr(ctx.job, "data", None), "restart_data_on_dp_change", False)
    layout_text = (f"{good.name} was written by {meta['dp_size']} data-parallel ranks (world "
                   f"{meta['world_size']}, cp {meta['cp_size']}); this layout has {dp}")
    # A checkpoint keeps one cursor per data shard (Task.data_shards); with the same shard count
    # each continues exactly on any layout.
    old_shards = meta.get("data_shards", meta["dp_size"])
    new_shards = ctx.task.data_shards()
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
    lora_problems = lora_resume_problems(ctx, meta)
    if lora_problems:
        rows.append(Row("resume", "fail", f"{good.name}: " + "; ".join(lora_problems) + ".",
                        "resume with the LoRA keys and base of the run in output_dir, or use a new "
                        "output_dir (warm start from that checkpoint if wanted)."))
        return rows
    differ = []
    lora = {spec.name for spec in ctx.part_specs if spec.lora is not None}
    for part, model in ctx.models.items():
        # A LoRA part's checkpoint holds its adapters only (pan/checkpoint/manager.py): its frozen
        # base, buffers included, is not compared.
        diff = ShapeDiff.of(stored_shapes("checkpoint", good / part, part),
                            {k: v.shape for k, v in model.state_dict().items()
                             if part not in lora or LORA_KEY.search(k)})
        named = f"{part}: " if len(ctx.models) > 1 else ""
        differ += [named + line for line in diff.lines(missing="not in the checkpoint")]
    if differ:
        rows.append(Row("resume", "fail", f"{good.name} holds another architecture: "
                        + "; ".join(differ[:5]) + ".", "use the architecture of the run in output_dir, "
                        "or a new output_dir (warm start from that checkpoint if wanted)."))
    if not any(r.status == "fail" for r in rows):
        rows.append(Row("resume", "pass", f"resumes {good.name} (step {meta['step']}); "
                        + layout_text.split("; ")[1] + "."))
    return rows


def lora_resume_problems(ctx: Preflight, meta: dict) -> list[str]:
    """How this run's LoRA keys differ from those of the checkpoint's run, part by part (what the
    checkpoint manager refuses at resume; the base's fingerprint is compared there, once it is
    loaded)."""
    saved = meta.get("lora", {})
    problems = []
    for spec in ctx.part_specs:
        was, now = saved.get(spec.name), spec.lora
        if was is None and now is None:
            continue
        if was is None or now is None:
            problems.append(f"{spec.name} was trained {'with LoRA' if was else 'fully'} and this run trains "
                            f"it {'with LoRA' if now else 'fully'} (lora_rank {now.lora_rank if now else 0})")
            continue
        adapted = sorted({key[:LORA_KEY.search(key).start()] for key in ctx.models[spec.name].state_dict()
                          if LORA_KEY.search(key)})
        current = {"rank": now.lora_rank, "alpha": now.lora_alpha or now.lora_rank, "init": now.lora_init,
                   "targets": adapted}
        problems += [f"{spec.name} {line}" for line in reference_differences(was, current)]
    return problems


# ================================================================================================
# Memory and step time (pan/estimate/, from the recipe's probe)
# ================================================================================================

def not_estimated(check: str, ctx: Preflight) -> Row:
    return Row(check, "warn", f"not estimated: the {ctx.job.recipe} recipe declares no probe of its "
               "largest micro-batch.", "give its Recipe a `probe` hook (docs/adding_a_recipe.md).")


def check_memory(ctx: Preflight) -> list[Row]:
    """The estimated peak memory of one device against what it offers (pan/estimate/); when it
    does not fit, the single changes of keys that make it fit, cheapest first."""
    too_large = lora_base_too_large(ctx)
    if too_large:
        return [Row("memory", "fail", too_large, "train it fully (lora_rank: 0), or with LoRA in one process "
                    "(--nodes 1 --gpus-per-node 1).")]
    if probe_of(ctx.job.recipe) is None:
        return [not_estimated("memory", ctx)]
    est = ctx.estimate
    top = sorted(est.device.items(), key=lambda kv: -kv[1])[:4]
    detail = (f"~{_gib(est.total)} per device of {_gib(est.capacity)} ({est.capacity_source}) for "
              f"{est.batch}; most: " + ", ".join(f"{k} {_gib(v)}" for k, v in top)
              + " (pan check --explain-memory for all)")
    if est.fits:
        return [Row("memory", "pass", detail + ".")]
    if ctx.elsewhere and ctx.device_memory is None and not torch.cuda.is_available():
        # Planned for other machines from one without a GPU: this machine's host memory says nothing of theirs.
        return [Row("memory", "warn", detail + ": it does not fit this machine, which has no GPU.",
                    "pass --device-memory GIB, the memory of one GPU the job runs on, to check it for them.")]
    changes = ctx.fitting_changes
    fix = ("; or ".join(f"{c.text} (~{_gib(c.estimate.total)}, {c.estimate.tokens_per_second:,.0f} tok/s)"
                        for c in changes) if changes else
           "no single change of activation checkpointing, cp_size, hybrid_shard, lora_rank (where the "
           "recipe has LoRA) or max_tokens_per_batch fits: use a smaller model or devices with more memory")
    return [Row("memory", "fail", detail + ": it does not fit.", fix + ".")]


def lora_base_too_large(ctx: Preflight) -> str | None:
    """LoRA loads a part's frozen base whole on every rank before sharding (`pan.lora.runs.
    base_with_adapters`), which pan does for models of up to FULL_INIT_MAX_PARAMS; with several
    processes a larger one is initialised shard by shard and cannot take adapters."""
    if ctx.world_size == 1:
        return None
    for spec in ctx.part_specs:
        count = sum(p.numel() for name, p in ctx.models[spec.name].named_parameters() if not LORA_KEY.search(name))
        if spec.lora is not None and count > FULL_INIT_MAX_PARAMS:
            return (f"LoRA on {spec.name}: its base has {count / 1e9:.2f}B parameters; LoRA loads the base whole on "
                    f"every rank before sharding, which pan does for models of up to "
                    f"{FULL_INIT_MAX_PARAMS / 1e9:g}B parameters over {ctx.world_size} processes.")
    return None


def check_step_time(ctx: Preflight) -> list[Row]:
    """Estimated step time, throughput, and the wall time and GPU-hours of the whole run."""
    if probe_of(ctx.job.recipe) is None:
        return [not_estimated("step time", ctx)]
    est = ctx.estimate
    parts = ", ".join(f"{k} {v:.3g} s" for k, v in est.time_parts.items() if v > 0)
    steps = ctx.job.trainer.max_steps
    return [Row("step time", "pass", f"~{est.step_time:.3g} s per step ({parts}); "
                f"{est.tokens_per_second:,.0f} tokens/s on {ctx.world_size} device(s); {steps} steps ~ "
                f"{est.run_hours:,.2f} h wall, {est.gpu_hours:,.1f} device-hours; MFU ~{100 * est.mfu:.0f}% "
                f"of the device peak, for compute alone (the MFU training logs counts whole wall-clock "
                f"steps: data waits, the first steps' warm-up and Python overhead too). Rates {est.rates.source}.")]


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
        rows = config_rows("config", e)  # every problem found, one a row
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
