"""The estimate of a run (`estimate_run`): memory per device by category, against what the device
offers, and step time, tokens per second and the run's hours from the traced step and the rates;
and the single changes of keys that make a run fit when it does not (`fitting_changes`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pan.config.core import ConfigError
from pan.estimate.cost import (
    Rates,
    StepWork,
    device_peak,
    network_of_this_machine,
    rates_for,
    step_traffic,
    with_network,
)
from pan.estimate.probe import FP32_BYTES, probe_of, state_bytes, unit_sizes
from pan.estimate.trace import Layout, cached_trace_step
from pan.parallel.fsdp import FULL_INIT_MAX_PARAMS

GIB = 2 ** 30


@dataclass
class Estimate:
    """Everything `pan check` says about memory and cost (see the module docstring)."""
    device: dict[str, int]                 # category -> bytes on the busiest device
    host: dict[str, int]                   # category -> bytes of host memory per process
    capacity: int                          # bytes the device offers
    capacity_source: str
    fits: bool
    batch: str                             # the micro-batch it was made for
    tokens_per_rank: int
    step_time: float                       # seconds per optimizer step
    time_parts: dict[str, float]           # seconds per step by kind of work, communication included
    tokens_per_second: float               # whole run
    run_hours: float                       # wall time of max_steps
    gpu_hours: float
    flops_per_step: float                  # the recipe's exact count, whole world
    mfu: float | None                      # of peak_flops; None when above 1: the estimate is unreliable
    peak_flops: float                      # FLOP/s of one device MFU is measured against (`device_peak`)
    peak_source: str
    rates: Rates
    work: StepWork                         # what the step time was computed from

    @property
    def total(self) -> int:
        return sum(self.device.values())

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["total"] = self.total
        # JSON keys are strings: the convolution shapes as [shape, FLOPs] pairs.
        for work in (out["work"]["micro"], out["work"]["optimizer"]):
            work["conv_shapes"] = [[list(spec), flops] for spec, flops in work["conv_shapes"].items()]
        return out


# ================================================================================================
# The estimate
# ================================================================================================

def estimate_run(ctx, capacity: int | None = None) -> Estimate:
    """Memory per device and step time of the ctx's job on its planned layout."""
    probe_fn = probe_of(ctx.job.recipe)
    if probe_fn is None:
        raise ConfigError("recipe", f"the {ctx.job.recipe} recipe declares no probe (its `probe` hook), "
                          "so its memory and step time cannot be estimated.")
    probe = probe_fn(ctx)
    layout = Layout.of(ctx.job, ctx.dims)
    trace, optimizer_work = cached_trace_step(ctx, probe, layout)
    device = static_bytes(ctx, layout)
    # What was live at the step's peak: gradients as far as the backward had made them (FSDP's
    # share), activations, the attention workspace, the optimizer step's temporaries.
    peak = trace.at_peak
    device["gradients"] = int(peak["gradients"] * trace.grad_scale)
    device["activations"] = peak["activations"]
    device["attention workspace"] = peak["attention"]
    device["optimizer step"] = peak.get("optimizer step", 0)
    device.update({f"frozen {name}": size for name, size in probe.frozen.items()})
    host = {"data loader": probe.loader}
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        device.update(host)
    cap, source = capacity_of(ctx, capacity)
    accumulation = getattr(ctx.job.trainer, "gradient_accumulation_steps", 1)
    work = StepWork(trace.work, optimizer_work, accumulation,
                    step_traffic(ctx, probe, layout, trace, accumulation))
    rates = rates_for(work.micro, ctx.job.trainer.dtype)
    if work.traffic:
        rates = with_network(rates, network_of_this_machine())
    parts = work.seconds(rates)
    step_time = sum(parts.values())
    dims = ctx.dims
    tokens_per_step = probe.tokens * accumulation * dims.dp
    steps = ctx.job.trainer.max_steps
    flops_per_step = probe.flops * accumulation * dims.world_size
    peak_flops, peak_source = device_peak(ctx.job.trainer.dtype)
    mfu = flops_per_step / step_time / (peak_flops * dims.world_size)
    total = sum(device.values())
    return Estimate(device={k: int(v) for k, v in device.items()}, host=host, capacity=cap,
                    capacity_source=source, fits=total <= cap, batch=probe.describe,
                    tokens_per_rank=probe.tokens, step_time=step_time, time_parts=parts,
                    tokens_per_second=tokens_per_step / step_time,
                    run_hours=steps * step_time / 3600, gpu_hours=steps * step_time * dims.world_size / 3600,
                    flops_per_step=flops_per_step,
                    mfu=mfu if mfu <= 1 else None, peak_flops=peak_flops, peak_source=peak_source,
                    rates=rates, work=work)


