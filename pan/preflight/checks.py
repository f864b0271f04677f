"""The run checks any recipe may list in its `checks` hook (layout, cpu, output dir, warm start of
every part that declares one, resume of every part, memory, step time), and what the recipes' own
data rows share (`check_data`, `spread_rows`, `with_annotation_scan`, `unopened_row`, `source_sizes`;
the sources themselves are opened by `pan.data.reader.open_sources`). What only one recipe knows
lives in that recipe's package.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from pan.checkpoint import layout
from pan.checkpoint.warm_start import WarmStartConfig, part_folder, resolve_source
from pan.config import ConfigError
from pan.config.job import key_owners
from pan.data.plan import Ref
from pan.data.reader import OpenedSource, SampleReader, open_sources, rules_of
from pan.data.sources import AnnotationSource, scan_annotations
from pan.estimate import FP32_BYTES, probe_of, state_bytes
from pan.lora.adapters import LORA_KEY, base_names, reference_differences
from pan.models.state_dict import ShapeDiff
from pan.parallel.fsdp import FULL_INIT_MAX_PARAMS
from pan.parallel.names import unwrapped_name
from pan.parallel.threads import omp_num_threads
from pan.preflight.core import Preflight, Row

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
           + (f" + {gib(state['frozen'])} frozen" if state.get("frozen") else "")
           + ("; the frozen LoRA base is not saved" if lora else ""))
    return sum(state.values()), how


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def gib(n: float) -> str:
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
    detail = (f"{out} writable; one checkpoint ~ {gib(size)} ({how}); {gib(free)} free on "
              f"{base}")
    if free < 2 * size:
        return [Row("output dir", "fail", detail + f", less than two checkpoints ({gib(2 * size)}).",
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


def final_checkpoint(job) -> Path:
    """The checkpoint a run writes last: checkpoint-<max_steps> in its output_dir."""
    return Path(job.checkpoint.output_dir) / layout.checkpoint_name(job.trainer.max_steps)


def warm_start_keys(job) -> WarmStartConfig | None:
    """The job's `WarmStartConfig` component (pan's warm-start keys); None for a recipe that names
    its source otherwise (`Task.warm_start_source`)."""
    return next((value for value in (getattr(job, f.name) for f in dataclasses.fields(job))
                 if isinstance(value, WarmStartConfig)), None)


def key_value(job, key: str | None):
    """The value of one of the job's keys (None when it has no such key)."""
    owner = key_owners(type(job)).get(key) if key else None
    return None if owner is None else getattr(getattr(job, owner), key)


def check_warm_start(ctx: Preflight) -> list[Row]:
    """The source a fresh run's warm-start parts (`PartSpec.warm_start`) start from
    (`Task.warm_start_source()`: Pan's `pretrained_transformer_path`, the causal VAE's
    `warm_start_checkpoint`): every part it holds has the model's shapes (read from headers and
    metadata). Not used while output_dir holds a checkpoint (the run resumes it); not there yet for
    a stage chained after another that starts from what that stage writes last (`pan
    launch-command --stage both`)."""
    warm = [spec for spec in ctx.part_specs if spec.warm_start]
    try:
        source, refused = ctx.task.warm_start_source(), None
    except ConfigError as e:   # a source the recipe cannot use (unreadable, not its checkpoint): its key's value
        source, refused = key_value(ctx.job, e.key), e
    if not warm or (source is None and refused is None):
        spec = ctx.part_specs[0]   # the main part: where it starts without a warm start
        start = (f"its pretrained weights ({spec.pretrained_from})" if spec.pretrained_from else
                 "its pretrained weights" if spec.pretrained is not None else "its init")
        return [Row("warm start", "pass", f"none: the model starts from {start}.")]
    resume = latest_checkpoint(ctx)
    if resume is not None:
        return [Row("warm start", "pass", f"not used: output_dir has {resume.name}, which the run "
                    "resumes instead.")]
    previous = ctx.previous_stage
    if (previous is not None and source is not None
            and Path(source).resolve() == final_checkpoint(previous).resolve()):
        return [Row("warm start", "pass", f"{source}: the checkpoint the stage before this one writes last "
                    "(chained); this stage's start checks it again once it exists.")]
    if refused is not None:
        raise refused
    kind, path = resolve_source(source)
    return [warm_start_fit(ctx, warm, kind, path)]


