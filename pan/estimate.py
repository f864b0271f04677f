"""Know before you queue: per-device memory and step time of a config, before any launch.

    estimate = estimate_run(ctx)          # ctx: a pan.preflight.Preflight (job + planned layout)

Memory, per device, by category. The static ones are counted from the parameters and the layout:
parameters (fp32 master weights), gradients, optimizer states (AdamW 8 B, Muon 4 B per parameter,
as `pan.preflight.state_bytes` counts them for checkpoints) and the EMA, each divided by the FSDP
shard degree (dp_shard x cp; hybrid shard: the ranks of one node; ddp: 1); under FSDP also the
all-gathered working set (the block being computed and the one prefetched, in the compute dtype,
plus one block's unsharded gradients, plus the root module's own parameters). Frozen encoders
(text encoder, VAE) count where they are loaded (cp rank 0 of each group; a text encoder only when
the recipe encodes captions online), in their frozen dtype; the data loader's decoded samples in
flight count in host memory.

Activations and the attention workspace are not guessed from formulas: one training step of the
recipe's largest micro-batch (the most tokens the data budget lets a rank hold, captions at their
longest) is traced on fake tensors (`torch._subclasses.FakeTensorMode`: shapes only, no memory,
no FLOPs), with the run's activation checkpointing applied to a copy of the model and Ulysses'
exchanges simulated for cp > 1. Every tensor the step creates is followed from its allocation to
its release, so the trace's peak is the step's: saved activations, recomputed blocks, backward
temporaries and the gradients as they appear (divided by the shard degree, as FSDP's
reduce-scatter leaves them). Each recipe says what only it knows, its largest micro-batch and how
its step runs (`register_probe`).

Step time: the same trace counts the work of every operation: matmul and convolution FLOPs,
attention FLOPs, and the bytes every other (memory-bound) operation reads and writes, for the
forward, the backward, recomputation and the optimizer step. Each class is timed with a rate
measured on the spot on this machine's device (a matmul of the step's own largest GEMM shape, its
main convolution shapes, an attention call of its longest segment, an elementwise pass over a
large tensor). With several ranks the step also communicates (`step_traffic`): FSDP's all-gathers
of every unit (forward and backward) and reduce-scatters of the gradients (all-reduces over HSDP's
or ddp's replicas), Muon's exchanges of sharded matrices, Ulysses' all-to-alls (counted where the
trace simulates them, again in a fully checkpointed block's recomputation) and a few scalar sums.
Each kind costs its calls times a fixed cost per call plus its bytes over a bandwidth: gloo's on
the CPU, measured on the spot between two threads; NCCL's on GPUs, from datasheet figures
(`measure_network`). A process keeps the trace of each step it has traced, the rates of each set of
shapes and the network (`cached_trace_step`, `rates_for`, `network_of_this_machine`): `pan check`
of many configs traces a step once. Tokens per second, the run's wall time and GPU-hours follow
from max_steps. The recipe's exact FLOP count (its
`forward_flops`) is reported beside it, with the MFU it implies.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from pan.config.core import ConfigError
from pan.optim.builder import split_parameters
from pan.recipe import get_recipe

GIB = 2 ** 30
FP32_BYTES = 4

# ================================================================================================
# What a recipe tells the estimate
# ================================================================================================


@dataclass
class Phase:
    """One backward pass of a train step: `loss(models)` builds this rank's micro-batch on fake
    tensors and returns the loss whose gradients train `part` (the other parts stay frozen)."""
    part: str
    loss: Callable[[dict[str, nn.Module]], Tensor]


@dataclass
class Probe:
    """A recipe's largest micro-batch on one rank and how its step runs it."""
    phases: list[Phase]
    tokens: int                      # tokens of the rank's micro-batch (the recipe's unit)
    samples: int
    flops: float                     # the recipe's exact training FLOPs of that micro-batch, this rank
    frozen: dict[str, int] = field(default_factory=dict)   # frozen encoder -> bytes on this rank
    loader: int = 0                  # host bytes of the data loader's samples in flight
    online_text: bool = False        # whether captions are encoded during training (the encoder is loaded)
    describe: str = ""               # the micro-batch in words
    helpers: dict[str, nn.Module] = field(default_factory=dict)  # frozen meta modules the losses use
                                     # (LPIPS, the VAE's discriminator copy), given to them fake by name