def static_bytes(ctx, layout: Layout) -> dict[str, int]:
    """Parameters (the trained ones' fp32 master copies; the frozen ones, a LoRA part's base, apart
    at their dtype: `frozen parameters`), optimizer states, EMA and FSDP's gathered blocks of every
    part (the gradients come from the trace: how many exist at the peak depends on when it is)."""
    out = {"parameters": 0, "optimizer states": 0, "ema": 0, "fsdp gathered": 0}
    for spec in ctx.part_specs:
        model = ctx.models[spec.name]
        state = state_bytes(model, spec.optim.optim())
        out["parameters"] += state["weights"] // layout.shard
        if state["frozen"]:   # a LoRA part's base (or a frozen encoder) at its dtype, nothing else
            out["frozen parameters"] = out.get("frozen parameters", 0) + state["frozen"] // layout.shard
        out["optimizer states"] += (state["muon"] + state["adamw"]) // layout.shard
        out["ema"] += state["ema"] // layout.shard
        if layout.shard > 1:
            blocks, root = unit_sizes(model)
            block = max(blocks, default=0)
            # current + prefetched block, one block's unsharded gradients, the root's own weights
            out["fsdp gathered"] += (2 * block + root) * layout.compute_bytes + block * FP32_BYTES
    return out


# ================================================================================================
# The device: capacity
# ================================================================================================

def capacity_of(ctx, override_gib: float | None = None) -> tuple[int, str]:
    """Bytes one process may use: `--device-memory`, the GPU's memory, or on CPU this machine's
    available host memory shared by the node's processes."""
    if override_gib is not None:
        return int(override_gib * GIB), f"--device-memory {override_gib:g} GiB"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"{props.name} memory"
    available = host_available_bytes()
    per = ctx.gpus_per_node
    return available // per, (f"available host memory / {per} processes per node" if per > 1
                              else "available host memory")


def host_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), else physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ================================================================================================
# What to change when it does not fit
# ================================================================================================

