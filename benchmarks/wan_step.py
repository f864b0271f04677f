"""Wan training step: pan's WanTransformer (pan/recipes/wan/model.py) against diffusers' WanTransformer3DModel.

One step = zero_grad, forward, the Wan recipe's loss (squared velocity error summed over the trained
values, divided by their count: `pan.recipes.wan.task.loss_sum` for pan, the same sum by hand for
diffusers), backward; no optimizer step. Both models hold the same weights (diffusers' seeded init moved
by seeded noise, copied into pan's model: the parameter names are the folder's on both sides) and get the
same noised latents, timesteps (1000 t) and caption rows (umT5-wide, zero-padded to 512 rows as
WanPipeline pads them), in two cases:

- `same`: a batch of clips of one size, the inputs of both identical; the loss and every parameter's
  gradient are compared (max over tensors of max |pan - diffusers| / max |diffusers|, fp32; the float64
  equality is tests/test_wan_model.py's);
- `mixed`: clips of several lengths (latent frames), the same samples three ways: pan packs them into one
  sequence (`pan`, attention within each sample); diffusers takes them padded to the longest clip with
  zero latents, the loss over the real frames only (`diffusers_padded`: what a padded batch costs; its
  loss is not pan's, since diffusers' self-attention has no mask and the real tokens attend to the
  padding); and diffusers one forward and backward per length, gradients accumulated
  (`diffusers_per_length`: the exact step a bucketing trainer takes; its loss and gradients are compared
  with pan's).

`pan_compiled` (unless `--no-compiled`; never under `--quick`) is `pan` with each block compiled in place
as the trainer compiles them under `compile_transformer: true` (pan/parallel/fsdp.py; inductor's CPU
backend here), its loss and gradients checked against diffusers as `pan`'s are; the eager `pan` stays
the reference of the ratios.

The candidates run round-robin in one process (interleaved rounds, median; benchmarks/common.py), so the
ratios do not depend on the machine's drift. This process's CPU time is robust to other jobs on a
shared machine; the wall time is what a user waits. Both are reported.

    OMP_NUM_THREADS=2 python benchmarks/wan_step.py [--repeats 5] [--cases same,mixed] [--quick]
        [--no-compiled] [--out benchmarks/results/wan_step.json]
"""

from __future__ import annotations

import argparse
import os
import time
from types import SimpleNamespace

import torch

try:
    from benchmarks.common import interleaved_times, kernel_share, median, print_table, write_json
except ModuleNotFoundError:  # run as `python benchmarks/wan_step.py`: its folder is on the path
    from common import interleaved_times, kernel_share, median, print_table, write_json
from pan.models.attention import set_attention_backend
from pan.models.packing import PackInfo, patchify
from pan.recipes.wan.model import WanTransformer
from pan.recipes.wan.task import loss_sum
from pan.recipes.wan.weights import config_from_dict

# Large enough that the matmuls dominate (4 heads x 128 = width 512, MLP 2048, umT5's width 4096), small
# enough for a few seconds a step on 2 CPU cores.
CONFIG = dict(patch_size=[1, 2, 2], num_attention_heads=4, attention_head_dim=128, in_channels=16, out_channels=16,
              text_dim=4096, freq_dim=256, ffn_dim=2048, num_layers=2, cross_attn_norm=True, eps=1e-6)
LATENT_HW = (24, 32)              # latent cells per frame (192 x 256 pixels at 8x): 12 x 16 = 192 tokens a frame
TEXT_ROWS = 512                   # WanPipeline's max_sequence_length: every caption padded to it
CASES = {"same": dict(frames=[5, 5]),            # 2 clips of 5 latent frames: 960 tokens each
         "mixed": dict(frames=[2, 4, 6, 8])}     # 384 .. 1536 tokens: 3840 packed, 6144 padded
QUICK_CONFIG = dict(CONFIG, num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=16, ffn_dim=64,
                    num_layers=1)
QUICK_LATENT_HW, QUICK_TEXT_ROWS = (4, 4), 16


