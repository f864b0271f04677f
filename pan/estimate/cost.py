"""What a traced step costs in seconds: the rates of this machine's device measured on the spot
(matmul, convolution, attention, elementwise, per operation; the clock they are timed with), the
collectives a rank issues in a step (`step_traffic`) and the links they run over (gloo measured
here, NCCL from datasheets)."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pan.estimate.probe import FP32_BYTES, Probe, run_device, unit_sizes
from pan.estimate.trace import Layout, StepTrace, TracedStep, Work, aten
from pan.runtime.metrics import peak_flops
from pan.optim.builder import split_parameters


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


# ================================================================================================
# Communication: the collectives of a step on one rank
# ================================================================================================

# Host numbers summed over the world in each phase: the loss count and the loss
# (`StepContext.backward_mean`), and the gradient norm.
SCALAR_REDUCTIONS_PER_PHASE = 3


def step_traffic(ctx, probe: Probe, layout: Layout, trace: TracedStep, accumulation: int) -> dict[str, Traffic]:
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


# ================================================================================================
# The device: its rates, measured on the spot
# ================================================================================================

def device_peak(dtype: str) -> tuple[float, str]:
    """The peak MFU is measured against (pan.runtime.metrics: datasheet on a known GPU, else the
    fastest measured matmul of the run's dtypes, measured once per process)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
    matmul = matmul_rate(m, k, n, device, compute)
    heads, length, dim = attention_shape
    length = min(length, MAX_MEASURED_ROWS)
    # Heads run one after the other on a CPU: one long one times the rate as well as many.
    most_heads = 1 if device.type == "cpu" else MAX_MEASURED_ROWS * 16 // length
    heads = min(heads, max(1, most_heads))
    attention = attention_rate(heads, length, dim, device, compute)
    # Elementwise work runs on activations: a pass over one of the size of the largest GEMM's output.
    memory = memory_rate(min(gemm[0] * gemm[2], 8 * 2 ** 20), device, compute)
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


def matmul_rate(m: int, k: int, n: int, device: torch.device, compute: torch.dtype) -> float:
    a, b = torch.randn(m, k, device=device, dtype=compute), torch.randn(k, n, device=device, dtype=compute)
    return 2.0 * m * k * n / _timed(lambda: a @ b, device)


def attention_rate(heads: int, length: int, dim: int, device: torch.device, compute: torch.dtype) -> float:
    q = torch.randn(1, heads, length, dim, device=device, dtype=compute, requires_grad=True)

    def attend():
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        out.backward(torch.ones_like(out))
    return 3.5 * 4.0 * heads * length * length * dim / _timed(attend, device)


def memory_rate(numel: int, device: torch.device, compute: torch.dtype) -> float:
    x = torch.randn(numel, device=device, dtype=compute)
    return 3 * x.numel() * x.element_size() / _timed(lambda: torch.add(x, x), device)


MAX_MEASURED_CONV_INPUT = 2 ** 22     # elements: the batch, then the first spatial axis are cut to this


def convolution_rate(spec: tuple, device: torch.device, compute: torch.dtype) -> float:
    """FLOP/s of a forward convolution of one shape (`Work.conv_shapes`), capped in size."""
    shape, weight_shape, stride, padding, dilation, groups = spec
    batch = max(1, min(shape[0], MAX_MEASURED_CONV_INPUT // math.prod(shape[1:])))
    per_row = math.prod(shape[1:]) // shape[2]
    rows = max(min(shape[2], MAX_MEASURED_CONV_INPUT // per_row), weight_shape[2])
    return _convolution_rate((batch, shape[1], rows, *shape[3:]), tuple(weight_shape), tuple(stride),
                             tuple(padding), tuple(dilation), groups, device, compute)


# Timed once per process for each (capped) shape: `pan check` plans a run again for every change it
# tries, and a VAE's convolutions (several seconds of timing) rarely change shape between them. The
# cheap rates above are timed again for each new set of shapes, close to the step they estimate.
@functools.cache
def _convolution_rate(shape: tuple, weight_shape: tuple, stride: tuple, padding: tuple, dilation: tuple,
                      groups: int, device: torch.device, compute: torch.dtype) -> float:
    x = torch.randn(shape, device=device, dtype=compute)
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


# ================================================================================================
# Collectives: gloo measured here, NCCL from datasheets
# ================================================================================================

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
