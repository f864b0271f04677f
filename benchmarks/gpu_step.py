"""One-GPU training step of a ~2B-parameter Pan transformer: step time, tokens/s, MFU, peak memory.

The step is the trainer's: bf16 autocast over fp32 master weights (`pan.trainer.autocast_context`),
the varlen flash attention backend, one packed batch of ~32k tokens (video clips and an image of
different (t, h, w), each with a caption), gradient clipping, then AdamW or Muon+AdamW as built by
`pan.optim.builder.build_optimizer`. Each mode (optimizer / activation checkpointing / attention
backend) gets a fresh model; a mode that fails (out of memory, a kernel refusing its inputs) is
reported with its error, the next one runs, and the script exits 1 at the end. MFU is the model's
FLOPs (3 x `model.forward_flops`) over the datasheet peak of the GPU (`pan.runtime.metrics.peak_flops`). The
dtypes of q/k/v reaching the first attention call are recorded (varlen needs bf16 for all three).

    python -m benchmarks.gpu_step [--steps 8] [--out benchmarks/results/gpu_step.json]   # a GPU box
    OMP_NUM_THREADS=2 python -m benchmarks.gpu_step --tiny                               # CPU check
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    from benchmarks.common import median, print_table, time_call, write_json
except ModuleNotFoundError:  # run as `python benchmarks/gpu_step.py`: its folder is on the path
    from common import median, print_table, time_call, write_json
from pan.runtime.metrics import peak_flops
from pan.models import PackInfo, PanDiTConfig, PanVideoDiffusionTransformer
from pan.models.attention import InnerAttention
from pan.optim.builder import build_optimizer
from pan.optim.config import OptimConfig
from pan.parallel.checkpointing import apply_activation_checkpointing
from pan.parallel.fsdp import clip_grad_norm
from pan.task import autocast_context

# (post-patch grid (t, h, w), caption rows) per sample: 3 clips and one image, 31,456 video tokens
# + 469 caption rows = 31,925 tokens.
FULL_BATCH = [((11, 24, 42), 128), ((16, 22, 40), 77), ((6, 16, 28), 200), ((1, 45, 80), 64)]
TINY_BATCH = [((2, 4, 4), 7), ((3, 2, 4), 5), ((1, 6, 6), 3)]


@dataclass
class Mode:
    """One measured configuration, written optimizer/checkpointing/attention (adamw/none/varlen)."""
    optimizer: str
    checkpointing: str
    attention: str

    @property
    def name(self) -> str:
        return f"{self.optimizer}/{self.checkpointing}/{self.attention}"

    @classmethod
    def parse(cls, text: str) -> Mode:
        parts = text.split("/")
        choices = (("adamw", "muon"), ("none", "selective", "full"), ("varlen", "sdpa", "auto"))
        if len(parts) != 3 or any(p not in c for p, c in zip(parts, choices)):
            raise argparse.ArgumentTypeError(f"{text!r} is not optimizer/checkpointing/attention with "
                                             f"choices {choices}")
        return cls(*parts)


def arch(hidden: int, heads: int, layers: int, refiner: int, tiny: bool) -> PanDiTConfig:
    """The released Pan architecture (channels, patch, MLP ratios, text width) at another size."""
    # RoPE split of the head dim as Pan's [16, 56, 56] of 128: 1/8 for time, the rest for h and w
    # (every part even).
    head_dim = hidden // heads
    t_axis = max(2, head_dim // 16 * 2)
    h_axis = (head_dim - t_axis) // 4 * 2
    rope = [t_axis, h_axis, head_dim - t_axis - h_axis]
    extra = {"in_channels": 8, "out_channels": 4, "text_embed_dim": 32} if tiny else {}
    return PanDiTConfig(hidden_size=hidden, num_attention_heads=heads, num_layers=layers,
                        num_single_layers=0, num_refiner_layers=refiner, rope_axes_dim=rope, **extra)


def parameter_count(cfg: PanDiTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in PanVideoDiffusionTransformer(cfg).parameters())


def layers_for(target_params: float, hidden: int, heads: int, refiner: int, tiny: bool) -> int:
    """The number of double-stream blocks that brings the model closest to `target_params`."""
    one, two = (parameter_count(arch(hidden, heads, n, refiner, tiny)) for n in (1, 2))
    per_block = two - one
    return max(1, round((target_params - (one - per_block)) / per_block))


def packed_batch(cfg: PanDiTConfig, samples: list, device: torch.device) -> dict:
    """Random inputs of one packed batch (the step's cost does not depend on the values)."""
    grids, text_lens = [g for g, _ in samples], [n for _, n in samples]
    pack = PackInfo.build(grids, text_lens, device=device)
    nv, nt = sum(t * h * w for t, h, w in grids), sum(text_lens)
    pv = cfg.patch_volume
    return {"pack": pack, "x": torch.randn(nv, cfg.in_channels * pv, device=device),
            "target": torch.randn(nv, cfg.out_channels * pv, device=device),
            "text": torch.randn(nt, cfg.text_embed_dim, device=device),
            "sigmas": torch.rand(len(samples), device=device), "tokens": nv + nt}


def training_step(model, optimizer, batch: dict, device: torch.device):
    def step():
        with autocast_context("bf16", device):
            out = model(batch["x"], batch["sigmas"], batch["text"], batch["pack"])
        F.mse_loss(out.float(), batch["target"]).backward()
        clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB, the process's RSS


def record_attention_dtypes(model: PanVideoDiffusionTransformer, seen: dict) -> None:
    """Fill `seen` with the q/k/v dtypes of the model's first attention call (the refiner's, or the
    first block's), before the backend sees them."""
    def record(module, inputs):
        if not seen:
            seen.update(zip("qkv", (str(t.dtype).removeprefix("torch.") for t in inputs[:3])))

    for module in model.modules():
        if isinstance(module, InnerAttention):
            module.register_forward_pre_hook(record)


def measure(cfg: PanDiTConfig, samples: list, mode: Mode, args: argparse.Namespace,
            device: torch.device, qkv_dtypes: dict) -> dict:
    """Build a fresh model and optimizer, run warm-up steps, then time `args.steps` steps."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = PanVideoDiffusionTransformer(cfg, attention_backend=mode.attention)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    record_attention_dtypes(model, qkv_dtypes)
    if mode.checkpointing != "none":
        apply_activation_checkpointing(model.fsdp_blocks(), selective=mode.checkpointing == "selective")
    optimizer, _ = build_optimizer(model, OptimConfig(use_muon=mode.optimizer == "muon",
                                                      learning_rate=1e-4))
    batch = packed_batch(cfg, samples, device)
    step = training_step(model, optimizer, batch, device)
    build_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        step()
    times = [time_call(step)[0] for _ in range(args.steps)]  # wall seconds, CUDA synchronised
    step_s = median(times)
    flops = 3 * model.forward_flops(batch["pack"])
    return {"build_s": build_s, "step_s": step_s, "min_step_s": min(times), "tokens": batch["tokens"],
            "tokens_per_s": batch["tokens"] / step_s, "tflop_per_step": flops / 1e12,
            "achieved_tflops": flops / step_s / 1e12, "peak_mem_gib": peak_memory_gib(device),
            "step_times": times}


def measure_mode(cfg: PanDiTConfig, samples: list, mode: Mode, args: argparse.Namespace,
                 device: torch.device) -> dict:
    """One mode's row: its measurements, or the error that stopped it."""
    row, qkv_dtypes = {"mode": mode.name}, {}
    try:
        row |= measure(cfg, samples, mode, args, device, qkv_dtypes)
    except (torch.cuda.OutOfMemoryError, RuntimeError, ValueError) as e:
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    finally:
        gc.collect()  # the model, optimizer and activations of this mode are garbage now
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    # Known after the first forward, also when the attention call itself failed.
    row["qkv_dtypes"] = " ".join(f"{k}:{v}" for k, v in qkv_dtypes.items())
    return row


def default_modes(device: torch.device) -> list[Mode]:
    """Both optimizers, selective checkpointing (in case the plain step does not fit), and the SDPA
    reference backend beside varlen; on CPU (no varlen kernel) all with SDPA."""
    if device.type != "cuda":
        return [Mode("adamw", "none", "sdpa"), Mode("muon", "none", "sdpa"),
                Mode("adamw", "selective", "sdpa")]
    return [Mode("adamw", "none", "varlen"), Mode("muon", "none", "varlen"),
            Mode("adamw", "selective", "varlen"), Mode("adamw", "none", "sdpa")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="a ~100k-parameter model and ~100 tokens, to check the script on CPU")
    parser.add_argument("--params", type=float, default=2e9,
                        help="target parameter count (sets the number of double-stream blocks)")
    parser.add_argument("--hidden", type=int, default=2048, help="transformer width")
    parser.add_argument("--heads", type=int, default=16, help="attention heads")
    parser.add_argument("--refiner-layers", type=int, default=2, help="caption refiner blocks")
    parser.add_argument("--modes", nargs="+", type=Mode.parse, default=None,
                        help="optimizer/checkpointing/attention, e.g. adamw/none/varlen muon/full/sdpa "
                             "(default: see default_modes)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per mode")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode")
    parser.add_argument("--out", default="benchmarks/results/gpu_step.json", help="JSON output path")
    args = parser.parse_args()
    if args.tiny:
        args.hidden, args.heads, args.refiner_layers, args.params = 64, 4, 1, 1e5

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    modes = args.modes or default_modes(device)
    samples = TINY_BATCH if args.tiny else FULL_BATCH
    layers = layers_for(args.params, args.hidden, args.heads, args.refiner_layers, args.tiny)
    cfg = arch(args.hidden, args.heads, layers, args.refiner_layers, args.tiny)
    params = parameter_count(cfg)
    peak, peak_source = peak_flops(device, "bf16")
    print(f"model: hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads of {cfg.head_dim}, "
          f"{layers} double-stream blocks (closest to {args.params:.3g} parameters), "
          f"{cfg.num_refiner_layers} refiner blocks, MLP ratios {cfg.mlp_ratio}/{cfg.text_mlp_ratio}: "
          f"{params / 1e6:,.1f}M parameters")
    print(f"batch: {len(samples)} samples, grids {[g for g, _ in samples]}, captions "
          f"{[n for _, n in samples]}; device {device} (peak for MFU: {peak / 1e12:.3g} TFLOP/s, "
          f"{peak_source})", flush=True)

    rows = []
    for mode in modes:
        row = measure_mode(cfg, samples, mode, args, device)
        if "error" not in row:
            row["mfu"] = row["achieved_tflops"] * 1e12 / peak
        rows.append(row)
        print(f"  {mode.name}: " + (row["error"] if "error" in row else
                                    f"{row['step_s']:.3f} s/step, MFU {100 * row['mfu']:.1f}%")
              + f" (attention inputs {row['qkv_dtypes'] or 'not reached'})", flush=True)

    print(f"\nmedian of {args.steps} steps after {args.warmup} warm-up steps:")
    print_table([r for r in rows if "error" not in r],
                ["mode", "step_s", "min_step_s", "tokens", "tokens_per_s", "tflop_per_step",
                 "achieved_tflops", "mfu", "peak_mem_gib", "build_s", "qkv_dtypes"])
    path = write_json(args.out, {
        "benchmark": "gpu_step", "tiny": args.tiny, "device": str(device), "peak_flops": peak,
        "peak_source": peak_source, "params": params, "layers": layers,
        "arch": {k: getattr(cfg, k) for k in ("hidden_size", "num_attention_heads", "num_layers",
                                              "num_refiner_layers", "mlp_ratio", "text_mlp_ratio",
                                              "in_channels", "out_channels", "patch_size",
                                              "text_embed_dim", "rope_axes_dim")},
        "samples": [{"grid": g, "caption": n} for g, n in samples], "warmup": args.warmup,
        "steps": args.steps, "rows": rows})
    print(f"wrote {path}")
    failed = [r["mode"] for r in rows if "error" in r]
    if failed:
        print(f"failed modes: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