def warm_start_fit(ctx: Preflight, warm: list, kind: str, path: Path) -> Row:
    """How the parts' tensors fit a resolved source, part by part (as the trainer loads it: a
    checkpoint's folder of each part, where a part it lacks keeps its init; a state dict into every
    part). Fails on a tensor of another shape or a part none of whose tensors it holds, warns on
    model tensors it lacks."""
    named = len(warm) > 1
    counts, fits, lacking, mismatched, missing, empty = [], [], [], [], [], False
    for spec in warm:
        if kind == "checkpoint" and part_folder(path, spec.name) is None:
            lacking.append(f"it holds no {spec.name}, which starts from its init")
            continue
        model = ctx.model_shapes if spec is ctx.part_specs[0] else \
            {k: tuple(v.shape) for k, v in base_names(ctx.models[spec.name].state_dict()).items()}
        diff = ShapeDiff.of(stored_shapes(kind, path, spec.name), model)
        prefix = f"{spec.name}: " if named else ""
        counts.append(f"{prefix}{len(diff.matching)}/{len(model)} model tensors match, {len(diff.mismatched)} "
                      f"have another shape, {len(diff.missing)} missing")
        fits.append(f"the {spec.name}'s {len(model)} tensors fit")
        mismatched += [f"{prefix}{n} {a} vs model {b}" for n, a, b in diff.mismatched]
        missing += [prefix + n for n in diff.missing]
        empty = empty or not diff.matching
    summary = f"{path} ({kind}): " + "; ".join(counts + lacking)
    if mismatched or empty or not counts:
        fix = ("point pretrained_transformer_path at weights of this architecture, or set the model keys "
               "(transformer_config_overrides, or model_name and model_path) to theirs."
               if warm_start_keys(ctx.job) is not None else
               "use the architecture keys of the run the warm start comes from in this config, or warm start "
               "from a run of this architecture.")
        return Row("warm start", "fail", summary + ". " + "; ".join(mismatched[:5]), fix)
    if missing:
        return Row("warm start", "warn", summary + f" (kept at init): {', '.join(missing[:5])}.",
                   "expected only when the architecture grew on purpose.")
    return Row("warm start", "pass", f"{path} ({kind}): " + "; ".join(fits + lacking) + ".")


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
    detail = (f"~{gib(est.total)} per device of {gib(est.capacity)} ({est.capacity_source}) for "
              f"{est.batch}; most: " + ", ".join(f"{k} {gib(v)}" for k, v in top)
              + " (pan check --explain-memory for all)")
    if est.fits:
        return [Row("memory", "pass", detail + ".")]
    if ctx.elsewhere and ctx.device_memory is None and not torch.cuda.is_available():
        # Planned for other machines from one without a GPU: this machine's host memory says nothing of theirs.
        return [Row("memory", "warn", detail + ": it does not fit this machine, which has no GPU.",
                    "pass --device-memory GIB, the memory of one GPU the job runs on, to check it for them.")]
    changes = ctx.fitting_changes
    fix = ("; or ".join(f"{c.text} (~{gib(c.estimate.total)}, {c.estimate.tokens_per_second:,.0f} tok/s)"
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
    peak = f"{est.peak_flops / 1e9:,.1f} GFLOP/s: {est.peak_source}"
    if est.mfu is None:   # (never printed above 100%: the time of the step's FLOPs is then wrong)
        mfu = (f"no MFU: the estimate runs the step's FLOPs faster than the device's peak ({peak}), so the "
               "step time is unreliable (likely too short)")
    else:
        mfu = (f"MFU ~{100 * est.mfu:.0f}% of the device peak ({peak}), for compute alone (the MFU training "
               "logs counts whole wall-clock steps: data waits, the first steps' warm-up and Python overhead too)")
    return [Row("step time", "pass", f"~{est.step_time:.3g} s per step ({parts}); "
                f"{est.tokens_per_second:,.0f} tokens/s on {ctx.world_size} device(s); {steps} steps ~ "
                f"{est.run_hours:,.2f} h wall, {est.gpu_hours:,.1f} device-hours; {mfu}. Rates {est.rates.source}.")]


# ================================================================================================
# What the recipes' data rows share
# ================================================================================================

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


def unopened_row(check: str, opened: OpenedSource) -> Row:
    """The failed row of a data source that cannot be opened (`pan.data.reader.open_sources`)."""
    if opened.kind == "image_tars":
        return Row(check, "fail", str(opened.error), "fix or remove the tar(s).")
    return Row(check, "fail", f"{opened.label}: {opened.error}", "fix or remove the file.")


def source_sizes(data) -> dict[str, int]:
    """Samples of each data source that opens, by file name ("image tars" for the tars); the ones
    that do not open are left to the data row."""
    return {("image tars" if o.kind == "image_tars" else Path(o.label).name): len(o.source)
            for o in open_sources(data).opened}


def check_data(ctx: Preflight) -> list[Row]:
    """Open every source (video CSVs, annotation files, image tars) and read a few samples of each
    with the reader training uses and what the transformer takes (the task's `sample_fit`): a row
    that does not fit is skipped as `unfit` here as it is in training. A recipe whose samples are
    read this way lists it as its data check."""
    opened = open_sources(ctx.job.data)
    rows = [unopened_row("data", o) for o in opened.failed]
    reader = SampleReader(opened.row_sources, opened.tars, rules_of(ctx.job.data), fit=ctx.task.sample_fit())
    for o in opened.opened:
        row = _read_spread_samples(reader, o.label, o.stream, len(o.source), ctx.sample_rows)
        rows.append(with_annotation_scan(row, o.source) if isinstance(o.source, AnnotationSource) else row)
    return rows


def _read_spread_samples(reader: SampleReader, label: str, stream: str, size: int, count: int) -> Row:
    """Read `count` samples spread over a source; fail when none is usable."""
    picks = spread_rows(count, size)
    problems = []
    for index in picks:
        got = reader[Ref(seq=0, stream=stream, epoch=0, pos=0, index=index)]
        if got.sample is None:
            problems.append(f"#{index} {got.reason}: {got.detail}")
    good = len(picks) - len(problems)
    detail = f"{label}: {size} samples; decoded {good}/{len(picks)} of rows {picks}"
    if problems:
        detail += ". Skipped:\n" + "\n".join(problems)  # one problem a line
    if good == 0:
        return Row("data", "fail", detail + ".", "fix the paths, media or frame rules named above; rows "
                   "`unfit` hold latents or caption features the transformer cannot take (of another VAE "
                   "or text encoder?): precompute them again with this run's (`pan data precompute`).")
    if problems:
        return Row("data", "warn", detail + ".", "such samples are skipped in training; fix or remove them.")
    return Row("data", "pass", detail + ".")
