"""fp32 training-step time: PanVideoDiffusionTransformer vs diffusers' HunyuanVideoTransformer3DModel.

Both models get the same width, heads, double-stream depth, refiner depth, MLP ratio and tokens
(2 samples x 1344 video tokens + a short caption); one step = forward, MSE loss, backward, AdamW step.
Steps of the two models and an fp32 matmul probe are timed round-robin in one run (median of the
repeats), so the speed ratio and the fraction of the matmul peak do not depend on the machine's drift.
Both wall time and this process's CPU time are reported: on a CPU shared with other jobs the CPU
time is the trustworthy one (it counts only this benchmark's work). `--compile` adds pan with
`compile_transformer` (torch.compile per block) to the same rounds.

`*_kernel_share` is the fraction of a step's CPU time inside the dense kernels (BLAS matmuls and the
fused attention kernels, from torch.profiler), and `speedup_bound` the ratio pan would reach against
the reference if it spent no time outside them: the ceiling for any eager implementation that calls
the same kernels with the same shapes.

    OMP_NUM_THREADS=2 python -m benchmarks.step_time [--repeats 5] [--compile] [--out benchmarks/results/step_time.json]
    python -m benchmarks.step_time --device cuda --dtype bf16 --samples 8 --sizes 1024x8x2,2048x8x2   # a GPU
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

try:
    from benchmarks.common import interleaved_times, kernel_share, matmul_probe, median, print_table, write_json
except ModuleNotFoundError:  # run as `python benchmarks/step_time.py`: its folder is on the path
    from common import interleaved_times, kernel_share, matmul_probe, median, print_table, write_json
from pan.models import PackInfo, PanDiTConfig, PanVideoDiffusionTransformer, patchify

LATENT = (16, 7, 24, 32)        # [C, T, H, W] per sample -> (7, 12, 16) = 1344 tokens at patch (1, 2, 2)
CAPTION, HEAD_DIM = 32, 64
SIZES = "256x4x1,512x6x2"       # hidden x double-stream blocks x refiner blocks, comma-separated


class Setup:
    """Where and how the step runs: set once from the command line."""
    device = torch.device("cpu")
    bf16 = False                 # bf16 autocast over fp32 weights (the trainer's dtype: bf16)
    samples = 2


def on(t: torch.Tensor) -> torch.Tensor:
    return t.to(Setup.device)


def build_pan(hidden: int, layers: int, refiner: int, compiled: bool = False
              ) -> tuple[torch.nn.Module, callable, int]:
    c, t, h, w = LATENT
    cfg = PanDiTConfig(in_channels=c, out_channels=c, patch_size=[1, 2, 2], hidden_size=hidden,
                       num_attention_heads=hidden // HEAD_DIM, num_layers=layers, num_single_layers=0,
                       num_refiner_layers=refiner, mlp_ratio=4.0, text_mlp_ratio=4.0,
                       refiner_mlp_ratio=4.0, text_embed_dim=hidden, rope_axes_dim=[16, 24, 24])
    # auto: one SDPA per sample on CPU, the varlen kernel for bf16 on CUDA (what training uses)
    model = PanVideoDiffusionTransformer(cfg, attention_backend="auto").to(Setup.device)
    if compiled:  # what `compile_transformer: true` does
        for block in model.fsdp_blocks():
            block.compile()
    n = Setup.samples
    latents = torch.randn(n, *LATENT)
    x = on(torch.cat([patchify(z, cfg.patch_size) for z in latents]))            # [n * 1344, 64]
    target = on(torch.randn(x.shape[0], c * 4))
    text = on(torch.randn(n * CAPTION, hidden))
    sigmas = on(torch.rand(n))
    pack = PackInfo.build([(t, h // 2, w // 2)] * n, [CAPTION] * n, device=Setup.device)
    loss_fn = lambda: F.mse_loss(model(x, sigmas, text, pack), target)  # noqa: E731
    return model, loss_fn, 3 * model.forward_flops(pack)


def build_hunyuan(hidden: int, layers: int, refiner: int) -> tuple[torch.nn.Module, callable, int]:
    from diffusers import HunyuanVideoTransformer3DModel

    c = LATENT[0]
    model = HunyuanVideoTransformer3DModel(
        in_channels=c, out_channels=c, num_attention_heads=hidden // HEAD_DIM, attention_head_dim=HEAD_DIM,
        num_layers=layers, num_single_layers=0, num_refiner_layers=refiner, mlp_ratio=4.0, patch_size=2,
        patch_size_t=1, guidance_embeds=False, text_embed_dim=hidden, pooled_projection_dim=hidden,
        rope_axes_dim=(16, 24, 24)).to(Setup.device)
    n = Setup.samples
    latents = on(torch.randn(n, *LATENT))
    target = torch.randn_like(latents)
    text = on(torch.randn(n, CAPTION, hidden))
    mask = on(torch.ones(n, CAPTION, dtype=torch.bool))
    pooled = on(torch.randn(n, hidden))
    timesteps = on(torch.rand(n) * 1000)

    def loss_fn():
        out = model(latents, timesteps, text, mask, pooled, return_dict=False)[0]
        return F.mse_loss(out, target)

    return model, loss_fn, None


def counted_step_flops(model: torch.nn.Module, loss_fn) -> int:
    """Forward + backward FLOPs counted by torch (math SDPA, so attention shows up as matmuls)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss_fn().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