ProbeFn = Callable[[object], Probe]   # a recipe's `probe` hook: (a Preflight) -> Probe


def probe_of(recipe: str) -> ProbeFn | None:
    """The recipe's probe (its `probe` hook, pan/recipe.py); None when it declares none."""
    return get_recipe(recipe).hook("probe")


# Bytes per parameter of an fp32 master weight, moment or EMA copy.
FP32_BYTES = 4


def state_bytes(model: torch.nn.Module, optim) -> dict[str, int]:
    """Bytes of a part's training state by kind, whole (unsharded), for its OptimConfig `optim`.

    The weights are fp32 master copies (4 B per parameter whatever the compute dtype). AdamW keeps
    two fp32 moments (8 B per parameter), Muon one fp32 momentum buffer (4 B); the split is the
    optimizer's own, over the trainable parameters. An EMA adds another fp32 copy of those.
    """
    groups, _, _ = split_parameters(model, optim.use_muon)
    muon = sum(p.numel() for _, p in groups["muon"])
    trained = sum(p.numel() for members in groups.values() for _, p in members)
    total = sum(p.numel() for p in model.parameters())
    return {"weights": FP32_BYTES * total, "muon": FP32_BYTES * muon,
            "adamw": 2 * FP32_BYTES * (trained - muon),
            "ema": FP32_BYTES * trained if optim.ema_decay > 0 else 0}


def largest_batch(data, tokens_of: Callable[[int, int, int], int], images: bool = False
                  ) -> list[tuple[int, int, int]]:
    """Clips (frames, H, W) of the fullest micro-batch the data keys allow one rank: the largest clip
    that fits what is left of max_tokens_per_batch, again and again, up to max_samples_per_batch."""
    heights_widths = data.buckets()
    shapes = {(f, h, w) for h, w in heights_widths for f in data.frame_count_range()}
    if images:
        shapes |= {(1, h, w) for h, w in heights_widths}
    sized = sorted(((tokens_of(*s), s) for s in shapes), reverse=True)
    left, clips = data.max_tokens_per_batch, []
    while len(clips) < data.max_samples_per_batch:
        fit = next(((tokens, shape) for tokens, shape in sized if tokens <= left), None)
        if fit is None:
            break
        clips.append(fit[1])
        left -= fit[0]
    return clips


def loader_bytes(data, clips: list[tuple[int, int, int]], channels: int = 3) -> int:
    """Host bytes of decoded uint8 samples in flight: the packer's lookahead, and each decoding
    worker's prefetched share (prefetch_factor batches of max_samples_per_batch in all)."""
    sample = max(f * h * w * channels for f, h, w in clips)
    in_flight = data.packing_lookahead + len(clips)
    if data.packed_dataloader_num_workers:
        in_flight += data.packed_dataloader_prefetch_factor * data.max_samples_per_batch
    return in_flight * sample


def run_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def module_bytes(build: Callable[[], nn.Module], dtype: torch.dtype) -> int:
    """Bytes of a module's parameters and buffers in `dtype`, built on the meta device."""
    with torch.device("meta"):
        module = build()
    return sum(t.numel() for t in (*module.parameters(), *module.buffers())) * dtype.itemsize


def frozen_vae_bytes(cfg, dtype: torch.dtype) -> int:
    """The frozen VAE of a DiT recipe (`vae_type`), as `pan.encoders.vae.build_vae` loads it."""
    from pan.encoders import vae

    if cfg.vae_type == "identity":
        return 0
    if cfg.vae_type == "diffusers":
        cls = vae.diffusers_class(cfg.vae_class)
        return module_bytes(lambda: cls.from_config(cls.load_config(str(vae.vae_dir(cfg)))), dtype)
    from pan.models.causal_vae import CausalVideoVAE
    config = vae.causal_vae_config(cfg)
    return module_bytes(lambda: CausalVideoVAE(config), dtype)


