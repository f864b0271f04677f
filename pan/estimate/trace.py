"""The trace: live bytes and work of every operation of a step, on fake tensors. A probe's step is
run on fake copies of the parts (`FakeTensorMode`: shapes only), with the run's activation
checkpointing and, for cp > 1, simulated Ulysses exchanges; `cached_trace_step` keeps each traced
step, in the process and on disk."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import json
import math
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from pan.estimate.probe import Probe, run_device
from pan.models.attention import InnerAttention
from pan.optim.builder import build_optimizer
from pan.parallel.checkpointing import apply_activation_checkpointing
from pan.parallel.fsdp import declared_blocks
from pan.parallel.precision import compute_precision

aten = torch.ops.aten
MATMUL_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
CONV_OPS = {aten.convolution.default, aten.convolution_backward.default}
VIEW_LIKE = {aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int,
             aten.permute.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
             aten.alias.default, aten.detach.default, aten.slice.Tensor, aten.select.int,
             aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.as_strided.default,
             aten.chunk.default, aten.reshape.default, aten.unflatten.int, aten.squeeze.default,
             aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default}


def _tensors(tree) -> list[Tensor]:
    """The tensors among `tree`'s pytree leaves, in their order. An operation's arguments and
    results are plain tuples, lists and dicts of tensors and scalars: those are walked here (pytree's
    own walk costs more than the rest of the counting); any other container is pytree's."""
    out: list[Tensor] = []
    _collect(tree, out)
    return out


_SCALARS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                      torch.memory_format, torch.Size})


def _collect(x, out: list[Tensor]) -> None:
    kind = type(x)
    if kind is tuple or kind is list or kind is dict:
        for y in (x.values() if kind is dict else x):
            if type(y) in _SCALARS:
                continue
            if isinstance(y, Tensor):
                out.append(y)
            else:
                _collect(y, out)
    elif isinstance(x, Tensor):
        out.append(x)
    elif kind not in _SCALARS:
        out.extend(t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, Tensor))


CONV_SHARE, MAX_TIMED_CONVS = 0.8, 6


@dataclass
class Work:
    """What a traced stretch of a step computes, by the kind of rate that times it."""
    matmul_flops: float = 0.0
    conv_flops: float = 0.0
    attention_flops: float = 0.0
    memory_bytes: float = 0.0
    operations: float = 0.0                                 # every operation dispatched, views too
    exchanges: float = 0.0                                  # Ulysses all-to-alls (forward, backward,
    exchange_bytes: float = 0.0                             # recomputed) and the bytes this rank sends
    largest_gemm: tuple[int, int, int] = (1, 1, 1)          # (M, K, N) of the heaviest matmul
    longest_attention: tuple[int, int, int] = (1, 1, 1)     # (heads, length, head dim)
    # forward convolutions: (input shape, weight shape, stride, padding, dilation, groups) -> FLOPs
    conv_shapes: dict[tuple, float] = field(default_factory=dict)

    def add(self, other: Work, scale: float = 1.0) -> None:
        self.matmul_flops += scale * other.matmul_flops
        self.conv_flops += scale * other.conv_flops
        self.attention_flops += scale * other.attention_flops
        self.memory_bytes += scale * other.memory_bytes
        self.operations += scale * other.operations
        self.exchanges += scale * other.exchanges
        self.exchange_bytes += scale * other.exchange_bytes
        self.largest_gemm = max(self.largest_gemm, other.largest_gemm, key=math.prod)
        self.longest_attention = max(self.longest_attention, other.longest_attention, key=math.prod)
        for spec, flops in other.conv_shapes.items():
            self.conv_shapes[spec] = self.conv_shapes.get(spec, 0.0) + scale * flops

    def main_convs(self) -> tuple[tuple[tuple, float], ...]:
        """The convolution shapes that make most of the convolution FLOPs (CONV_SHARE of them, at most
        MAX_TIMED_CONVS), heaviest first, with their FLOPs: those the convolution rate is timed on."""
        out, total, covered = [], sum(self.conv_shapes.values()), 0.0
        for spec, flops in sorted(self.conv_shapes.items(), key=lambda kv: -kv[1]):
            if covered >= CONV_SHARE * total or len(out) == MAX_TIMED_CONVS:
                break
            out.append((spec, flops))
            covered += flops
        return tuple(out)


def _is_attention(func) -> bool:
    name = func.name()
    return "attention" in name and "aten::" in name


