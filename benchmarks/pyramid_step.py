"""Pyramid-Flow training step: pan's PyramidFluxTransformer against the original implementation.

One step = zero_grad, forward, the original's loss (mean over samples of each sample's MSE over its
trained clip), backward; no optimizer step. Both models get the same weights (fixture-style random
values: every path contributes) and the same noised clips at the config of the original's
`bench_original_flux.py` (hidden 256 = 4 heads x 64, 4 double + 4 single blocks, RoPE axes
[16, 24, 24], T5 width 4096, pooled 768; 4 stage columns (stages 0, 1, 1, 2) of a 32 x 48 latent, one
sample each; 128 caption tokens, half of them padding; fp32), in both of its modes:
- `full`: full-sequence training, 5 latent frames, all noisy (block-causal too: the original's
  `use_temporal_causal` applies to it, quirk F5);
- `ar`: the autoregressive temporal pyramid, 16 latent frames, sync group 8, rank 0, first step:
  units [8, 8, 9], history at decreasing resolution (README section 7).
The clips come from pan's noising (`pan.diffusion.pyramid_noising`, equal to the original's given the same
draws); pan packs them (caption padding dropped, `PackInfo` built inside its step, as the original
builds its masks and positions inside its forward). The candidates run round-robin in one process
(interleaved rounds, median), so the ratios do not depend on the machine's drift:
- `original`: the original `PyramidFluxTransformer` (SDPA with its dense [L, L] mask per column);
- `pan`: pan with the backend `attention_backend: auto` chooses for this step, as the trainer
  chooses it: sdpa, blockwise (and varlen on CUDA in bf16) timed forward and backward on the step's
  own attention calls (`pan_backend` and `auto_times` in the table);
- `pan_sdpa`: pan with one masked SDPA call per sample (the original's algorithm, pan's code);
- `pan_compiled`: `pan` with each block compiled as `compile_transformer: true` does (attention stays
  outside the graphs; the first round, which compiles, is not timed);
- `pan_full_history` (ar): pan with every history frame at full resolution instead of the temporal
  pyramid, the same trained units: the method's saving, measured.

`*_kernel_share` is the fraction of a step's CPU time inside the dense kernels (BLAS matmuls and the
fused attention kernels, torch.profiler self times) and `ceiling` the ratio pan would reach against
the original if it spent no time at all outside them: the bound for any eager implementation with
pan's kernel calls. Wall time is what a user waits; this process's CPU time is robust to other jobs
on a shared machine. Both are reported.

The original needs `einops`, `timm` and `accelerate` (kept out of pan's environment:
`pip install --target DIR einops timm accelerate --no-deps`, then `--original-deps DIR`) and the
extract of its source (`--original`, default: the shared reference beside the repository). Without
them the script times pan alone and says so.

    OMP_NUM_THREADS=2 python benchmarks/pyramid_step.py --original-deps DIR [--repeats 5] [--modes full,ar]
        [--no-compile] [--device cuda --dtype bf16] [--out benchmarks/results/pyramid_step.json]

On a GPU (`--device cuda --dtype bf16`: both models' steps under bf16 autocast, fp32 weights, as
both trainers run) the wall clock is the figure; CPU seconds there count the host's launch work only.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

try:
    from benchmarks.common import import_original, interleaved_times, kernel_share, median, print_table, write_json
except ModuleNotFoundError:  # run as `python benchmarks/pyramid_step.py`: its folder is on the path
    from common import import_original, interleaved_times, kernel_share, median, print_table, write_json
from pan.diffusion.pyramid_draws import GeneratorDraws
from pan.diffusion.pyramid_latents import latent_pyramid
from pan.diffusion.pyramid_noising import noise_full_sequence, noise_temporal_pyramid
from pan.diffusion.pyramid_schedule import PyramidConfig, PyramidSchedule
from pan.diffusion.pyramid_units import stage_unit_counts
from pan.models.attention import auto_attention, describe, fastest, measure_backends, set_attention_backend
from pan.models.packing import PackInfo
from pan.models.pyramid_flux import PyramidFluxConfig, PyramidFluxTransformer
from pan.parallel.fsdp import declared_blocks

ROOT = Path(__file__).resolve().parents[1]
ORIGINAL = ROOT.parent / "shared" / "reference" / "pyramid_flow" / "original"

# The original's bench_original_flux.py config (its training script's switches: SDPA, temporal causal).
DIT = dict(patch_size=1, in_channels=64, num_layers=4, num_single_layers=4, attention_head_dim=64,
           num_attention_heads=4, joint_attention_dim=4096, pooled_projection_dim=768,
           axes_dims_rope=[16, 24, 24], use_flash_attn=False, use_temporal_causal=True,
           interp_condition_pos=True, use_gradient_checkpointing=False)
COLUMNS = 4                       # sample_ratios [1, 2, 1]: stages 0, 1, 1, 2, one sample each
TEXT_LEN = 128                    # caption tokens per sample, the second half padding
LATENT = (16, 32, 48)             # latent channels, height, width (256 x 384 px)
MODES = {"full": dict(frames=5),
         "ar": dict(frames=16, max_frames=16, video_sync_group=8, frame_per_unit=1)}

# The dense kernels of both models: BLAS matmuls and SDPA's fused CPU kernels (the original's masked
# calls and pan's unmasked ones both land in the flash kernel for CPU).


# ------------------------------------------------------------------------------------------------
# Weights and inputs
# ------------------------------------------------------------------------------------------------

@torch.no_grad()
def randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Fixture-style weights (README section 0): matrices N(0, 1)/sqrt(fan_in), biases N(0, 0.1^2),
    norm weights 1 + N(0, 0.1^2). The original's init zeroes the AdaLN and output layers, which would
    make every block the identity; this way both models compute (and are compared on) everything."""
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=generator)
        if p.ndim >= 2:
            p.copy_(noise / p.shape[1] ** 0.5)
        elif name.endswith("bias"):
            p.copy_(0.1 * noise)
        else:
            p.copy_(1 + 0.1 * noise)


