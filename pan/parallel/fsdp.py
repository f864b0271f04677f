"""Apply parallelism to a single-device model from outside: init, checkpointing, compile, CP, FSDP2.

The trainer calls, in this order:

    with torch.device("meta"):
        model = task.build_model()
    model = materialize_and_init(model, world.device, job.trainer.seed, mesh)
    model = parallelize_model(model, mesh, dims, job.parallel, job.trainer)
    ...
    set_gradient_sync(model, last_micro_batch)      # around each backward
    grad_norm = clip_grad_norm(model, max_norm)     # before the optimizer step

Gradients are SUMMED over all ranks (data-parallel and cp): the trainer divides each rank's loss by
the global count of loss elements, so the sum of the ranks' gradients is the gradient of the global
batch, for any layout.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from pan.logging import get_logger
from pan.parallel.checkpointing import apply_activation_checkpointing
from pan.parallel.context_parallel import attach_ulysses
from pan.parallel.dims import ParallelConfig, ParallelDims
from pan.parallel.mesh import cp_group, fsdp_mesh
from pan.parallel.precision import compute_precision

# Models up to this many parameters are initialised whole on the host of every rank (4 bytes each,
# so 8 GB per process at the limit) and then sharded: the weights are then bit-identical for every
# layout. Larger ones are initialised shard by shard after `fully_shard` (same distribution, but the
# values depend on the layout; runs of that size start from a seed checkpoint to compare layouts).
FULL_INIT_MAX_PARAMS = 2_000_000_000

def declared_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks the model declares with `fsdp_blocks()`, in forward order: each is one FSDP unit
    (one all-gather, one reduce-scatter) and one activation-checkpointing / compile unit. A model
    without blocks (a small discriminator) is sharded as a whole."""
    if not hasattr(model, "fsdp_blocks"):
        raise TypeError(f"{type(model).__name__} does not declare fsdp_blocks(): the recipe contract "
                        "(pan/task.py) asks every trained model for its list of blocks.")
    return list(model.fsdp_blocks())


def _is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _init_weights(model: nn.Module, seed: int, device: torch.device = torch.device("cpu")) -> None:
    # A private RNG stream: the init is a function of the seed alone, and the caller's RNG state
    # (data order, noise; on CUDA too) is left as it was.
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.manual_seed(seed)
        model.init_weights()


def shard_init_seed(seed: int, shard_mesh: DeviceMesh) -> int:
    """The seed a rank initialises its parameter shards from, shard by shard (models over
    FULL_INIT_MAX_PARAMS).

    CUDA: `seed` on every rank. DTensor's RNG tracker places each shard's draw at its own offset of
    one Philox stream, so the shards are the slices of one draw of the whole tensor.
    CPU: DTensor has no RNG tracker there; every rank draws its local shard from its own CPU
    generator, so ranks seeded alike would hold identical shards (every weight a repeated block of
    rows). Each shard gets its own seed instead: independent draws of the same distributions, which
    is what the unsharded init gives. Replicas of a shard (HSDP, ddp) share its seed and stay equal.
    """
    if shard_mesh.device_type == "cuda":
        return seed
    shard = shard_mesh.get_coordinate()[-1]   # the last mesh dimension is the one FSDP shards over
    return seed + 1_000_003 * shard


def materialize_and_init(model: nn.Module, device: torch.device, seed: int,
                         mesh: DeviceMesh | None) -> nn.Module:
    """Real, initialised weights for a model built on the meta device (or re-initialised from `seed`).

    Up to FULL_INIT_MAX_PARAMS parameters (or without a mesh): the whole model is materialised on
    the CPU and initialised from `seed` identically on every rank; `parallelize_model` then keeps
    each rank's shard (FSDP2 moves it to the mesh's device). Without a mesh the model moves to
    `device`. Larger models stay on the meta device here and `parallelize_model` initialises them
    shard by shard after `fully_shard`.
    """
    count = sum(p.numel() for p in model.parameters())
    if mesh is not None and count > FULL_INIT_MAX_PARAMS and _is_meta(model):
        get_logger().info("model has %.2fB parameters: initialising it shard by shard after "
                          "fully_shard", count / 1e9)
        return model
    if _is_meta(model):
        model.to_empty(device="cpu")
    _init_weights(model, seed)
    return model.to(device) if mesh is None else model