@dataclass
class Change:
    """A change of keys that makes the run fit, with its estimate."""
    keys: dict[str, object]
    estimate: Estimate

    @property
    def text(self) -> str:
        return " ".join(f"--{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in self.keys.items())


def _with(job, section: str, **keys):
    return dataclasses.replace(job, **{section: dataclasses.replace(getattr(job, section), **keys)})


def candidate_jobs(ctx) -> list[tuple[dict[str, object], object]]:
    """Jobs one change away from ctx's that may need less memory per device: hybrid shard off,
    selective then full activation checkpointing, each larger cp_size the heads and the node allow."""
    job, p = ctx.job, ctx.job.parallel
    out = []
    if p.hybrid_shard:
        out.append(({"hybrid_shard": False}, _with(job, "parallel", hybrid_shard=False)))
    if not p.enable_gradient_checkpointing:
        out.append(({"enable_gradient_checkpointing": True, "use_dedicated_gradient_checkpointing": True},
                    _with(job, "parallel", enable_gradient_checkpointing=True,
                          use_dedicated_gradient_checkpointing=True)))
    if not p.enable_gradient_checkpointing or p.use_dedicated_gradient_checkpointing:
        out.append(({"enable_gradient_checkpointing": True, "use_dedicated_gradient_checkpointing": False},
                    _with(job, "parallel", enable_gradient_checkpointing=True,
                          use_dedicated_gradient_checkpointing=False)))
    heads = job.attention_heads()
    cp = p.cp_size * 2
    while heads is not None and heads % cp == 0 and ctx.gpus_per_node % cp == 0:
        out.append(({"cp_size": cp}, _with(job, "parallel", cp_size=cp)))
        cp *= 2
    return out


def smaller_budget(ctx, estimate: Estimate) -> tuple[dict, object] | None:
    """The largest max_tokens_per_batch (a multiple of 64) that fits, assuming activations scale
    with tokens (the caller verifies it with a trace)."""
    data = getattr(ctx.job, "data", None)
    if data is None:
        return None
    scaled = ("activations", "attention workspace")
    per_token = sum(estimate.device.get(k, 0) for k in scaled) / data.max_tokens_per_batch
    room = estimate.capacity - (estimate.total - sum(estimate.device.get(k, 0) for k in scaled))
    budget = int(0.95 * room / per_token) // 64 * 64 if per_token > 0 else 0
    if budget <= 0 or budget >= data.max_tokens_per_batch:
        return None
    return {"max_tokens_per_batch": budget}, _with(ctx.job, "data", max_tokens_per_batch=budget)


LORA_FIX_RANK = 16   # the rank `pan check` suggests when only adapters would fit (docs/lora.md)


def lora_instead(ctx) -> tuple[dict, object] | None:
    """A full fine-tuning of a recipe with a `lora` section as LoRA fine-tuning instead: rank-16
    adapters on a base frozen at the training dtype (bf16 under `dtype: bf16`), without Muon (the
    adapters train with AdamW). Only where there is a base to adapt (a warm-start source or released
    weights: adapters on an init learn nothing through its zero gates) that LoRA can load (whole,
    before sharding: up to FULL_INIT_MAX_PARAMS)."""
    lora = getattr(ctx.job, "lora", None)
    if lora is None or lora.enabled:
        return None
    has_base = ctx.task.warm_start_source() is not None or any(s.pretrained is not None for s in ctx.part_specs)
    if not has_base or sum(p.numel() for p in ctx.model.parameters()) > FULL_INIT_MAX_PARAMS:
        return None
    keys: dict[str, object] = {"lora_rank": LORA_FIX_RANK}
    job = _with(ctx.job, "lora", lora_rank=LORA_FIX_RANK)
    if job.optim.use_muon:
        keys["use_muon"] = False
        job = _with(job, "optim", use_muon=False)
    return keys, job


def fitting_changes(ctx, estimate: Estimate, rebuild: Callable[[object], object]) -> list[Change]:
    """Every single change that makes the run fit, the cheapest first: the highest tokens per second
    (LoRA instead of full fine-tuning, which changes what trains, and a smaller token budget, which
    changes the batch, come last whatever their speed).
    `rebuild(job)` makes the Preflight of a changed job on the same layout."""
    def fitting(job):
        try:
            job.parallel.check(job)
            est = rebuild(job).estimate
        except (ConfigError, ValueError):   # a layout or budget that this job cannot have
            return None
        return est if est.fits else None

    found = [Change(keys, est) for keys, job in candidate_jobs(ctx) if (est := fitting(job)) is not None]
    found.sort(key=lambda c: -c.estimate.tokens_per_second)
    lora = lora_instead(ctx)   # changes what trains: after the layout changes
    if lora is not None and (est := fitting(lora[1])) is not None:
        found.append(Change(lora[0], est))
    budget = smaller_budget(ctx, estimate)
    if budget is not None and (est := fitting(budget[1])) is not None:
        found.append(Change(budget[0], est))
    return found