@functools.cache   # building even a meta model imports its modeling code: once per process
def hf_model_bytes(model_dir, dtype: torch.dtype) -> int:
    """A Hugging Face model's bytes in `dtype`, from its config.json alone."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return module_bytes(lambda: AutoModel.from_config(config), dtype)


# ================================================================================================
# The trace: live bytes and work of every operation of a step, on fake tensors
# ================================================================================================

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
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, Tensor)]


def _nbytes(t: Tensor) -> int:
    return t.untyped_storage().nbytes()


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


@dataclass
class Traffic:
    """The collectives of one kind a rank issues in an optimizer step (`step_traffic`)."""
    calls: float
    bytes: float                 # what this rank sends
    across_nodes: bool = False   # over the network between nodes, else within one node


@dataclass
class StepWork:
    """The work of one optimizer step: `micro` per micro-batch (forward, backward, recomputation),
    `accumulation` of them, then the optimizer step (this rank's share); and the step's collectives
    on this rank by kind (none in a single process)."""
    micro: Work
    optimizer: Work
    accumulation: int
    traffic: dict[str, Traffic] = field(default_factory=dict)

    def seconds(self, rates: Rates) -> dict[str, float]:
        """Seconds per step by kind of work, at `rates`."""
        n, m, o = self.accumulation, self.micro, self.optimizer
        return {"matmul": n * m.matmul_flops / rates.matmul,
                "convolution": n * m.conv_flops / rates.convolution if m.conv_flops else 0.0,
                "attention": n * m.attention_flops / rates.attention,
                "memory-bound": n * m.memory_bytes / rates.memory,
                "optimizer": o.matmul_flops / rates.matmul + o.memory_bytes / rates.memory,
                # A small model's thousands of small operations cost more than their arithmetic.
                "per-operation": (n * m.operations + o.operations) * rates.operation,
                "communication": self.communication_seconds(rates)}

    def communication_seconds(self, rates: Rates) -> float:
        if not self.traffic:
            return 0.0
        if rates.network is None:
            raise ValueError("this step has collectives: time it with rates that have a network "
                             "(`with_network`)")
        return sum(rates.network.seconds(t) for t in self.traffic.values())


def _is_attention(func) -> bool:
    name = func.name()
    return "attention" in name and "aten::" in name


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

    def as_gradient(self, t: Tensor) -> None:
        """A parameter's .grad: counted at the share of it FSDP keeps."""
        key = id(t.untyped_storage())
        if key in self.live and self.live[key][1] != "gradients":
            size, kind = self.live[key]
            self.bytes[kind] -= size
            self.bytes["gradients"] += size
            self.live[key] = (size, "gradients")

    # -- work ----------------------------------------------------------------------------------
    def _count(self, func, args, kwargs, out) -> None:
        w = self.work
        w.operations += 1
        if func in MATMUL_OPS:
            a, b = args[-2], args[-1]
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            batch = a.shape[0] if a.dim() == 3 else 1
            w.matmul_flops += 2.0 * batch * m * k * n
            w.largest_gemm = max(w.largest_gemm, (batch * m, k, n), key=math.prod)
        elif func in CONV_OPS:
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
        elif _is_attention(func):
            q = args[0]
            if q.dim() == 4:                      # [B, H, L, d]
                b, h, lq, d = q.shape
                lk = args[1].shape[-2]
            else:                                 # varlen [L, H, d]
                (lq, h, d), b, lk = q.shape, 1, args[1].shape[0]
            passes = 2.5 if "backward" in func.name() else 1.0
            w.attention_flops += passes * 4.0 * b * h * lq * lk * d
            w.longest_attention = max(w.longest_attention, (b * h, lq, d), key=math.prod)
        elif func not in VIEW_LIKE:
            w.memory_bytes += sum(t.numel() * t.element_size() for t in _tensors((args, kwargs, out)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            # A value read back (a logged loss, the VAE's adaptive GAN weight): fake tensors have
            # none. It reads 1; a step's shapes, all the trace needs, do not depend on it.
            return True if args[0].dtype is torch.bool else 1 if not args[0].is_floating_point() else 1.0
        out = func(*args, **kwargs)
        self._count(func, args, kwargs, out)
        kind = "attention" if _is_attention(func) else "activations"
        for t in _tensors(out):
            self._track(t, kind)
        return out


# ================================================================================================
# Fake copies of the parts, parallelised as the trainer would
# ================================================================================================

def fake_copy(model: nn.Module) -> nn.Module:
    """A copy of a meta-device model with fake CPU parameters and buffers (inside FakeTensorMode)."""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                        requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
    return twin


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
    from pan.models.attention import InnerAttention
    from pan.parallel.checkpointing import apply_activation_checkpointing
    from pan.parallel.fsdp import declared_blocks

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
# The estimate
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


@dataclass
class Rates:
    """What this device does per second, measured on the spot; and with several ranks how fast
    their collectives run (`network`: gloo's measured, NCCL's from datasheets)."""
    matmul: float               # FLOP/s of the step's largest GEMM shape
    convolution: float          # FLOP/s of its heaviest convolution (forward; 1.0 when it has none)
    attention: float            # FLOP/s of an attention call (forward + backward) of its longest segment
    memory: float               # bytes/s read + written by an elementwise pass
    operation: float            # seconds of an operation's fixed cost (dispatch, autograd, launch)
    source: str
    network: Network | None = None   # how fast collectives run (`with_network`); None: not timed


@dataclass
class Link:
    """What collectives cost over one kind of link: a fixed cost per call, and the bytes a rank
    sends per second (NCCL's "bus bandwidth")."""
    latency: float
    bandwidth: float
    source: str


@dataclass
class Network:
    """The links of a run: between the ranks of one node, and between nodes."""
    within: Link
    across: Link

    def seconds(self, traffic: Traffic) -> float:
        link = self.across if traffic.across_nodes else self.within
        return traffic.calls * link.latency + traffic.bytes / link.bandwidth

    @property
    def source(self) -> str:
        if self.across == self.within:
            return self.within.source
        return f"within a node {self.within.source}; between nodes {self.across.source}"


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
    mfu: float
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


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
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
        for phase in probe.phases:
            model = models[phase.part]
            for p in trained[phase.part]:
                p.requires_grad_(True)
            handles = [p.register_post_accumulate_grad_hook(lambda p: trace.as_gradient(p.grad))
                       for p in trained[phase.part]]
            with trace, autocast(job.trainer.dtype):
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
    key = (tuple((name, tuple(p.shape), p.dtype) for name, p in model.named_parameters()), repr(optim))
    if key not in _OPTIMIZER_STEPS:
        _OPTIMIZER_STEPS[key] = _trace_optimizer_step(model, optim)
    return _OPTIMIZER_STEPS[key]


_OPTIMIZER_STEPS: dict[tuple, StepTrace] = {}


def _trace_optimizer_step(model: nn.Module, optim) -> StepTrace:
    # Meta tensors, not fake ones: the step's thousands of small operations cost less.
    from pan.optim.builder import build_optimizer

    twin = copy.deepcopy(model).requires_grad_(True)
    optimizer, _ = build_optimizer(twin, optim)
    for p in twin.parameters():
        p.grad = torch.empty_like(p)
    step = StepTrace()
    with step:
        optimizer.step()
    return step


def autocast(dtype: str):
    if dtype == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
    return contextlib.nullcontext()


def static_bytes(ctx, layout: Layout) -> dict[str, int]:
    """Parameters, optimizer states, EMA and FSDP's gathered blocks of every part (the gradients
    come from the trace: how many exist at the peak depends on when it is)."""
    out = {"parameters": 0, "optimizer states": 0, "ema": 0, "fsdp gathered": 0}
    for spec in ctx.part_specs:
        model = ctx.models[spec.name]
        state = state_bytes(model, spec.optim.optim())
        out["parameters"] += state["weights"] // layout.shard
        out["optimizer states"] += (state["muon"] + state["adamw"]) // layout.shard
        out["ema"] += state["ema"] // layout.shard
        if layout.shard > 1:
            blocks, root = unit_sizes(model)
            block = max(blocks, default=0)
            # current + prefetched block, one block's unsharded gradients, the root's own weights
            out["fsdp gathered"] += (2 * block + root) * layout.compute_bytes + block * FP32_BYTES
    return out


def unit_sizes(model: nn.Module) -> tuple[list[int], int]:
    """Parameters of each FSDP unit of a part: of each declared block, and the root's own."""
    from pan.parallel.fsdp import declared_blocks

    blocks = [sum(p.numel() for p in b.parameters()) for b in declared_blocks(model)]
    return blocks, sum(p.numel() for p in model.parameters()) - sum(blocks)


# ================================================================================================
# Communication: the collectives of a step on one rank
# ================================================================================================

# Host numbers summed over the world in each phase: the loss count and the loss
# (`StepContext.backward_mean`), and the gradient norm.
SCALAR_REDUCTIONS_PER_PHASE = 3


def step_traffic(ctx, probe: Probe, layout: Layout, trace: StepTrace, accumulation: int) -> dict[str, Traffic]:
    """The collectives one rank issues in an optimizer step, by kind: FSDP's and Muon's for each
    trained part (of the parameters that got a gradient in the trace), Ulysses' all-to-alls
    (counted by the trace) and the scalar sums. None in a single process."""
    dims, micro = ctx.dims, trace.work
    if dims.world_size == 1:
        return {}
    specs = {spec.name: spec for spec in ctx.part_specs}
    out: dict[str, Traffic] = {}
    for part, graded in trace.graded.items():
        model = ctx.models[part]
        _add(out, parameter_traffic(model, graded, layout, dims, accumulation))
        _add(out, muon_traffic(model, graded, specs[part].optim.optim(), layout, dims))
    if micro.exchanges:   # within the cp group, which sits inside one node
        out["ulysses all-to-all"] = Traffic(accumulation * micro.exchanges, accumulation * micro.exchange_bytes)
    out["scalar all-reduce"] = Traffic(SCALAR_REDUCTIONS_PER_PHASE * len(probe.phases), 0.0,
                                       dims.world_size > dims.local_world_size)
    return out


def _add(into: dict[str, Traffic], more: dict[str, Traffic]) -> None:
    for kind, t in more.items():
        if kind in into:
            into[kind] = Traffic(into[kind].calls + t.calls, into[kind].bytes + t.bytes, t.across_nodes)
        else:
            into[kind] = t


def parameter_traffic(model: nn.Module, graded: set[str], layout: Layout, dims, accumulation: int
                      ) -> dict[str, Traffic]:
    """FSDP2's collectives for one part (`pan.parallel.fsdp.parallelize_model`). Every unit is
    all-gathered in the compute dtype for the forward and again for the backward of each
    micro-batch (a checkpointed block's recomputation uses the backward's gather); the gradients
    (of the `graded` parameters) are reduce-scattered in fp32 once per step, with the last
    micro-batch, and under HSDP or ddp then all-reduced over the replicas (a ring: twice their bytes)."""
    blocks, root = unit_sizes(model)
    units = len(blocks) + (root > 0)
    weights = sum(blocks) + root
    trained = sum(p.numel() for name, p in model.named_parameters() if name in graded)
    shard, replicas = layout.shard, dims.world_size // layout.shard
    out = {}
    if shard > 1:   # each rank sends all but its own 1/shard of a unit
        share, across = (shard - 1) / shard, shard > dims.local_world_size
        out["fsdp all-gather"] = Traffic(2 * accumulation * units,
                                         2 * accumulation * share * weights * layout.compute_bytes, across)
        out["fsdp reduce-scatter"] = Traffic(units, share * trained * FP32_BYTES, across)
    if replicas > 1:
        out["gradient all-reduce"] = Traffic(units, 2 * (replicas - 1) / replicas * trained * FP32_BYTES / shard,
                                             dims.world_size > dims.local_world_size)
    return out


def muon_traffic(model: nn.Module, graded: set[str], optim, layout: Layout, dims) -> dict[str, Traffic]:
    """Muon's orthogonalisation of sharded matrices (`pan.optim.muon.ShardedOrthogonaliser`): they
    go shard x replicas at a time; each round, two all-to-alls over the shard group (each matrix's
    shards to the rank that orthogonalises it, the result's rows back: a rank sends (shard - 1) /
    shard of its rows of its replica's matrices), then an all-gather of the results over the
    replicas. The updates (of the `graded` matrices) are fp32, as the master weights."""
    from pan.optim.builder import split_parameters

    if not optim.use_muon:
        return {}
    groups, _, _ = split_parameters(model, True)
    matrices = [p.numel() for name, p in groups["muon"] if name in graded]
    shard, replicas = layout.shard, dims.world_size // layout.shard
    rounds = math.ceil(len(matrices) / (shard * replicas))
    rows = sum(matrices) * FP32_BYTES / shard           # this rank's rows of every matrix
    out = {}
    if shard > 1 and rounds:
        out["muon all-to-all"] = Traffic(2 * rounds, 2 * (shard - 1) / shard * rows / replicas,
                                         shard > dims.local_world_size)
    if replicas > 1 and rounds:
        out["muon all-gather"] = Traffic(rounds, (replicas - 1) / replicas * rows,
                                         dims.world_size > dims.local_world_size)
    return out


# Sections of a job the traced step does not read: the micro-batch the data keys lead to is the
# probe's, and paths, checkpoints, logging and validation do not change a training step.
UNTRACED_SECTIONS = frozenset({"data", "checkpoint", "logging", "validation", "warm_start"})
MAX_CACHED_TRACES = 32
_TRACES: dict[tuple, tuple[StepTrace, Work]] = {}


def cached_trace_step(ctx, probe: Probe, layout: Layout) -> tuple[StepTrace, Work]:
    """`trace_step`, once per process for each step: a `pan check` of many configs (a test suite,
    the suggested fixes) mostly traces the same step again. The key is every key of the job the step
    reads, the probe's micro-batch and the layout."""
    job = ctx.job
    key = (tuple((f.name, repr(getattr(job, f.name))) for f in dataclasses.fields(job)
                 if f.name not in UNTRACED_SECTIONS),
           probe.describe, probe.tokens, probe.samples, ctx.dims.cp, layout.shard, layout.compute_bytes)
    if key not in _TRACES:
        if len(_TRACES) >= MAX_CACHED_TRACES:
            _TRACES.pop(next(iter(_TRACES)))
        _TRACES[key] = trace_step(ctx, probe, layout)
    return _TRACES[key]


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
    peak_flops, _ = device_peak(ctx.job.trainer.dtype)
    total = sum(device.values())
    return Estimate(device={k: int(v) for k, v in device.items()}, host=host, capacity=cap,
                    capacity_source=source, fits=total <= cap, batch=probe.describe,
                    tokens_per_rank=probe.tokens, step_time=step_time, time_parts=parts,
                    tokens_per_second=tokens_per_step / step_time,
                    run_hours=steps * step_time / 3600, gpu_hours=steps * step_time * dims.world_size / 3600,
                    flops_per_step=flops_per_step,
                    mfu=flops_per_step / step_time / (peak_flops * dims.world_size),
                    rates=rates, work=work)


# ================================================================================================
# The device: capacity and rates
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


def device_peak(dtype: str) -> tuple[float, str]:
    """The peak MFU is measured against (pan.metrics: datasheet on a GPU, measured on the CPU)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return _cached_peak(device, dtype)


@functools.cache
def _cached_peak(device: torch.device, dtype: str) -> tuple[float, str]:
    from pan.metrics import peak_flops
    return peak_flops(device, dtype)


def step_clock(device: torch.device) -> Callable[[], float]:
    """The clock the rates (and a test's steps) are timed with. On a GPU wall seconds, read after
    synchronising; on the CPU the process's CPU seconds over its threads: the clock of the work
    itself, which other processes on a shared machine do not stretch as they stretch the wall."""
    if device.type == "cuda":
        def wall() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()
        return wall
    threads = torch.get_num_threads()
    return lambda: time.process_time() / threads


def _timed(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """Median seconds of `repeats` runs of `fn` (after a warm-up run), on `step_clock`."""
    clock = step_clock(device)
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return sorted(times)[len(times) // 2]


# Shapes measured on the spot are capped: the rate of a larger one is no higher on a CPU, and a
# GPU reaches its rate well below these.
MAX_MEASURED_ROWS = 2048
MAX_MEASURED_WIDTH = 4096


def rates_for(work: Work, dtype: str) -> Rates:
    """`measure_rates` for the shapes of `work`, once per process for each."""
    return _cached_rates(work.largest_gemm, work.longest_attention, work.main_convs(), dtype)


@functools.cache
def _cached_rates(gemm: tuple[int, int, int], attention_shape: tuple[int, int, int], convs: tuple,
                  dtype: str) -> Rates:
    return measure_rates(gemm, attention_shape, convs, dtype)


def measure_rates(gemm: tuple[int, int, int], attention_shape: tuple[int, int, int], convs: tuple,
                  dtype: str) -> Rates:
    """Rates of the step's largest GEMM (M, K, N), of attention (heads, length, head dim) forward +
    backward, of its main convolutions (`Work.main_convs`; none: ()), and of an elementwise pass."""
    device = run_device()
    compute = torch.bfloat16 if dtype == "bf16" else torch.float32
    m, k, n = (min(x, cap) for x, cap in zip(gemm, (MAX_MEASURED_ROWS, MAX_MEASURED_WIDTH, MAX_MEASURED_WIDTH)))
    a, b = torch.randn(m, k, device=device, dtype=compute), torch.randn(k, n, device=device, dtype=compute)
    matmul = 2.0 * m * k * n / _timed(lambda: a @ b, device)
    heads, length, dim = attention_shape
    length = min(length, MAX_MEASURED_ROWS)
    # Heads run one after the other on a CPU: one long one times the rate as well as many.
    most_heads = 1 if device.type == "cpu" else MAX_MEASURED_ROWS * 16 // length
    heads = min(heads, max(1, most_heads))
    q = torch.randn(1, heads, length, dim, device=device, dtype=compute, requires_grad=True)

    def attend():
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        out.backward(torch.ones_like(out))
    attention = 3.5 * 4.0 * heads * length * length * dim / _timed(attend, device)
    # Elementwise work runs on activations: a pass over one of the size of the largest GEMM's output.
    x = torch.randn(min(gemm[0] * gemm[2], 8 * 2 ** 20), device=device, dtype=compute)
    memory = 3 * x.numel() * x.element_size() / _timed(lambda: torch.add(x, x), device)
    operation = operation_seconds(device)
    # The rate of their FLOPs together: each shape's time at its own rate.
    convolution = (sum(f for _, f in convs) / sum(f / convolution_rate(spec, device, compute) for spec, f in convs)
                   if convs else 1.0)
    what = "GPU" if device.type == "cuda" else "CPU"
    conv_text = f"convolution ({len(convs)} shapes) {convolution / 1e9:,.1f} GFLOP/s, " if convs else ""
    return Rates(matmul, convolution, attention, memory, operation,
                 f"measured here on the {what}: {m}x{k}x{n} matmul {matmul / 1e9:,.1f} GFLOP/s, "
                 f"{conv_text}attention over {length} tokens {attention / 1e9:,.1f} GFLOP/s, elementwise "
                 f"{memory / 1e9:,.1f} GB/s, {operation * 1e6:,.1f} us per operation")


CONV_SHARE, MAX_TIMED_CONVS = 0.8, 6
MAX_MEASURED_CONV_INPUT = 2 ** 22     # elements: the batch, then the first spatial axis are cut to this


def convolution_rate(spec: tuple, device: torch.device, compute: torch.dtype) -> float:
    """FLOP/s of a forward convolution of one shape (`Work.conv_shapes`), capped in size."""
    shape, weight_shape, stride, padding, dilation, groups = spec
    batch = max(1, min(shape[0], MAX_MEASURED_CONV_INPUT // math.prod(shape[1:])))
    per_row = math.prod(shape[1:]) // shape[2]
    rows = max(min(shape[2], MAX_MEASURED_CONV_INPUT // per_row), weight_shape[2])
    x = torch.randn(batch, shape[1], rows, *shape[3:], device=device, dtype=compute)
    weight = torch.randn(weight_shape, device=device, dtype=compute)

    def convolve():
        return aten.convolution(x, weight, None, stride, padding, dilation, False, [0] * len(stride), groups)
    out = convolve()
    return 2.0 * math.prod(weight_shape[1:]) * out.numel() / _timed(convolve, device)


def operation_seconds(device: torch.device) -> float:
    """The fixed cost of one operation: a chain of them on a few numbers, forward and backward,
    timed, over the operations the trace counts in it."""
    x = torch.ones(8, device=device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(100):
            y = y * 1.5
        y.sum().backward()
    counter = StepTrace()
    with counter:
        chain()
    return _timed(chain, device) / counter.work.operations


# ------------------------------------------------------------------------------------------------
# Collectives: gloo measured here, NCCL from datasheets
# ------------------------------------------------------------------------------------------------

# A GPU check cannot time the links between GPUs from one GPU, so a CUDA run's collectives take
# datasheet figures, not measured ones: NVLink 4 of an H100 / H200 SXM node moves 450 GB/s each way
# per GPU, and one 400 Gb/s InfiniBand NDR port per GPU 50 GB/s; a collective is taken to reach 80%
# of that, with a fixed cost per call of 10 us within a node and 20 us between nodes (assumed).
NVLINK = Link(10e-6, 0.8 * 450e9, "NCCL over NVLink 4, datasheet 450 GB/s x 0.8 and 10 us per call "
                                  "(not measured)")
INFINIBAND = Link(20e-6, 0.8 * 50e9, "NCCL over 400 Gb/s InfiniBand per GPU, datasheet 50 GB/s x 0.8 "
                                     "and 20 us per call (not measured)")

# The all-to-alls gloo is timed with: bytes of each rank's input, calls per timing, timings (median).
SMALL_EXCHANGE, LARGE_EXCHANGE = 2 ** 10, 2 ** 22
EXCHANGE_CALLS, EXCHANGE_ROUNDS = 8, 5


def with_network(rates: Rates, network: Network) -> Rates:
    return dataclasses.replace(rates, network=network, source=f"{rates.source}; collectives: {network.source}")


def network_of_this_machine() -> Network:
    """`measure_network`, once per process."""
    return _cached_network(run_device().type)


@functools.cache
def _cached_network(device_type: str) -> Network:
    return measure_network()


def measure_network() -> Network:
    """The links of the backend a run here uses: NCCL's on a GPU (datasheet figures), gloo's on
    the CPU (measured now; between nodes a real network is slower than this machine's loopback)."""
    if run_device().type == "cuda":
        return Network(NVLINK, INFINIBAND)
    link = measure_gloo_link()
    return Network(link, link)


def measure_gloo_link() -> Link:
    """gloo's cost per call and bandwidth: two ranks in two threads of this process all-to-all
    SMALL_EXCHANGE and LARGE_EXCHANGE bytes each (an all-to-all of two ranks sends half of it)."""
    small, large = _gloo_alltoall_seconds((SMALL_EXCHANGE, LARGE_EXCHANGE))
    bandwidth = (LARGE_EXCHANGE - SMALL_EXCHANGE) / 2 / max(large - small, 1e-9)
    return Link(small, bandwidth, f"gloo measured here between two threads: {small * 1e6:,.0f} us per call, "
                                  f"{bandwidth / 1e9:,.2f} GB/s sent per rank")


def _gloo_alltoall_seconds(sizes: tuple[int, ...]) -> list[float]:
    """Seconds of one rank's all-to-all of each of `sizes` bytes, over a gloo group of two threads of
    this process (an in-memory store). On the clock of the CPU rates: the process's CPU seconds
    (both ranks' and gloo's own threads), halved for one rank; the median of EXCHANGE_ROUNDS."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.HashStore()
    turn = threading.Barrier(3, timeout=60)     # the two ranks, and this thread reading the clock

    def rank(r: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=60))
            pairs = [(torch.zeros(n // FP32_BYTES), torch.empty(n // FP32_BYTES)) for n in sizes]
            for x, y in pairs:                  # untimed: connections, buffers
                group.alltoall_base(y, x, [], []).wait()
            for _ in range(EXCHANGE_ROUNDS):
                for x, y in pairs:
                    turn.wait()
                    for _ in range(EXCHANGE_CALLS):
                        group.alltoall_base(y, x, [], []).wait()
                    turn.wait()
        except BaseException:
            turn.abort()                        # nobody waits for a rank that failed
            raise

    seconds: list[list[float]] = [[] for _ in sizes]
    with ThreadPoolExecutor(2) as pool:
        ranks = [pool.submit(rank, r) for r in range(2)]
        try:
            for _ in range(EXCHANGE_ROUNDS):
                for timings in seconds:
                    turn.wait()
                    t0 = time.process_time()
                    turn.wait()
                    timings.append((time.process_time() - t0) / (2 * EXCHANGE_CALLS))
        except threading.BrokenBarrierError:
            for r in ranks:
                r.result()                      # a rank's own error, if one failed
            raise
    return [sorted(t)[len(t) // 2] for t in seconds]


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


def fitting_changes(ctx, estimate: Estimate, rebuild: Callable[[object], object]) -> list[Change]:
    """Every single change that makes the run fit, the cheapest first: the highest tokens per second
    (a smaller token budget, which changes the batch, comes last whatever its speed).
    `rebuild(job)` makes the Preflight of a changed job on the same layout."""
    from pan.config import ConfigError

    def fitting(job):
        try:
            job.parallel.check(job)
            est = rebuild(job).estimate
        except (ConfigError, ValueError):   # a layout or budget that this job cannot have
            return None
        return est if est.fits else None

    found = [Change(keys, est) for keys, job in candidate_jobs(ctx) if (est := fitting(job)) is not None]
    found.sort(key=lambda c: -c.estimate.tokens_per_second)
    budget = smaller_budget(ctx, estimate)
    if budget is not None and (est := fitting(budget[1])) is not None:
        found.append(Change(budget[0], est))
    return found