# What the counter does with an operation (`_kind_of`, once per operation): a query of a fake
# tensor's device (`t.device` in Python or C++: most of a fake step's dispatches), a matmul, a
# convolution, attention (forward or backward), a view (or an allocation), else memory-bound work.
DEVICE, MATMUL, CONV, ATTENTION, ATTENTION_BACKWARD, VIEW, MEMORY = range(7)
_KINDS: dict = {}


def _kind_of(func) -> int:
    kind = _KINDS.get(func)
    if kind is None:
        if func is torch.ops.prim.device.default:
            kind = DEVICE
        elif func in MATMUL_OPS:
            kind = MATMUL
        elif func in CONV_OPS:
            kind = CONV
        elif _is_attention(func):
            kind = ATTENTION_BACKWARD if "backward" in func.name() else ATTENTION
        else:
            kind = VIEW if func in VIEW_LIKE else MEMORY
        _KINDS[func] = kind
    return kind


class StepTrace(TorchDispatchMode):
    """Follows every tensor an operation creates until it is released: live bytes, their peak (with
    parameter gradients weighted by `grad_scale`, the share FSDP keeps), and the work done."""

    def __init__(self, grad_scale: float = 1.0):
        super().__init__()
        self.grad_scale = grad_scale
        self.live: dict[int, tuple[int, str]] = {}       # storage id -> (bytes, kind)
        self._refs: dict[int, weakref.ref] = {}
        self.bytes = {"activations": 0, "attention": 0, "gradients": 0}
        self.peak = 0.0
        self.at_peak = dict(self.bytes)
        self.work = Work()
        self.graded: dict[str, set[str]] = {}           # part -> its parameters that got a gradient

    # -- memory --------------------------------------------------------------------------------
    def level(self) -> float:
        return self.bytes["activations"] + self.bytes["attention"] + self.grad_scale * self.bytes["gradients"]

    def _track(self, t: Tensor, kind: str) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.live:
            return
        size = storage.nbytes()
        self.live[key] = (size, kind)
        self.bytes[kind] += size
        self._refs[key] = weakref.ref(storage, functools.partial(self._release, key))
        level = self.level()
        if level > self.peak:
            self.peak, self.at_peak = level, dict(self.bytes)

    def _release(self, key: int, _ref=None) -> None:
        size, kind = self.live.pop(key, (0, None))
        self._refs.pop(key, None)
        if kind is not None:
            self.bytes[kind] -= size

    def already_live(self, tensors) -> None:
        """Tensors that exist before the traced stretch (parameters, gradients, optimizer states):
        an in-place operation returns them, which is not a new allocation."""
        for t in tensors:
            storage = t.untyped_storage()
            key = id(storage)
            if key not in self.live:
                self.live[key] = (0, None)
                self._refs[key] = weakref.ref(storage, functools.partial(self._release, key))

    def as_gradient(self, t: Tensor) -> None:
        """A parameter's .grad: counted at the share of it FSDP keeps."""
        key = id(t.untyped_storage())
        if key in self.live and self.live[key][1] != "gradients":
            size, kind = self.live[key]
            self.bytes[kind] -= size
            self.bytes["gradients"] += size
            self.live[key] = (size, "gradients")

    # -- work ----------------------------------------------------------------------------------
    def _count(self, func, args, kwargs, out, kind: int) -> None:
        w = self.work
        w.operations += 1
        if kind == MATMUL:
            a, b = args[-2], args[-1]
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            batch = a.shape[0] if a.dim() == 3 else 1
            w.matmul_flops += 2.0 * batch * m * k * n
            w.largest_gemm = max(w.largest_gemm, (batch * m, k, n), key=math.prod)
        elif kind == CONV:
            weight = args[1] if func is aten.convolution.default else args[2]
            result = out if func is aten.convolution.default else args[0]   # the output (or its grad)
            per_output = 2.0 * math.prod(weight.shape[1:])
            passes = 1 if func is aten.convolution.default else sum(bool(x) for x in args[-1][:2])
            w.conv_flops += passes * per_output * result.numel()
            if func is aten.convolution.default and not args[6]:       # forward, not transposed
                # Timed by shape: a convolution's rate depends on its channels and kernel far more
                # than a GEMM of the same FLOPs (a VAE's 8-channel convs run far below a matmul's).
                x, _, _, stride, padding, dilation, _, _, groups = args
                spec = (tuple(x.shape), tuple(weight.shape), tuple(stride), tuple(padding), tuple(dilation), groups)
                w.conv_shapes[spec] = w.conv_shapes.get(spec, 0.0) + per_output * result.numel()
        elif kind == ATTENTION or kind == ATTENTION_BACKWARD:
            q = args[0]
            if q.dim() == 4:                      # [B, H, L, d]
                b, h, lq, d = q.shape
                lk = args[1].shape[-2]
            else:                                 # varlen [L, H, d]
                (lq, h, d), b, lk = q.shape, 1, args[1].shape[0]
            passes = 2.5 if kind == ATTENTION_BACKWARD else 1.0
            w.attention_flops += passes * 4.0 * b * h * lq * lk * d
            w.longest_attention = max(w.longest_attention, (b * h, lq, d), key=math.prod)
        elif kind != VIEW:
            w.memory_bytes += sum(t.numel() * t.element_size() for t in _tensors((args, kwargs, out)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = _KINDS.get(func)
        if kind is None:
            kind = _kind_of(func)
        if kind == DEVICE and not kwargs and len(args) == 1 and isinstance(args[0], FakeTensor):
            # A fake tensor's device, asked on every use of it (C++ included): most of a fake step's
            # dispatches. Answered as fake mode answers it, without the round trip through the
            # dispatcher. Counted as before (an operation, its tensor's bytes as memory-bound work):
            # on a real tensor it is a field read, yet without these counts the step-time model
            # underestimates steps of many small operations (the VAE with its discriminator: 0.62x
            # its measured step, tests/test_estimate.py), so they stand in for per-operation costs
            # the model does not otherwise count.
            t = args[0]
            self.work.operations += 1
            self.work.memory_bytes += t.numel() * t.element_size()
            return torch.device("meta") if t.fake_mode.in_kernel_invocation else t.fake_device
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            # A value read back (a logged loss, the VAE's adaptive GAN weight): fake tensors have
            # none. It reads 1; a step's shapes, all the trace needs, do not depend on it.
            return True if args[0].dtype is torch.bool else 1 if not args[0].is_floating_point() else 1.0
        out = func(*args, **kwargs)
        self._count(func, args, kwargs, out, kind)
        kind = "attention" if kind == ATTENTION or kind == ATTENTION_BACKWARD else "activations"
        if isinstance(out, Tensor):
            self._track(out, kind)
        else:
            for t in _tensors(out):
                self._track(t, kind)
        return out


# ================================================================================================
# Fake copies of the parts, parallelised as the trainer would
# ================================================================================================

def fake_copy(model: nn.Module) -> nn.Module:
    """A copy of a meta-device model with fake CPU parameters and buffers (inside FakeTensorMode).

    Its tensors are not copied: deepcopy under FakeTensorMode cannot clone a plain meta tensor
    that is a view (LPIPS's scaling buffers), so each is mapped to a new empty tensor up front."""
    fresh = {id(b): torch.empty(b.shape, dtype=b.dtype) for b in model.buffers()}
    fresh.update({id(p): nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                  for p in model.parameters()})
    return copy.deepcopy(model, memo=fresh)


class _Exchange(torch.autograd.Function):
    """An all-to-all as far as memory goes: a new tensor of the received shape (and back). Each
    way, `ulysses.count` counts the call and what it sends."""

    @staticmethod
    def forward(ctx, x: Tensor, shape: tuple[int, ...], ulysses: SimulatedUlysses) -> Tensor:
        ctx.shape, ctx.ulysses = x.shape, ulysses
        ulysses.count(x, recomputation=_in_backward())
        return x.new_empty(shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.ulysses.count(grad)
        return grad.new_empty(ctx.shape), None, None


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward (a forward now is a checkpoint's recomputation)."""
    return torch._C._current_graph_task_id() != -1


class SimulatedUlysses(nn.Module):
    """Ulysses attention of cp rank 0 of `size`, without a process group: the same tensors and
    shapes as `pan.parallel.context_parallel.UlyssesAttention` (the other ranks' rows arrive as
    new tensors of the right size), for tracing one rank's step. Its all-to-alls are counted in
    `work`; a recomputed block exchanges again only under full checkpointing (`exchanges_again`):
    the selective policy keeps the all-to-alls' results."""

    def __init__(self, inner: nn.Module, size: int, work: Work, exchanges_again: bool):
        super().__init__()
        self.inner, self.size = inner, size
        self.work, self.exchanges_again = work, exchanges_again

    def count(self, sent: Tensor, recomputation: bool = False) -> None:
        """One all-to-all of `sent`: all of it but this rank's own 1/size leaves the rank."""
        if recomputation and not self.exchanges_again:
            return
        self.work.exchanges += 1
        self.work.exchange_bytes += sent.numel() * sent.element_size() * (self.size - 1) / self.size

    def forward(self, q: Tensor, k: Tensor, v: Tensor, segments) -> Tensor:
        if not segments.is_sharded:
            return self.inner(q, k, v, segments)
        n, (rows, heads, head_dim) = self.size, q.shape
        total = segments.total
        qkv = torch.stack([q, k, v]).unflatten(2, (n, heads // n)).permute(2, 0, 1, 3, 4)
        full = _Exchange.apply(qkv.reshape(n * 3 * rows, heads // n, head_dim), (3 * total, heads // n, head_dim),
                               self)
        full = full.unflatten(0, (3, total))
        out = self.inner(full[0], full[1], full[2], segments.unsharded())
        back = _Exchange.apply(out, (n * rows, heads // n, head_dim), self)
        return back.unflatten(0, (n, rows)).permute(1, 0, 2, 3).reshape(rows, heads, head_dim)


def parallelised_fake(model: nn.Module, job, cp: int, work: Work) -> nn.Module:
    """A fake copy of `model` with the run's activation checkpointing and, for cp > 1, simulated
    Ulysses attention (the order of `pan.parallel.fsdp.parallelize_model`), whose all-to-alls
    count in `work`."""
    twin = fake_copy(model)
    p = job.parallel
    if p.enable_gradient_checkpointing:
        chosen = twin.checkpointed_blocks() if hasattr(twin, "checkpointed_blocks") else declared_blocks(twin)
        apply_activation_checkpointing(chosen, p.use_dedicated_gradient_checkpointing)
    if cp > 1:
        for module in list(twin.modules()):
            if isinstance(getattr(module, "inner_attention", None), InnerAttention):
                module.inner_attention = SimulatedUlysses(module.inner_attention, cp, work,
                                                          not p.use_dedicated_gradient_checkpointing)
    return twin


# ================================================================================================
# The traced step, and the optimizer's
# ================================================================================================

@dataclass
class Layout:
    """How one part's parameters are spread: the FSDP shard degree and whether blocks are gathered."""
    shard: int
    compute_bytes: int          # bytes of a parameter as the step computes with it (bf16: 2)

    @classmethod
    def of(cls, job, dims) -> Layout:
        mode = job.parallel.data_parallel_mode
        shard = 1 if mode == "ddp" or dims.world_size == 1 else dims.dp_shard * dims.cp
        return cls(shard, 2 if job.trainer.dtype == "bf16" else 4)


def fake_mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=True)


def trace_step(ctx, probe: Probe, layout: Layout) -> tuple[StepTrace, Work]:
    """Run the probe's phases (forward, backward) on fake tensors, each followed by its part's
    optimizer step. Returns the trace (its peak is the step's, gradients at FSDP's share; `at_peak`
    says what was live then) and the optimizer steps' work."""
    job = ctx.job
    specs = {spec.name: spec for spec in ctx.part_specs}
    trace = StepTrace(grad_scale=1.0 / layout.shard)
    optimizer_work = Work()
    steps = {phase.part: optimizer_step_trace(ctx.models[phase.part], specs[phase.part].optim.optim())
             for phase in probe.phases}
    with fake_mode():
        models = {name: parallelised_fake(model, job, ctx.dims.cp, trace.work) for name, model in ctx.models.items()}
        # What each part trains (a frozen VAE encoder does not), before all is frozen between phases.
        trained = {name: [p for p in model.parameters() if p.requires_grad] for name, model in models.items()}
        for model in models.values():
            model.train().requires_grad_(False)
        models.update({name: fake_copy(helper) for name, helper in probe.helpers.items()})
        # The parts' own tensors are counted apart (`static_bytes`, the frozen encoders): a view of a
        # weight (its transpose in a linear) is not a new activation.
        trace.already_live([t for model in models.values() for t in (*model.parameters(), *model.buffers())])
        for phase in probe.phases:
            model = models[phase.part]
            for p in trained[phase.part]:
                p.requires_grad_(True)
            handles = [p.register_post_accumulate_grad_hook(lambda p: trace.as_gradient(p.grad))
                       for p in trained[phase.part]]
            with trace, compute_precision(job.trainer.dtype, "cpu"):
                phase.loss(models).backward()
            # Only these are reduced over the ranks and stepped (`step_traffic`).
            trace.graded[phase.part] = {name for name, p in model.named_parameters() if p.grad is not None}
            for h in handles:
                h.remove()
            # The part's gradients stay until its optimizer step, whose temporaries come on top.
            step = steps[phase.part]
            # Muon's Newton-Schulz is shared out over the shard group; AdamW runs on shards already.
            optimizer_work.add(step.work, 1.0 / layout.shard)
            if trace.level() + step.peak > trace.peak:
                trace.peak = trace.level() + step.peak
                trace.at_peak = {**trace.bytes, "optimizer step": step.peak}
            model.zero_grad(set_to_none=True)
            model.requires_grad_(False)
    return trace, optimizer_work


def optimizer_step_trace(model: nn.Module, optim) -> StepTrace:
    """One optimizer step of a meta-device part (its state made first, as the trainer's builder
    does): the temporaries and work of the step alone. It depends on the parameters' names and
    shapes and the optimizer keys only, so a process traces each such step once."""
    key = (tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in model.named_parameters()),
           repr(optim))
    if key not in _OPTIMIZER_STEPS:
        _OPTIMIZER_STEPS[key] = _trace_optimizer_step(model, optim)
    return _OPTIMIZER_STEPS[key]


_OPTIMIZER_STEPS: dict[tuple, StepTrace] = {}


def _trace_optimizer_step(model: nn.Module, optim) -> StepTrace:
    # Meta tensors, not fake ones: the step's thousands of small operations cost less. Frozen
    # parameters (a LoRA part's base) stay frozen: no gradient, not stepped.
    twin = copy.deepcopy(model)
    if getattr(optim, "adamw_implementation", None) == "fused":
        # torch's fused AdamW refuses meta tensors; tensor by tensor bounds its temporaries (it has none)
        optim = dataclasses.replace(optim, adamw_implementation="for-loop")
    optimizer, _ = build_optimizer(twin, optim)
    # The implementation torch picks on the run's device: AdamW over every tensor at once (foreach:
    # temporaries of all of them) on CUDA, tensor by tensor on the CPU (meta tensors get the latter).
    foreach = run_device().type == "cuda"
    for opt in optimizer.optimizers:
        for group in opt.param_groups:
            if group.get("foreach", False) is None:
                group["foreach"] = foreach
    for p in twin.parameters():
        if p.requires_grad:
            p.grad = torch.empty_like(p)
    step = StepTrace()
    # What exists before the step is not its temporaries (in-place updates return it).
    step.already_live([*twin.parameters(), *(p.grad for p in twin.parameters() if p.grad is not None),
                       *(t for opt in optimizer.optimizers for state in opt.state.values()
                         for t in state.values() if isinstance(t, Tensor))])
    with step:
        optimizer.step()
    return step


# Sections of a job the traced step does not read: the micro-batch the data keys lead to is the
# probe's, and paths, checkpoints, logging and validation do not change a training step; nor do the
# trainer's run length and seed, nor the watchdog (a step on fake tensors of meta parts draws nothing).
# `explicit_keys` names the keys set, whose values are in the sections.
UNTRACED_SECTIONS = frozenset({"data", "checkpoint", "logging", "validation", "warm_start", "watchdog",
                               "explicit_keys"})
UNTRACED_TRAINER_KEYS = frozenset({"max_steps", "seed", "max_nonfinite_steps"})
MAX_CACHED_TRACES = 32
_TRACES: dict[str, tuple[TracedStep, Work]] = {}


@dataclass
class TracedStep:
    """What the estimate reads of a traced step: what was live at its peak, the gradients' share,
    the work of the micro-batch, and the parameters each part graded."""
    at_peak: dict[str, float]
    grad_scale: float
    work: Work
    graded: dict[str, set[str]]

    @classmethod
    def of(cls, trace: StepTrace) -> TracedStep:
        return cls(dict(trace.at_peak), trace.grad_scale, trace.work, trace.graded)


def cached_trace_step(ctx, probe: Probe, layout: Layout) -> tuple[TracedStep, Work]:
    """`trace_step`, once for each step: a `pan check` of many configs (a test suite, the suggested
    fixes) mostly traces the same step again, and train.py's start-up checks trace the step `pan
    check` traced before it (a 2B DiT's trace takes ~20 s on a CPU). Kept in the process and on
    disk (`trace_cache_dir`), under a digest of all the step depends on (`trace_key`)."""
    key = trace_key(ctx, probe, layout)
    if key not in _TRACES:
        if len(_TRACES) >= MAX_CACHED_TRACES:
            _TRACES.pop(next(iter(_TRACES)))
        _TRACES[key] = read_cached_trace(key) or store_trace(key, *trace_step(ctx, probe, layout))
    return _TRACES[key]


def trace_key(ctx, probe: Probe, layout: Layout) -> str:
    """A digest of every key of the job the step reads, the parts and helpers as built (their
    structure, and each tensor's name, shape, dtype and whether it trains: what a model folder's
    config.json decides), the probe's micro-batch, the layout, and pan's code, torch and the device."""
    job, h = ctx.job, hashlib.sha256()
    for f in dataclasses.fields(job):
        if f.name in UNTRACED_SECTIONS:
            continue
        section = getattr(job, f.name)
        if f.name == "trainer" and dataclasses.is_dataclass(section):
            section = {k.name: getattr(section, k.name) for k in dataclasses.fields(section)
                       if k.name not in UNTRACED_TRAINER_KEYS}
        h.update(f"{f.name}={section!r}\n".encode())
    for name, module in sorted({**ctx.models, **probe.helpers}.items()):
        h.update(f"{name}: {module!r}\n".encode())
        for tname, t in (*module.named_parameters(), *module.named_buffers()):
            h.update(f"{tname} {tuple(t.shape)} {t.dtype} {t.requires_grad}\n".encode())
    device = run_device()
    h.update(repr((probe.describe, probe.tokens, probe.samples, ctx.dims.cp, layout.shard, layout.compute_bytes,
                   code_digest(), torch.__version__, device.type,
                   torch.cuda.get_device_name(device) if device.type == "cuda" else "")).encode())
    return h.hexdigest()


@functools.cache
def code_digest() -> str:
    """pan's source: a traced step is what this code does."""
    h = hashlib.sha256()
    for path in sorted(PAN_ROOT.rglob("*.py")):
        h.update(path.relative_to(PAN_ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


PAN_ROOT = Path(__file__).resolve().parents[1]


def trace_cache_dir() -> Path | None:
    """Where traced steps are kept between processes: $PAN_CACHE_DIR/traces (set it empty to keep
    none), else $XDG_CACHE_HOME/pan/traces, else ~/.cache/pan/traces."""
    root = os.environ.get("PAN_CACHE_DIR")
    if root is None:
        package = __name__.partition(".")[0]  # ~/.cache/pan
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / package)
    return Path(root) / "traces" if root else None


def read_cached_trace(key: str) -> tuple[TracedStep, Work] | None:
    """The traced step kept under `key`, or None (none kept, or a file that does not read: traced again)."""
    folder = trace_cache_dir()
    try:
        data = json.loads((folder / f"{key}.json").read_text()) if folder else None
        if data is None:
            return None
        step = data["step"]
        return (TracedStep(step["at_peak"], step["grad_scale"], work_from_json(step["work"]),
                           {part: set(names) for part, names in step["graded"].items()}),
                work_from_json(data["optimizer_work"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_trace(key: str, trace: StepTrace, optimizer_work: Work) -> tuple[TracedStep, Work]:
    """Keep a traced step on disk (best effort: an unwritable cache only costs the next trace)."""
    step = TracedStep.of(trace)
    folder = trace_cache_dir()
    if folder is not None:
        data = {"step": {"at_peak": step.at_peak, "grad_scale": step.grad_scale, "work": work_to_json(step.work),
                         "graded": {part: sorted(names) for part, names in step.graded.items()}},
                "optimizer_work": work_to_json(optimizer_work)}
        with contextlib.suppress(OSError):
            folder.mkdir(parents=True, exist_ok=True)
            partial = folder / f"{key}.{os.getpid()}.tmp"
            partial.write_text(json.dumps(data))
            os.replace(partial, folder / f"{key}.json")   # whole or absent: a reader never sees half
    return step, optimizer_work


def work_to_json(work: Work) -> dict:
    out = dataclasses.asdict(work)
    out["conv_shapes"] = [[list(spec), flops] for spec, flops in work.conv_shapes.items()]
    return out


def work_from_json(data: dict) -> Work:
    def tuples(x):
        return tuple(tuples(v) for v in x) if isinstance(x, list) else x
    shapes = {tuples(spec): flops for spec, flops in data.pop("conv_shapes")}
    return Work(**{k: tuples(v) for k, v in data.items()}, conv_shapes=shapes)