# The dense kernels both models spend their FLOPs in: BLAS matmuls and the fused attention kernels.


def training_step(model: torch.nn.Module, loss_fn):
    # Fused AdamW (one kernel over all tensors) for both models: the per-tensor loop's dispatch
    # overhead would otherwise blur the model comparison on a CPU shared with other jobs.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(Setup.device.type, dtype=torch.bfloat16, enabled=Setup.bf16):
            loss = loss_fn()
        loss.backward()
        opt.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--out", default="benchmarks/results/step_time.json", help="JSON output path")
    parser.add_argument("--compile", action="store_true",
                        help="also time pan with compile_transformer (torch.compile per block; the "
                             "diffusers model stays eager, so its ratio is pan-as-configured, not equal code)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the same comparison on a GPU")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: autocast over fp32 weights, as the trainer's `dtype: bf16`")
    parser.add_argument("--samples", type=int, default=2, help="clips of 1344 tokens per step")
    parser.add_argument("--sizes", default=SIZES, help="hidden x double blocks x refiner blocks, e.g. "
                                                      "1024x8x2,2048x8x2 on a GPU")
    args = parser.parse_args()
    Setup.device, Setup.bf16, Setup.samples = torch.device(args.device), args.dtype == "bf16", args.samples
    torch.manual_seed(0)
    matmul, matmul_flops = matmul_probe(dtype=torch.bfloat16 if Setup.bf16 else torch.float32,
                                        device=Setup.device)
    on_cpu = Setup.device.type == "cpu"
    rows = []
    for hidden, layers, refiner in (tuple(map(int, size.split("x"))) for size in args.sizes.split(",")):
        pan, pan_loss, pan_flops = build_pan(hidden, layers, refiner)
        ref, ref_loss, _ = build_hunyuan(hidden, layers, refiner)
        ref_flops = counted_step_flops(ref, ref_loss)
        candidates = {"pan": training_step(pan, pan_loss), "hunyuan": training_step(ref, ref_loss),
                      "matmul": matmul}
        if args.compile:
            compiled, compiled_loss, _ = build_pan(hidden, layers, refiner, compiled=True)
            candidates["pan_compiled"] = training_step(compiled, compiled_loss)
        times = interleaved_times(candidates, repeats=args.repeats)
        # The CPU profiler's self times are the kernels' times only when the kernels run on the CPU.
        shares = {"pan_kernel_share": kernel_share(candidates["pan"]) if on_cpu else None,
                  "hunyuan_kernel_share": kernel_share(candidates["hunyuan"]) if on_cpu else None}
        row = {"hidden": hidden, "layers": layers, "refiner": refiner,
               "tokens": f"{Setup.samples}x1344+{CAPTION}", "device": str(Setup.device), "dtype": args.dtype,
               "pan_params_M": sum(p.numel() for p in pan.parameters()) / 1e6,
               "hunyuan_params_M": sum(p.numel() for p in ref.parameters()) / 1e6,
               "pan_gflop": pan_flops / 1e9, "hunyuan_gflop": ref_flops / 1e9, "times": times, **shares}
        for clock in ("wall", "cpu"):   # cpu = this process's CPU seconds, robust to other jobs
            pan_s, ref_s = median(times["pan"][clock]), median(times["hunyuan"][clock])
            peak = matmul_flops / median(times["matmul"][clock])
            # If pan spent no time at all outside the dense kernels, this is the ratio it would reach.
            if on_cpu:
                row |= {f"speedup_bound_{clock}": ref_s / (pan_s * shares["pan_kernel_share"])}
            row |= {f"pan_{clock}_s": pan_s, f"hunyuan_{clock}_s": ref_s, f"speedup_{clock}": ref_s / pan_s,
                    f"peak_gflops_{clock}": peak / 1e9, f"pan_frac_peak_{clock}": pan_flops / pan_s / peak,
                    f"hunyuan_frac_peak_{clock}": ref_flops / ref_s / peak}
            if args.compile:
                compiled_s = median(times["pan_compiled"][clock])
                row |= {f"compiled_speedup_{clock}": ref_s / compiled_s,
                        f"compiled_frac_peak_{clock}": pan_flops / compiled_s / peak}
        rows.append(row)
    print_table(rows, ["hidden", "layers", "refiner", "pan_params_M", "hunyuan_params_M", "pan_gflop",
                       "hunyuan_gflop", "pan_kernel_share", "hunyuan_kernel_share"])
    for clock in ("wall", "cpu") if on_cpu else ("wall",):
        print(f"\n{clock} clock (median of {args.repeats} interleaved rounds):")
        print_table(rows, ["hidden", f"pan_{clock}_s", f"hunyuan_{clock}_s", f"speedup_{clock}", f"speedup_bound_{clock}",
                           f"peak_gflops_{clock}", f"pan_frac_peak_{clock}", f"hunyuan_frac_peak_{clock}"]
                    + ([f"compiled_speedup_{clock}", f"compiled_frac_peak_{clock}"] if args.compile else []))
    path = write_json(args.out, {"benchmark": "step_time", "repeats": args.repeats, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