def diffusers_model(config: dict, seed: int):
    """diffusers' model, its seeded init moved by seeded noise (no zero bias or unit norm left)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.train()


def pan_model(reference, backend: str = "sdpa", compiled: bool = False) -> WanTransformer:
    """pan's model with the reference's weights (the same names and shapes); `compiled`: each block
    compiled in place, as the trainer does under `compile_transformer: true`."""
    config = config_from_dict({k: v for k, v in dict(reference.config).items() if not k.startswith("_")})
    model = WanTransformer(config)
    model.load_state_dict(reference.state_dict(), strict=True)
    set_attention_backend(model, backend)
    if compiled:
        for block in model.fsdp_blocks():
            block.compile()
    return model.train()


def noised_clips(frames: list[int], config: dict, hw: tuple[int, int], text_rows: int, seed: int) -> SimpleNamespace:
    """Each clip's noised latent x_t [C, F, H, W], velocity target, caption rows [text_rows, text_dim]
    (a random number of real rows, zeros after) and timestep 1000 t."""
    gen = torch.Generator().manual_seed(seed)
    c = config["in_channels"]
    x0 = [torch.randn(c, f, *hw, generator=gen) for f in frames]
    noise = [torch.randn(x.shape, generator=gen) for x in x0]
    t = torch.rand(len(frames), generator=gen)
    texts = []
    for _ in frames:
        real = int(torch.randint(text_rows // 16, text_rows // 4 + 1, (1,), generator=gen))
        rows = torch.zeros(text_rows, config["text_dim"])
        rows[:real] = torch.randn(real, config["text_dim"], generator=gen)
        texts.append(rows)
    return SimpleNamespace(x=[(1 - ti) * a + ti * n for a, n, ti in zip(x0, noise, t)],
                           target=[n - a for a, n in zip(x0, noise)], text=texts, timesteps=1000 * t)


def pan_step(model: WanTransformer, clips: SimpleNamespace):
    """pan's step: the clips patchified and packed (inside the step, as the trainer packs each batch),
    the recipe's loss_sum over every value, divided by their count."""
    patch = model.config.patch_size

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        grids = [(x.shape[1] // patch[0], x.shape[2] // patch[1], x.shape[3] // patch[2]) for x in clips.x]
        x = torch.cat([patchify(v, patch) for v in clips.x])
        target = torch.cat([patchify(v, patch) for v in clips.target])
        pack = PackInfo.build(grids, [t.shape[0] for t in clips.text])
        inputs = SimpleNamespace(x=x, target=target, weight=torch.ones(x.shape[0]), timesteps=clips.timesteps,
                                 text=torch.cat(clips.text), pack=pack, image=None)
        loss = loss_sum(model, inputs) / target.numel()
        loss.backward()
        return loss

    return step


def diffusers_forward(model, x: list[torch.Tensor], text: list[torch.Tensor], timesteps: torch.Tensor,
                      target: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squared errors of diffusers' model over clips of one size."""
    out = model(hidden_states=torch.stack(x), timestep=timesteps, encoder_hidden_states=torch.stack(text)).sample
    return (out - torch.stack(target)).square().sum()


def diffusers_step(model, clips: SimpleNamespace):
    """diffusers' step on clips of one size: one batch."""
    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = diffusers_forward(model, clips.x, clips.text, clips.timesteps, clips.target)
        loss = loss / sum(t.numel() for t in clips.target)
        loss.backward()
        return loss

    return step


def diffusers_padded_step(model, clips: SimpleNamespace):
    """diffusers' step on clips of mixed lengths padded with zero latents to the longest; the loss over
    the real frames only (the padding is attended to: not pan's loss)."""
    longest = max(x.shape[1] for x in clips.x)

    def pad(v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(v, (0, 0, 0, 0, 0, longest - v.shape[1]))

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        x = torch.stack([pad(v) for v in clips.x])
        out = model(hidden_states=x, timestep=clips.timesteps, encoder_hidden_states=torch.stack(clips.text)).sample
        mask = torch.stack([pad(torch.ones_like(v)) for v in clips.target])
        loss = ((out - torch.stack([pad(v) for v in clips.target])).square() * mask).sum() / mask.sum()
        loss.backward()
        return loss

    return step


def diffusers_per_length_step(model, clips: SimpleNamespace):
    """diffusers' step as a bucketing trainer takes it: one forward and backward per clip length,
    gradients accumulated, the loss divided by every value's count (pan's loss exactly)."""
    lengths = sorted({x.shape[1] for x in clips.x})
    groups = [[i for i, x in enumerate(clips.x) if x.shape[1] == n] for n in lengths]
    count = sum(t.numel() for t in clips.target)

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        total = 0.0
        for index in groups:
            loss = diffusers_forward(model, [clips.x[i] for i in index], [clips.text[i] for i in index],
                                     clips.timesteps[index], [clips.target[i] for i in index]) / count
            loss.backward()
            total += loss.detach()
        return total

    return step


def agreement(pan: WanTransformer, pan_loss: torch.Tensor, reference, reference_loss: torch.Tensor) -> dict:
    """Loss and per-parameter gradient differences after one step of each (fp32)."""
    pan_loss, reference_loss = pan_loss.detach(), torch.as_tensor(reference_loss).detach()
    ref = dict(reference.named_parameters())
    worst, name = 0.0, None
    for key, p in pan.named_parameters():
        scale = ref[key].grad.abs().max().clamp_min(1e-30)
        diff = ((p.grad - ref[key].grad).abs().max() / scale).item()
        if diff > worst:
            worst, name = diff, key
    return {"pan_loss": pan_loss.item(), "diffusers_loss": reference_loss.item(),
            "loss_rel_diff": abs(pan_loss.item() - reference_loss.item()) / abs(reference_loss.item()),
            "grad_max_rel_diff": worst, "grad_worst_tensor": name}


def measure_case(case: str, reference, args) -> dict:
    frames = CASES[case]["frames"]
    clips = noised_clips(frames, args.config, args.hw, args.text_rows, args.seed)
    pan = pan_model(reference)
    patch = args.config["patch_size"]
    tokens = [f // patch[0] * (args.hw[0] // patch[1]) * (args.hw[1] // patch[2]) for f in frames]
    pack = PackInfo.build([(f // patch[0], args.hw[0] // patch[1], args.hw[1] // patch[2]) for f in frames],
                          [args.text_rows] * len(frames))
    row = {"case": case, "clips": len(frames), "latent_frames": frames, "video_tokens": sum(tokens),
           "padded_tokens": len(frames) * max(tokens), "pan_step_gflop": 3 * pan.forward_flops(pack) / 1e9}
    if case == "same":
        candidates = {"pan": pan_step(pan, clips), "diffusers": diffusers_step(reference, clips)}
        exact = "diffusers"
    else:
        candidates = {"pan": pan_step(pan, clips), "diffusers_padded": diffusers_padded_step(reference, clips),
                      "diffusers_per_length": diffusers_per_length_step(reference, clips)}
        exact = "diffusers_per_length"
        row["padded_loss"] = candidates["diffusers_padded"]().detach().item()
    reference_loss = candidates[exact]()
    row |= agreement(pan, candidates["pan"](), reference, reference_loss)
    check_agreement(case, row)
    if args.compiled:
        compiled = pan_model(reference, compiled=True)
        candidates["pan_compiled"] = pan_step(compiled, clips)
        reference_loss = candidates[exact]()   # the reference's gradients again (pan's step cleared none)
        started = time.perf_counter()
        checked = agreement(compiled, candidates["pan_compiled"](), reference, reference_loss)
        row["pan_compiled_first_step_wall_s"] = time.perf_counter() - started   # compiling, mostly
        row |= {f"pan_compiled_{key}": value for key, value in checked.items()}
        check_agreement(case, checked, "pan_compiled")
    times = interleaved_times(candidates, repeats=args.repeats, warmup=args.warmup)
    row["times"] = times
    if args.kernel_share:
        row |= {f"{name}_kernel_share": kernel_share(fn) for name, fn in candidates.items()}
    for clock in ("wall", "cpu"):
        seconds = {name: median(t[clock]) for name, t in times.items()}
        row |= {f"{name}_{clock}_s": s for name, s in seconds.items()}
        for name in seconds:
            if name != "pan":
                row[f"{name}/pan_{clock}"] = seconds[name] / seconds["pan"]
            if name.startswith("diffusers") and "pan_compiled" in seconds:
                row[f"{name}/pan_compiled_{clock}"] = seconds[name] / seconds["pan_compiled"]
    return row


def check_agreement(case: str, row: dict, name: str = "pan") -> None:
    if row["loss_rel_diff"] > 1e-4:
        raise SystemExit(f"{case}: {name}'s loss {row['pan_loss']} is not diffusers' {row['diffusers_loss']}: "
                         "the two steps do not compute the same thing.")


def report(rows: list[dict], repeats: int) -> None:
    print_table(rows, ["case", "clips", "latent_frames", "video_tokens", "padded_tokens", "pan_step_gflop",
                       "loss_rel_diff", "grad_max_rel_diff", "pan_kernel_share", "diffusers_kernel_share",
                       "diffusers_padded_kernel_share", "diffusers_per_length_kernel_share"])
    if any("pan_compiled_loss_rel_diff" in row for row in rows):
        print("\npan_compiled (each block compiled as compile_transformer does) against diffusers:")
        print_table(rows, ["case", "pan_compiled_loss_rel_diff", "pan_compiled_grad_max_rel_diff",
                           "pan_compiled_kernel_share", "pan_compiled_first_step_wall_s"])
    for clock in ("cpu", "wall"):
        print(f"\n{clock} clock, seconds a step (median of {repeats} interleaved rounds) and diffusers / pan:")
        print_table(rows, ["case", f"pan_{clock}_s", f"diffusers_{clock}_s", f"diffusers/pan_{clock}",
                           f"diffusers_padded_{clock}_s", f"diffusers_padded/pan_{clock}",
                           f"diffusers_per_length_{clock}_s", f"diffusers_per_length/pan_{clock}"])
        if any(f"pan_compiled_{clock}_s" in row for row in rows):
            print(f"\n{clock} clock, pan_compiled: seconds a step, against eager pan and diffusers / pan_compiled:")
            print_table(rows, ["case", f"pan_compiled_{clock}_s", f"pan_compiled/pan_{clock}",
                               f"diffusers/pan_compiled_{clock}", f"diffusers_padded/pan_compiled_{clock}",
                               f"diffusers_per_length/pan_compiled_{clock}"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="same,mixed", help="comma-separated: same, mixed")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-kernel-share", dest="kernel_share", action="store_false",
                        help="leave out the profiled share of time in the dense kernels")
    parser.add_argument("--no-compiled", dest="compiled", action="store_false",
                        help="leave out pan_compiled (compiling takes a minute or two a case)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny config, one round, no profile, no pan_compiled: checks the script (tests), "
                             "measures nothing")
    parser.add_argument("--out", default="benchmarks/results/wan_step.json", help="JSON output path")
    args = parser.parse_args(argv)
    args.config, args.hw, args.text_rows = ((QUICK_CONFIG, QUICK_LATENT_HW, QUICK_TEXT_ROWS) if args.quick
                                            else (CONFIG, LATENT_HW, TEXT_ROWS))
    if args.quick:
        args.repeats, args.warmup, args.kernel_share, args.compiled = 1, 0, False, False
    torch.set_num_threads(args.threads)
    reference = diffusers_model(args.config, args.seed)
    load_before, t0 = os.getloadavg(), time.perf_counter()   # the machine is shared: how busy it was
    rows = [measure_case(case, reference, args) for case in args.cases.split(",")]
    load = {"before": load_before, "after": os.getloadavg()}
    report(rows, args.repeats)
    print(f"\n{time.perf_counter() - t0:.0f} s; load average (1, 5, 15 min) before {load['before']}, "
          f"after {load['after']}")
    path = write_json(args.out, {"benchmark": "wan_step", "config": args.config, "latent_hw": args.hw,
                                 "text_rows": args.text_rows, "cases": CASES, "repeats": args.repeats,
                                 "warmup": args.warmup, "quick": args.quick, "compiled": args.compiled,
                                 "load_average": load, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