@dataclass
class StepInputs:
    """One training batch as both models take it: column c is batch row c (one sample per column)."""
    clips: list[list[torch.Tensor]]   # per column: [1, C, t, h, w] clips, oldest first, last one noisy
    targets: list[torch.Tensor]       # per column: [1, C, t, h, w] velocity of the last clip
    timesteps: torch.Tensor           # [B] 0..1000 scale
    text: torch.Tensor                # [B, TEXT_LEN, joint_attention_dim] padded caption features
    mask: torch.Tensor                # [B, TEXT_LEN] int64, 1 = valid
    pooled: torch.Tensor              # [B, pooled_projection_dim]

    def video_tokens(self) -> list[int]:
        """Video tokens of each column (2x2 patches)."""
        return [sum(c.shape[2] * (c.shape[3] // 2) * (c.shape[4] // 2) for c in col) for col in self.clips]


def on_device(inputs: StepInputs, device: str) -> StepInputs:
    return StepInputs(clips=[[c.to(device) for c in col] for col in inputs.clips],
                      targets=[t.to(device) for t in inputs.targets], timesteps=inputs.timesteps.to(device),
                      text=inputs.text.to(device), mask=inputs.mask.to(device), pooled=inputs.pooled.to(device))


def noised_inputs(mode: str, generator: torch.Generator) -> tuple[StepInputs, list[torch.Tensor]]:
    """(the batch of `mode`, its clean latent pyramid) from a random normalised latent."""
    c, h, w = LATENT
    spec = MODES[mode]
    schedule = PyramidSchedule(PyramidConfig())
    latent = torch.randn(COLUMNS, c, spec["frames"], h, w, generator=generator)      # normalised
    levels = latent_pyramid(latent, schedule.stages)
    draws = GeneratorDraws(generator)
    if mode == "full":
        columns = noise_full_sequence(levels, schedule, draws)
    else:
        units = stage_unit_counts(step=0, rank=0, video_sync_group=spec["video_sync_group"],
                                  frame_per_unit=spec["frame_per_unit"], max_frames=spec["max_frames"],
                                  clip_units=spec["frames"], stages=schedule.stages)
        columns = noise_temporal_pyramid(levels, schedule, units, draws,
                                         frame_per_unit=spec["frame_per_unit"])
    mask = torch.ones(COLUMNS, TEXT_LEN, dtype=torch.int64)
    mask[:, TEXT_LEN // 2:] = 0
    text = torch.randn(COLUMNS, TEXT_LEN, DIT["joint_attention_dim"], generator=generator)
    pooled = torch.randn(COLUMNS, DIT["pooled_projection_dim"], generator=generator)
    inputs = StepInputs(clips=[col.clips for col in columns], targets=[col.target for col in columns],
                        timesteps=torch.cat([col.timesteps for col in columns]), text=text, mask=mask,
                        pooled=pooled)
    return inputs, levels


def with_full_resolution_history(inputs: StepInputs, levels: list[torch.Tensor], generator: torch.Generator
                                 ) -> StepInputs:
    """The same trained units, each column's history being all its earlier frames at full resolution
    (one clip, corrupted like the pyramid's history) instead of the temporal pyramid."""
    clips = []
    for c, col in enumerate(inputs.clips):
        frames = sum(clip.shape[2] for clip in col) - col[-1].shape[2]
        clean = levels[-1][c:c + 1, :, :frames]
        sigma = torch.rand(1, generator=generator) / 3
        history = sigma * torch.randn(clean.shape, generator=generator) + (1 - sigma) * clean
        clips.append([history, col[-1]] if frames else [col[-1]])
    return StepInputs(clips, inputs.targets, inputs.timesteps, inputs.text, inputs.mask, inputs.pooled)


# ------------------------------------------------------------------------------------------------
# The two steps
# ------------------------------------------------------------------------------------------------

def auto_choice(model: PyramidFluxTransformer, inputs: StepInputs, dtype: str) -> tuple[str, dict[str, float | str]]:
    """The backend `attention_backend: auto` gives this step, as the trainer settles it: one step
    records the attention calls, then the candidates are timed on them (forward and backward)."""
    set_attention_backend(model, "auto")
    pan_step(model, inputs, dtype)()
    times = measure_backends([m.first_call for m in auto_attention(model)])
    return fastest(times), times


def autocast(model: torch.nn.Module, dtype: str):
    """bf16 autocast (fp32 master weights, as both trainers train in bf16), or nothing for fp32."""
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bf16")


def pan_step(model: PyramidFluxTransformer, inputs: StepInputs, dtype: str = "fp32"):
    """One pan step from the clips: patch tokens, valid caption rows, the pack, forward, loss, backward.

    The loss is the recipe's (`PyramidFlowTask.loss_sum`): squared errors of the trained tokens (the
    model asked for those rows only, `trained_only`), each sample's weighted by 1 / its values,
    summed and divided by the samples: the original's loss.
    """
    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        xs, texts, layouts, targets, weights = [], [], [], [], []
        for col, target, text, valid in zip(inputs.clips, inputs.targets, inputs.text, inputs.mask):
            clips = [clip[0] for clip in col]                                       # [C, t, h, w]
            xs.append(torch.cat([model.patchify(clip) for clip in clips]))
            texts.append(text[valid == 1])                                          # valid rows only
            layouts.append(model.sample_layout([model.patch_grid(clip.shape) for clip in clips],
                                               texts[-1].shape[0]))
            trained = model.target_tokens(target[0])                               # the last clip's
            targets.append(trained)
            weights.append(trained.new_full((trained.shape[0],), 1 / target.numel()))
        pack = PackInfo.from_layouts(layouts).to(inputs.text.device)
        with autocast(model, dtype):   # the trained rows' predictions [n, 64], as the recipe asks
            out = model(torch.cat(xs), inputs.timesteps, torch.cat(texts), inputs.pooled, pack, trained_only=True)
        loss = ((out.float() - torch.cat(targets)).square().sum(1) * torch.cat(weights)).sum() / len(layouts)
        loss.backward()
        return loss

    return step


def original_step(model, calculate_loss, inputs: StepInputs, dtype: str = "fp32"):
    """One step of the original, called as its runner calls it (README section 2.3)."""
    runner = SimpleNamespace(return_log=False)   # all that `calculate_loss` reads of its runner

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with autocast(model, dtype):
            out = model(sample=inputs.clips, encoder_hidden_states=inputs.text,
                        encoder_attention_mask=inputs.mask, pooled_projections=inputs.pooled,
                        timestep_ratio=inputs.timesteps)
        loss, _ = calculate_loss(runner, out, inputs.targets)
        loss.backward()
        return loss

    return step


def load_original(src: Path, deps: str | None):
    """(the original's PyramidFluxTransformer class, its runner's calculate_loss), or (None, why not)."""
    def load():
        from pyramid_dit import PyramidDiTForVideoGeneration
        from pyramid_dit.flux_modules import PyramidFluxTransformer as Original
        return Original, PyramidDiTForVideoGeneration.calculate_loss
    return import_original(src, deps, load)


# ------------------------------------------------------------------------------------------------
# Measurements
# ------------------------------------------------------------------------------------------------

def agreement(pan_model, pan_loss: torch.Tensor, original, original_loss: torch.Tensor) -> dict:
    """How far pan's loss and gradients are from the original's after one step each (fp32 rounding
    expected: the same weights and inputs, operations ordered differently)."""
    ref = dict(original.named_parameters())
    worst = max(((p.grad - ref[name].grad).abs().max() / ref[name].grad.abs().max().clamp_min(1e-30)).item()
                for name, p in pan_model.named_parameters())
    return {"pan_loss": pan_loss.item(), "original_loss": original_loss.item(),
            "loss_rel_diff": abs(pan_loss.item() - original_loss.item()) / abs(original_loss.item()),
            "grad_max_rel_diff": worst}


def pack_of(model: PyramidFluxTransformer, inputs: StepInputs) -> PackInfo:
    """The pack pan's step builds for these inputs (for its backend choice and FLOP count)."""
    return PackInfo.from_layouts([model.sample_layout([model.patch_grid(c[0].shape) for c in col],
                                                      int(valid.sum()))
                                  for col, valid in zip(inputs.clips, inputs.mask)])


def pan_model(state: dict, backend: str, device: str = "cpu", compiled: bool = False) -> PyramidFluxTransformer:
    model = PyramidFluxTransformer(PyramidFluxConfig(**DIT))
    model.load_state_dict(state)
    set_attention_backend(model, backend)
    if compiled:
        for block in declared_blocks(model):   # what `compile_transformer: true` does
            block.compile()
    return model.to(device).train()


def measure_mode(mode: str, state: dict, original, args) -> dict:
    generator = torch.Generator().manual_seed(args.seed)
    inputs, levels = noised_inputs(mode, generator)
    pan = pan_model(state, "sdpa", args.device)
    pack = pack_of(pan, inputs)
    inputs = on_device(inputs, args.device)
    backend, auto_times = auto_choice(pan, inputs, args.dtype)
    set_attention_backend(pan, backend)
    step = lambda model, batch=inputs: pan_step(model, batch, args.dtype)
    candidates = {"pan": step(pan), "pan_sdpa": step(pan_model(state, "sdpa", args.device))}
    if args.compile:
        compiled = pan_model(state, backend, args.device, compiled=True)
        candidates["pan_compiled"] = step(compiled)
    row = {"mode": mode, "pan_backend": backend, "video_tokens": inputs.video_tokens(),
           "auto_times": describe(auto_times),
           "text_tokens": f"{TEXT_LEN} (original) / {TEXT_LEN // 2} (pan: padding dropped)",
           "pan_step_gflop": 3 * pan.forward_flops(pack, trained_only=True) / 1e9}
    if original is not None:
        cls, calculate_loss = original
        model = cls(**DIT)
        model.load_state_dict(state)     # the checkpoint's keys are pan's: the same tensors
        candidates["original"] = original_step(model.to(args.device).train(), calculate_loss, inputs, args.dtype)
        original_loss = candidates["original"]()
        row |= agreement(pan, candidates["pan"](), model, original_loss)
        if args.compile:   # its first call compiles
            row |= {f"compiled_{k}": v for k, v in
                    agreement(compiled, candidates["pan_compiled"](), model, original_loss).items()}
        if row["loss_rel_diff"] > (1e-4 if args.dtype == "fp32" else 2e-2):
            raise SystemExit(f"{mode}: pan's loss {row['pan_loss']} is not the original's "
                             f"{row['original_loss']}: the two steps do not compute the same thing.")
    if mode == "ar":
        full_history = on_device(with_full_resolution_history(inputs, levels, generator), args.device)
        candidates["pan_full_history"] = step(pan_model(state, backend, args.device), full_history)
        row["full_history_video_tokens"] = full_history.video_tokens()
    times = interleaved_times(candidates, repeats=args.repeats, warmup=args.warmup)
    row["times"] = times
    shares = {name: kernel_share(candidates[name]) for name in ("pan", "original", "pan_compiled")
              if name in candidates and args.device == "cpu"}   # the profile counts CPU kernels
    row |= {f"{name}_kernel_share": share for name, share in shares.items()}
    for clock in ("wall", "cpu"):
        seconds = {name: median(t[clock]) for name, t in times.items()}
        row |= {f"{name}_{clock}_s": s for name, s in seconds.items()}
        if "original" in seconds:
            row[f"speedup_{clock}"] = seconds["original"] / seconds["pan"]
            row[f"sdpa_speedup_{clock}"] = seconds["original"] / seconds["pan_sdpa"]
            if "pan_compiled" in seconds:
                row[f"compiled_speedup_{clock}"] = seconds["original"] / seconds["pan_compiled"]
            if "pan" in shares:
                # if pan spent no time outside the dense kernels, this is the ratio it would reach
                row[f"ceiling_{clock}"] = seconds["original"] / (seconds["pan"] * shares["pan"])
        if "pan_full_history" in seconds:
            row[f"pyramid_saving_{clock}"] = seconds["pan_full_history"] / seconds["pan"]
    return row


def report(rows: list[dict], original_note: str | None, repeats: int) -> None:
    print_table(rows, ["mode", "video_tokens", "pan_backend", "auto_times", "pan_step_gflop", "pan_kernel_share",
                       "pan_compiled_kernel_share", "original_kernel_share", "loss_rel_diff", "grad_max_rel_diff",
                       "compiled_loss_rel_diff", "compiled_grad_max_rel_diff"])
    for clock in ("wall", "cpu"):
        print(f"\n{clock} clock (median of {repeats} interleaved rounds):")
        print_table(rows, ["mode", f"original_{clock}_s", f"pan_{clock}_s", f"pan_sdpa_{clock}_s",
                           f"pan_compiled_{clock}_s", f"speedup_{clock}", f"sdpa_speedup_{clock}",
                           f"compiled_speedup_{clock}", f"ceiling_{clock}"])
    for row in rows:
        if "full_history_video_tokens" in row:
            print(f"\ntemporal pyramid vs full-resolution history ({row['mode']}): video tokens "
                  f"{sum(row['video_tokens'])} vs {sum(row['full_history_video_tokens'])} "
                  f"(per column {row['video_tokens']} vs {row['full_history_video_tokens']}); step "
                  f"{row['pan_wall_s']:.3g} s vs {row['pan_full_history_wall_s']:.3g} s wall "
                  f"(x{row['pyramid_saving_wall']:.3g}), cpu x{row['pyramid_saving_cpu']:.3g}")
    if original_note:
        print(f"\nNOTE: pan alone, no comparison: {original_note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--original", type=Path, default=ORIGINAL,
                        help="folder with the original's import_stubs.py and src/ (default: the shared "
                             "reference beside the repository)")
    parser.add_argument("--original-deps", default=None,
                        help="folder with einops, timm and accelerate for the original (pip --target)")
    parser.add_argument("--modes", default="full,ar", help="comma-separated: full, ar")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="leave out `pan_compiled` (its compilation takes a minute or two on CPU)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                        help="bf16: both steps under bf16 autocast (fp32 weights)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/pyramid_step.json", help="JSON output path")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reference = PyramidFluxTransformer(PyramidFluxConfig(**DIT))
    randomize(reference, torch.Generator().manual_seed(args.seed))
    state = reference.state_dict()
    original, original_note = load_original(args.original, args.original_deps)
    load_before = os.getloadavg()   # the machine is shared: how busy it was around the measurement
    rows = [measure_mode(mode, state, original, args) for mode in args.modes.split(",")]
    load = {"before": load_before, "after": os.getloadavg()}
    report(rows, original_note, args.repeats)
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']}")
    path = write_json(args.out, {"benchmark": "pyramid_step", "device": args.device, "dtype": args.dtype,
                                 "config": DIT, "columns": COLUMNS,
                                 "text_len": TEXT_LEN, "latent": LATENT, "modes": MODES,
                                 "repeats": args.repeats, "warmup": args.warmup, "load_average": load,
                                 "original": original_note or "compared", "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