def mixed_precision_policy(dtype: str) -> MixedPrecisionPolicy:
    """bf16: parameters all-gathered in bf16, gradients reduced in fp32 (fp32 master weights kept).

    Forward inputs are left as they are (`cast_forward_inputs=False`); autocast picks each op's dtype,
    as it does for the unsharded model (`autocast_forward`). FSDP's own cast would (1) turn fp32
    inputs such as the timesteps into bf16 before the model sees them (sigma 0.5012 -> 0.5, so t =
    500 after the x1000 instead of 501.2), and (2) run, in a profiler range, inside the recompute of
    a selectively checkpointed block but outside its forward, which the recompute refuses
    ("_record_function_enter_new ... not found in storage").
    """
    if dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False)
    return MixedPrecisionPolicy()


def autocast_forward(model: nn.Module, device_type: str) -> None:
    """Run every forward of `model` under bf16 autocast (without its weight cache, as the train step).

    With bf16 parameters and fp32 inputs, ops outside autocast would mix dtypes; the trainer's step
    already runs under autocast (nesting it changes nothing), and this covers the other callers:
    validation, sampling during training, benchmarks.
    """
    active: list[torch.autocast] = []

    def enter(module, args):
        active.append(compute_precision("bf16", device_type))
        active[-1].__enter__()

    def leave(module, args, output):
        active.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter, prepend=True)
    model.register_forward_hook(leave, always_call=True)


def parallelize_model(model: nn.Module, mesh: DeviceMesh | None, dims: ParallelDims,
                      parallel_cfg: ParallelConfig, trainer_cfg) -> nn.Module:
    """Activation checkpointing, torch.compile, Ulysses CP and FSDP2/HSDP, in that order (in place).

    FSDP2 shards every transformer block and then the root over `fsdp_mesh` (dp_shard x cp, with
    dp_replicate as the HSDP replica dimension; ddp = shards of one rank), reshards after forward,
    and sums gradients over all ranks. A world of one gets only checkpointing and compile.
    `trainer_cfg` supplies `dtype`, `compile_transformer` and `seed` (for shard-wise init).
    """
    blocks = declared_blocks(model)
    if parallel_cfg.enable_gradient_checkpointing:
        # A model may checkpoint only some of its blocks (Pyramid-Flow's gradient_checkpointing_ratio).
        chosen = model.checkpointed_blocks() if hasattr(model, "checkpointed_blocks") else blocks
        apply_activation_checkpointing(chosen, parallel_cfg.use_dedicated_gradient_checkpointing)
    if trainer_cfg.compile_transformer:
        for block in blocks:
            block.compile()  # in place: parameter names stay the same
    if mesh is None:
        return model
    if dims.cp > 1:
        attach_ulysses(model, cp_group(mesh))
    shard_mesh = fsdp_mesh(mesh, dims, parallel_cfg.data_parallel_mode)
    options = dict(mesh=shard_mesh, reshard_after_forward=True,
                   mp_policy=mixed_precision_policy(trainer_cfg.dtype))
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum, not mean, over ranks (see the module docstring). Plain SUM collectives: a divide
            # factor otherwise becomes ReduceOp.PREMUL_SUM, which gloo lacks.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    if trainer_cfg.dtype == "bf16":
        autocast_forward(model, mesh.device_type)
    if _is_meta(model):
        model.to_empty(device=mesh.device_type)
        _init_weights(model, shard_init_seed(trainer_cfg.seed, shard_mesh), _device_of(mesh))
    return model


def _device_of(mesh: DeviceMesh) -> torch.device:
    """This rank's device of the mesh (its current CUDA device, or the CPU)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Reduce gradients in the coming backward (last micro-batch) or only accumulate them locally."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> float:
    """Global L2 norm of all gradients (sharded or not) before clipping; clip to `max_norm` if > 0.

    The norm is reduced to a host number first and the scale applied as a Python float, so every
    layout scales by exactly the same factor (and no op consumes a pending DTensor reduction).
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # the shards' squared norms summed over the mesh
    norm = total.item()
    scale = max_norm / (norm + 1e-6) if max_norm else 1.0  # torch's clip_grad_norm_ formula
    if scale < 1.0:
        torch._foreach_mul_(grads, scale)
    return norm
