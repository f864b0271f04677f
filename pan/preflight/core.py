"""The preflight's framework: the rows of `pan check`'s table, the context every check reads, and
running the checks: the environment's (every recipe, even when the config does not load), then the
recipe's own list (its `checks` hook, pan/recipe.py), in the order it declares.

A check takes the `Preflight` and returns rows of `check | pass/warn/fail | detail`; a failed row
says how to fix it, a ConfigError it raises becomes one failed row per problem, any other exception
a row saying which check crashed. Checks read files and metadata only: the model is built on the
meta device, and no process group is started.

Three commands run the table: `pan check` (pan/preflight/command.py), train.py before anything is
built (`refuse_at_start`) and `pan launch-command` for the layout it prints (`job_rows`). The run
checks recipes list are in pan/preflight/checks.py.
"""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from pan.checkpoint.manager import first_problem
from pan.config import ConfigError
from pan.config.core import split_fix
from pan.estimate import estimate_run, fitting_changes
from pan.logging import get_logger
from pan.lora.adapters import add_adapters, base_names
from pan.parallel.dims import ParallelDims
from pan.parallel.world import planned_task
from pan.recipe import get_recipe
from pan.runtime import metrics

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
            said, slower = bf16_on_this_cpu()
            detail += f" dtype is bf16, whose matmuls {said}."
            if slower:
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


def bf16_on_this_cpu() -> tuple[str, bool]:
    """How bf16 matmuls compare with fp32 on this CPU, measured (a timed matmul of each, as the
    step-time estimate's peak: `pan.runtime.metrics.matmul_rate`): the words, and whether bf16 is
    the slower. It differs by machine: tens of times slower without bf16 instructions (AVX2), several
    times faster with AMX."""
    cpu = torch.device("cpu")
    bf16, fp32 = metrics.matmul_rate(cpu, "bf16"), metrics.matmul_rate(cpu, "fp32")
    measured = (f"(measured here on {torch.get_num_threads()} thread(s): bf16 {bf16 / 1e9:,.1f} GFLOP/s, "
                f"fp32 {fp32 / 1e9:,.1f} GFLOP/s)")
    if bf16 < fp32 / 1.1:
        return f"ran {fp32 / bf16:,.1f}x slower than fp32 on this CPU {measured}", True
    if bf16 > fp32 * 1.1:
        return f"ran {bf16 / fp32:,.1f}x faster than fp32 on this CPU {measured}", False
    return f"ran about as fast as fp32 on this CPU {measured}", False


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
