"""Make a set of Pyramid-Flow reference fixtures with the ORIGINAL code, in the public set's layout.

    python tests/fixturegen/make_pyramid_fixtures.py --out DIR [--preset second] [--seed N]
        [--set KEY=VALUE ...] [--parts scheduler,dit,vae,loss] [--quick] [--original DIR] [--deps DIR]
        [--numpy1 DIR]

The public set (`../shared/reference/pyramid_flow`, its README.md is the contract) was made by a
generator that is not in that folder; this one follows the README section by section so that the
fixture tests can be run against other tiny sizes and seeds (`PAN_PYRAMID_FIXTURES=DIR pytest ...`,
see tests/pyramid_reference.py). It runs the original's modules unmodified, imported from
`<shared>/reference/pyramid_flow/original/src`, with only the README's import-time stand-ins
(`original/import_stubs.py`: a torchvision VGG16 stand-in, IPython.embed and tensorboardX stubs), and
instruments calls as the README says: wrappers that call the original unchanged and record what
passes (`merge_input`, the RoPE embedder, the time embedding, the loss `forward`, `torch.rand*` /
`randn*` and the posterior's `randn_tensor`). `LPIPS.load_from_pretrained` is bypassed once, only to
list the LPIPS keys for its random checkpoint; the loss fixtures load that checkpoint through the
original path.

Environment: the original's own dependencies (einops, timm, accelerate: `--deps`, default
`<venv>/original-deps`) and numpy < 2 (`--numpy1`, default `<venv>/fixturegen-deps`; numpy >= 2
builds one scheduler table in float32, README section 4.1). `make fixturegen-deps` installs both.
The numpy-2 variant of that table (`numpy2_timesteps_per_stage`) is computed by a child process that
runs the original's scheduler under the venv's own numpy 2.

Files written (every file the fixture tests read; `tests/fixturegen/README.md` lists them):
    flux_dit/  mmdit_dit/   diffusion_transformer_384p/{config.json, diffusion_pytorch_model.safetensors},
                            model_info.json, case_{a_full_sequence,b_temporal_pyramid}[_grads].{safetensors,json}
    scheduler/              scheduler_tables.json, noise_{full_sequence,temporal_pyramid}.{safetensors,json}
    causal_vae/             causal_video_vae/{config.json, ...safetensors}, model_info.json,
                            encode_decode_{video,image}.*, lpips/vgg_lpips.pth.xz, discriminator.pth.xz,
                            loss_stage1_no_disc.*, loss_stage2_with_disc.*
    MANIFEST.json, README.md
Not written: `original/` (the code; tests/pyramid_reference.py takes it from the public set).

All computation is fp32 on CPU, each call seeded from the set's seed; a float64 run of the same calls
(the model in double, the same inputs and draws) is recorded beside each fixture as `fp64_reference`
(the fp32 rounding scale of README section 1), unless --quick.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import linecache
import lzma
import math
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PUBLIC = REPO.parent / "shared" / "reference" / "pyramid_flow"
VARIANT = "diffusion_transformer_384p"
SAMPLE_RATIOS = [1, 2, 1]          # hard-coded in the original's train/train_pyramid_flow.py::build_model_runner
STAGE_RANGE = [0, 1 / 3, 2 / 3, 1]
GAMMA = 1 / 3

# The public set's sizes (MANIFEST.json "config"), and a second set that differs in every size the
# tests must read: widths, head counts (3: no cp size 2), layer counts, latent channels, text length,
# batch, frame counts, the sync group, the VAE's widths/groups/layers and clip sizes, and the seed.
PRESETS = {
    "public": {
        "seed": 0,
        "flux": dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=16,
                     num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=20, axes_dims_rope=[4, 6, 6]),
        "mmdit": dict(sample_size=16, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=16,
                      num_attention_heads=2, caption_projection_dim=32, pooled_projection_dim=20, pos_embed_max_size=12,
                      max_num_frames=200, qk_norm="rms_norm", pos_embed_type="sincos", temp_pos_embed_type="rope",
                      joint_attention_dim=24),
        "data": dict(B=8, text_len=6, text_lens=[6, 4, 2, 5, 6, 3, 1, 6], latent_hw=[8, 16], T_full=3, T_ar=8,
                     video_sync_group=4, frame_per_unit=1),
        "vae": dict(block_out_channels=[4, 8, 16, 16], norm_num_groups=2, enc_layers=[2, 2, 2, 2],
                    dec_layers=[3, 3, 3, 3], latent_channels=16, frames=9, hw=[32, 48], image_hw=[32, 48],
                    loss_frames=9, loss_hw=[48, 64]),
    },
    "second": {
        "seed": 7,
        "flux": dict(patch_size=1, in_channels=32, num_layers=1, num_single_layers=3, attention_head_dim=12,
                     num_attention_heads=3, joint_attention_dim=20, pooled_projection_dim=15, axes_dims_rope=[4, 4, 4]),
        "mmdit": dict(sample_size=16, patch_size=2, in_channels=8, num_layers=3, attention_head_dim=8,
                      num_attention_heads=3, caption_projection_dim=24, pooled_projection_dim=18, pos_embed_max_size=10,
                      max_num_frames=200, qk_norm="rms_norm", pos_embed_type="sincos", temp_pos_embed_type="rope",
                      joint_attention_dim=28),
        "data": dict(B=12, text_len=5, text_lens=[5, 3, 1, 5, 2, 4, 5, 1, 3, 5, 2, 4], latent_hw=[16, 8], T_full=2,
                     T_ar=6, video_sync_group=3, frame_per_unit=1),
        "vae": dict(block_out_channels=[8, 8, 16, 24], norm_num_groups=4, enc_layers=[1, 1, 1, 1],
                    dec_layers=[2, 2, 2, 2], latent_channels=8, frames=17, hw=[24, 40], image_hw=[40, 16],
                    loss_frames=9, loss_hw=[56, 48]),
    },
}
PARTS = ("scheduler", "dit", "vae", "loss")
# Each DiT call again (bit-identical?) and in float64 (the fp32 rounding scale), recorded in the
# sidecars: off with --quick (the same fixture tensors, fewer JSON fields), as the suite runs it.
CHECKS = {"repeat_and_fp64": True}


# ------------------------------------------------------------------------------------------------
# Environment: the original on the path, numpy < 2
# ------------------------------------------------------------------------------------------------

def setup_paths(original: Path, deps: Path, numpy1: Path | None, need_numpy1: bool = True) -> None:
    for path in (deps, original, original / "src"):
        if not path.is_dir():
            sys.exit(f"{path} is not a folder (see this script's docstring)")
        sys.path.insert(0, str(path))
    if numpy1 is not None:
        sys.path.insert(0, str(numpy1))
    import numpy
    if need_numpy1 and int(numpy.__version__.split(".")[0]) >= 2:
        sys.exit(f"numpy {numpy.__version__} was imported: the original's scheduler table `timesteps_per_stage` "
                 "is float64 only under numpy 1 (README section 4.1). Install numpy 1.26.4 apart "
                 "(`make fixturegen-deps`, or pip install --no-deps --target <venv>/fixturegen-deps numpy==1.26.4) "
                 "and pass that folder as --numpy1.")
    import import_stubs
    import_stubs.install()


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------

def dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def write_fixture(base: Path, tensors: dict, sidecar: dict, descs: dict | None = None) -> None:
    """`base.safetensors` + `base.json` (the sidecar, with every tensor's shape, dtype and meaning)."""
    from safetensors.torch import save_file
    descs = descs or {}
    base.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    save_file(tensors, str(base.with_suffix(".safetensors")))
    sidecar = {**sidecar, "tensor_file": base.name + ".safetensors",
               "tensors": {k: {"shape": list(v.shape), "dtype": dtype_name(v), "desc": describe(k, descs)}
                           for k, v in tensors.items()}}
    write_json(base.with_suffix(".json"), sidecar)


def describe(name: str, descs: dict) -> str:
    for prefix, text in descs.items():
        if name.startswith(prefix):
            return text
    return ""


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def table(t) -> dict:
    """A tensor as JSON: dtype and every value (float32 / float64 values are exact as JSON floats)."""
    return {"dtype": str(t.dtype), "values": t.tolist()}


def randomize(model, gen) -> None:
    """README "Random weights": every parameter overwritten, >=2-D N(0,1)/sqrt(fan_in), biases
    N(0, 0.1^2), 1-D norm weights 1 + N(0, 0.1^2); buffers as the original builds them."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            while not noise.all():   # (an exact 0 drawn: drawn again, so that every path contributes)
                zeros = noise == 0
                noise[zeros] = torch.randn(int(zeros.sum()), generator=gen)
            if p.ndim >= 2:
                p.copy_(noise / math.sqrt(p[0].numel()))
            elif name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


def exact_zeros(model) -> int:
    return int(sum(int((p == 0).sum()) for p in model.parameters()))


def compare_state(model, folder: Path, weights: str) -> dict:
    from safetensors.torch import load_file
    saved = load_file(str(folder / weights))
    state = model.state_dict()
    bad = [k for k in saved
           if k not in state or state[k].dtype != saved[k].dtype or not bool((state[k] == saved[k]).all())]
    missing = [k for k in state if k not in saved]
    ok = not bad and not missing
    return {"ok": ok, "msg": "all tensors bit-identical" if ok else f"differ: {bad[:5]}, missing: {missing[:5]}"}


def max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


# ------------------------------------------------------------------------------------------------
# Instrumentation: wrappers that call the original unchanged and record what passes
# ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def recorded_draws(draws: list):
    """torch.rand/randn/rand_like/randn_like wrapped for the duration: each call's value, function
    and calling site are appended to `draws`."""
    import torch
    names = ("rand", "randn", "rand_like", "randn_like")
    saved = {n: getattr(torch, n) for n in names}

    def wrap(n):
        fn = saved[n]

        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            frame = sys._getframe(1)
            draws.append({"fn": f"torch.{n}", "value": out.detach().clone(), "file": frame.f_code.co_filename,
                          "line": frame.f_lineno, "func": frame.f_code.co_name})
            return out
        return wrapper

    for n in names:
        setattr(torch, n, wrap(n))
    try:
        yield
    finally:
        for n in names:
            setattr(torch, n, saved[n])


@contextlib.contextmanager
def wrapped(obj, attr: str, record: list, what=lambda args, kwargs, out: out):
    """obj.attr replaced (on the instance) by a wrapper that calls the original and records."""
    original = getattr(obj, attr)

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        record.append(what(args, kwargs, out))
        return out

    setattr(obj, attr, wrapper)
    try:
        yield
    finally:
        if attr in vars(obj):
            delattr(obj, attr)
        else:
            setattr(obj, attr, original)


# ------------------------------------------------------------------------------------------------
# Scheduler tables (section 4.1)
# ------------------------------------------------------------------------------------------------

def scheduler_tables() -> dict:
    import numpy
    from diffusion_schedulers import PyramidFlowMatchEulerDiscreteScheduler
    s = PyramidFlowMatchEulerDiscreteScheduler(shift=1.0, stages=3, stage_range=STAGE_RANGE, gamma=GAMMA)
    per = lambda d: {str(k): v for k, v in d.items()}  # noqa: E731
    out = {"config": {"num_train_timesteps": s.config.num_train_timesteps, "shift": s.config.shift,
                      "stages": s.config.stages, "stage_range": list(s.config.stage_range), "gamma": s.config.gamma},
           "start_sigmas": per(s.start_sigmas), "end_sigmas": per(s.end_sigmas),
           "ori_start_sigmas": per(s.ori_start_sigmas),
           "timestep_ratios": {str(k): list(v) for k, v in s.timestep_ratios.items()},
           "sigma_min": s.sigma_min, "sigma_max": s.sigma_max, "gamma": s.gamma,
           "global_sigmas": table(s.sigmas), "global_timesteps": table(s.timesteps),
           "timesteps_per_stage": {str(k): table(v) for k, v in s.timesteps_per_stage.items()},
           "sigmas_per_stage": {str(k): table(v) for k, v in s.sigmas_per_stage.items()},
           "numpy_version": numpy.__version__,
           "constructed_as": "PyramidFlowMatchEulerDiscreteScheduler(shift=1.0, stages=3, stage_range=[0,1/3,2/3,1], "
                             "gamma=1/3) -- the values the training runner passes; num_train_timesteps default 1000"}
    inference = {}
    for k in range(s.config.stages):
        s.set_timesteps(20, k)
        inference[str(k)] = {"num_inference_steps": 20, "timesteps": table(s.timesteps), "sigmas": table(s.sigmas)}
    out["inference_set_timesteps_20_20_20"] = inference
    return out


def numpy2_child(out: str) -> None:
    """Run in a child process without the numpy-1 folder: the original's stage tables under numpy 2."""
    import numpy
    from diffusion_schedulers import PyramidFlowMatchEulerDiscreteScheduler
    s = PyramidFlowMatchEulerDiscreteScheduler(shift=1.0, stages=3, stage_range=STAGE_RANGE, gamma=GAMMA)
    other = {"global_sigmas": table(s.sigmas), "global_timesteps": table(s.timesteps),
             "sigmas_per_stage": {str(k): table(v) for k, v in s.sigmas_per_stage.items()}}
    write_json(Path(out), {"numpy_version": numpy.__version__,
                           "timesteps_per_stage": {str(k): table(v) for k, v in s.timesteps_per_stage.items()},
                           "other": other})


def with_numpy2(tables: dict, args) -> dict:
    import torch
    out = Path(args.out) / ".numpy2.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--numpy2-child", str(out),
           "--original", str(args.original), "--deps", str(args.deps)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit("the numpy-2 scheduler child failed:\n" + done.stderr[-3000:])
    child = json.loads(out.read_text())
    out.unlink()
    as_t = lambda t: torch.tensor(t["values"], dtype=getattr(torch, t["dtype"].removeprefix("torch.")))  # noqa: E731
    tables["numpy2_timesteps_per_stage"] = child["timesteps_per_stage"]
    comparison = {"numpy_version": child["numpy_version"]}
    for k, t in child["timesteps_per_stage"].items():
        ours, theirs = as_t(tables["timesteps_per_stage"][k]).float(), as_t(t)
        comparison[k] = {"dtype": t["dtype"], "n_differ_after_float32_cast": int((ours != theirs).sum()),
                         "max_abs_diff": float((ours - theirs).abs().max())}
    comparison["other_tables_identical"] = all(
        child["other"][key] == tables[key] for key in ("global_sigmas", "global_timesteps", "sigmas_per_stage"))
    tables["numpy2_comparison"] = comparison
    return tables


# ------------------------------------------------------------------------------------------------
# The runner and the noising (section 4.2)
# ------------------------------------------------------------------------------------------------

def runner_settings(data: dict) -> dict:
    """`train/train_pyramid_flow.py::build_model_runner`'s arguments (fp32 DiT via use_mixed_training)."""
    return {"model_dtype": "bf16", "use_gradient_checkpointing": False, "return_log": True, "timestep_shift": 1.0,
            "stage_range": STAGE_RANGE, "sample_ratios": SAMPLE_RATIOS, "scheduler_gamma": GAMMA,
            "use_mixed_training": True, "use_flash_attn": False, "load_text_encoder": False, "load_vae": False,
            "frame_per_unit": data["frame_per_unit"], "use_temporal_causal": True, "corrupt_ratio": 1 / 3,
            "interp_condition_pos": True, "stages": [1, 2, 4]}


def build_runner(model_path: Path, model_name: str, data: dict):
    from pyramid_dit import PyramidDiTForVideoGeneration
    with contextlib.redirect_stdout(sys.stderr):
        return PyramidDiTForVideoGeneration(str(model_path), model_name=model_name, model_variant=VARIANT,
                                            max_temporal_length=data["T_ar"], video_sync_group=data["video_sync_group"],
                                            **runner_settings(data))


DRAW_MEANINGS = {
    "noise": "full-resolution noise, same shape as the highest-resolution latent [B,C,T,H,W]; lower stages use it "
             "bilinearly downsampled (x0.5 per stage) and x2",
    "u": "uniform [0,1) per sample of this column (weighting_scheme='random'); index = clamp(long(u*1000), 0, 999) "
         "into the stage's 1000-entry tables",
    "corrupt_u": "uniform [0,1) per sample; history-corruption sigma = u * corrupt_ratio(1/3). Drawn for every "
                 "column, also when it is unused (add_pyramid_noise, 1-unit columns)",
    "hist_noise_prev_unit": "randn_like of the previous unit (same resolution as the column's stage), "
                            "history = sigma*noise + (1-sigma)*clean",
    "hist_noise_stepdown_unit": "randn_like of one older unit one stage lower (while the lower stage is >= 1)",
    "hist_noise_stage0_rest": "randn_like of all remaining older frames at the lowest (stage 0) resolution",
}


def label_draws(draws: list, src: Path) -> list[dict]:
    """Name each recorded draw as the public fixtures do: by its calling line in the original."""
    pipeline = src / "pyramid_dit" / "pyramid_dit_for_video_gen_pipeline.py"
    lines = pipeline.read_text().splitlines()
    stage0_if = next(i + 1 for i, line in enumerate(lines) if "if cur_stage == 0 and cur_unit_num < num_units" in line)
    out, column = [], None
    for index, d in enumerate(draws):
        text = linecache.getline(d["file"], d["line"]).strip()
        if d["func"] == "compute_density_for_timestep_sampling":
            label = "u"
            column = 0 if column is None else column + 1
        elif text.startswith("noise = torch.randn_like"):
            label = "noise"
        elif text.startswith("last_cond_noisy_sigma = torch.rand"):
            label = "corrupt_u"
        elif text.startswith("last_cond_latent = last_cond_noisy_sigma * torch.randn_like"):
            label = "hist_noise_prev_unit"
        elif "torch.randn_like(cond_latents)" in text:
            label = "hist_noise_stage0_rest" if d["line"] > stage0_if else "hist_noise_stepdown_unit"
        else:
            raise RuntimeError(f"an unexpected draw at {d['file']}:{d['line']}: {text}")
        col = None if label == "noise" else column
        name = f"draw.{index:02d}.{label}" if col is None else f"draw.{index:02d}.col{col}.{label}"
        rel = Path(d["file"]).resolve().relative_to(src.resolve())
        out.append({"index": index, "tensor": name, "fn": d["fn"], "shape": list(d["value"].shape),
                    "caller": f"{rel}:{d['line']} ({d['func']})", "label": label, "column": col,
                    "meaning": DRAW_MEANINGS[label], "value": d["value"]})
    return out


def noising(runner, latent_raw, temporal: bool, seed: int, src: Path) -> dict:
    import torch
    captured, stage_lengths, draws = [], [], []
    capture = lambda args, kwargs, out: (args[0].detach().clone(), [x.detach().clone() for x in out])  # noqa: E731
    lengths = lambda args, kwargs, out: {  # noqa: E731
        "args": {"num_stages": args[0], "max_units": kwargs.get("max_units")}, "result": list(out)}
    before = runner.accumulate_steps
    torch.manual_seed(seed)
    with wrapped(runner, "get_pyramid_latent", captured, capture), \
            wrapped(runner, "sample_stage_length", stage_lengths, lengths), recorded_draws(draws):
        noisy, ratios, timesteps, targets = runner.get_vae_latent(latent_raw.clone(), use_temporal_pyramid=temporal)
    normalized, levels = captured[0]
    labelled = label_draws(draws, src)
    t = {"in.latent_raw": latent_raw, "built.latent_normalized": normalized}
    t |= {f"in.latents_list.stage{k}": x for k, x in enumerate(levels)}
    t |= {d["tensor"]: d.pop("value") for d in labelled}
    for c, clips in enumerate(noisy):
        for j, clip in enumerate(clips):
            t[f"out.noisy.col{c}.clip{j}"] = clip
        t[f"out.ratios.col{c}"] = ratios[c]
        t[f"out.timesteps.col{c}"] = timesteps[c]
        t[f"out.target.col{c}"] = targets[c]
    side = {"random_draws": labelled, "column_to_stage": column_to_stage(),
            "clip_structure": [[list(x.shape) for x in clips] for clips in noisy]}
    if temporal:
        (record,) = stage_lengths
        side["sample_stage_length"] = {
            "accumulate_steps_before": before, "accumulate_steps_after": runner.accumulate_steps,
            "args": record["args"], "result_units_per_stage": record["result"], "rank": 0,
            "note": "units per stage [low, mid, high]; rank from get_rank() = 0 (no torch.distributed)"}
    return {"tensors": t, "sidecar": side,
            "call": {"noisy": noisy, "ratios": ratios, "timesteps": timesteps, "targets": targets}}


def column_to_stage() -> list[int]:
    return [s for s, n in enumerate(SAMPLE_RATIOS) for _ in range(n)]


# ------------------------------------------------------------------------------------------------
# The DiTs (sections 2, 3)
# ------------------------------------------------------------------------------------------------

FLAGS = dict(use_flash_attn=False, use_temporal_causal=True, interp_condition_pos=True)


def make_dit(kind: str, cfg: dict, root: Path, gen) -> tuple[dict, object]:
    """The model built by its original constructor, every parameter randomised, saved as released."""
    if kind == "flux":
        from pyramid_dit.flux_modules import PyramidFluxTransformer as cls
        init = {**cfg, **FLAGS, "use_gradient_checkpointing": False, "gradient_checkpointing_ratio": 0.6}
    else:
        from pyramid_dit.mmdit_modules import PyramidDiffusionMMDiT as cls
        init = {**cfg, "use_gradient_checkpointing": False, **FLAGS, "use_t5_mask": True, "add_temp_pos_embed": True,
                "gradient_checkpointing_ratio": 0.6}
    with contextlib.redirect_stdout(sys.stderr):
        model = cls(**init)
    randomize(model, gen)
    folder = root / VARIANT
    model.save_pretrained(str(folder), safe_serialization=True)
    return init, model


def dit_call(model, runner, sample, text: dict, timesteps_list, targets, name: str, double: bool = False):
    """The fixture call (README 2.3): train mode, forward, runner.calculate_loss, backward."""
    import torch
    model.train()
    model.zero_grad(set_to_none=True)
    cast = (lambda x: x.double()) if double else (lambda x: x)
    rec = {"merge": [], "ids": [], "temb": []}
    rope_module = model.pos_embed if name == "flux_dit" else model.temp_rope_embed
    timestep_ratio = torch.cat([t.unsqueeze(-1) for t in timesteps_list], -1).reshape(-1)
    with wrapped(model, "merge_input", rec["merge"]), \
            wrapped(rope_module, "forward", rec["ids"], lambda a, k, o: a[0].detach().clone()), \
            wrapped(model.time_text_embed, "forward", rec["temb"], lambda a, k, o: o.detach().clone()):
        out = model(sample=[[cast(c) for c in clips] for clips in sample],
                    encoder_hidden_states=cast(text["in.encoder_hidden_states"]),
                    encoder_attention_mask=text["in.encoder_attention_mask"],
                    pooled_projections=cast(text["in.pooled_projections"]),
                    timestep_ratio=cast(timestep_ratio))
    if double:   # the runner's calculate_loss casts to float32: the same mean of per-sample MSEs in float64
        loss = torch.cat([(o - cast(t)).square().reshape(t.shape[0], -1).mean(1) for o, t in zip(out, targets)]).mean()
    else:
        loss, _ = runner.calculate_loss(out, targets)
    loss.backward()
    grads = {f"grad.{k}": (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for k, p in model.named_parameters()}
    merge = rec["merge"][0]
    return {"out": [o.detach() for o in out], "loss": loss.detach(), "grads": grads, "timestep_ratio": timestep_ratio,
            "embedded": merge[0], "hidden_length": list(merge[1]), "temps": list(merge[2]), "heights": list(merge[3]),
            "widths": list(merge[4]), "trainable": list(merge[5]), "attn_mask": merge[7], "rope": merge[8],
            "ids": rec["ids"], "temb": rec["temb"][0]}


DIT_DESCS = {
    "in.sample.": "sample[col][clip], [b,C,t,h,w] latent, clips oldest->newest (last clip = noisy, trainable)",
    "in.timestep_ratio": "timestep_ratio argument [B]; interleaved: element i*columns+c = column c, sample i "
                         "(0..1000 scale)",
    "in.encoder_hidden_states": "encoder_hidden_states [B,L,joint_attention_dim] (random stand-in for T5 features); "
                                "row i*columns+c belongs to column c",
    "in.encoder_attention_mask": "encoder_attention_mask [B,L] int64, 1 = valid text token",
    "in.pooled_projections": "pooled_projections [B,pooled_projection_dim] (random stand-in for CLIP pooled)",
    "in.target.": "flow-matching target for the column (for calculate_loss)",
    "out.col": "model output for the column = prediction for the trainable (last) clip only, [b,C,t_last,h,w]",
    "out.loss": "runner.calculate_loss(outputs, targets): mean over columns+samples of per-sample MSE (fp32)",
    "built.temb": "time_text_embed(timestep_ratio, pooled_projections) [B,inner_dim]",
    "built.embedded_tokens.": "merge_input: patchified + input-embedded video tokens of the column "
                              "[b, N_col, inner_dim], clips concatenated in order",
    "built.attn_mask.": "boolean SDPA mask [b,1,L+N_col,L+N_col] (True = may attend) over [text tokens, video tokens]",
    "built.rope.": "rotary table passed to attention: [b, L+N_col, 1, head_dim/2, 2, 2] = [[cos,-sin],[sin,cos]]",
    "built.pos_ids.": "RoPE position ids [b, L+N_col, axes] (flux: (t, h, w); mmdit: t); text tokens all 0",
}


def dit_fixtures(name: str, model, runner, noised: dict, case: str, text: dict, root: Path, description: str) -> dict:
    import torch
    call = noised["call"]
    r = dit_call(model, runner, call["noisy"], text, call["timesteps"], call["targets"], name)
    repeat = fp64 = None
    if CHECKS["repeat_and_fp64"]:
        again = dit_call(model, runner, call["noisy"], text, call["timesteps"], call["targets"], name)
        repeat = {"outputs": max(max_diff(a, b) for a, b in zip(r["out"], again["out"])),
                  "loss": max_diff(r["loss"], again["loss"]),
                  "grads": max(max_diff(r["grads"][k], again["grads"][k]) for k in r["grads"])}
        model64 = copy.deepcopy(model).double()
        r64 = dit_call(model64, runner, call["noisy"], text, call["timesteps"], call["targets"], name, double=True)
        fp64 = {"outputs_max_abs_diff": max(max_diff(a, b) for a, b in zip(r["out"], r64["out"])),
                "output_max_abs": max(float(o.abs().max()) for o in r["out"]),
                "loss_abs_diff": max_diff(r["loss"], r64["loss"]),
                "grads_max_abs_diff": max(max_diff(r["grads"][k], r64["grads"][k]) for k in r["grads"]),
                "grads_max_abs": max(float(g.abs().max()) for g in r["grads"].values())}
    t = {}
    for c, clips in enumerate(call["noisy"]):
        for j, clip in enumerate(clips):
            t[f"in.sample.col{c}.clip{j}"] = clip
    t |= {"in.timestep_ratio": r["timestep_ratio"], **text}
    t |= {f"in.target.col{c}": x for c, x in enumerate(call["targets"])}
    t |= {f"out.col{c}": o for c, o in enumerate(r["out"])}
    t["out.loss"] = r["loss"]
    t["built.temb"] = r["temb"]
    t |= {f"built.embedded_tokens.col{c}": x for c, x in enumerate(r["embedded"])}
    t |= {f"built.attn_mask.col{c}": x for c, x in enumerate(r["attn_mask"])}
    t |= {f"built.rope.col{c}": x for c, x in enumerate(r["rope"])}
    t |= {f"built.pos_ids.col{c}": x for c, x in enumerate(r["ids"])}
    side = {"description": description,
            "call": "model.train(); out = model(sample=[[in.sample.col0.clip0, ...], ...], encoder_hidden_states="
                    "in.encoder_hidden_states, encoder_attention_mask=in.encoder_attention_mask, pooled_projections="
                    "in.pooled_projections, timestep_ratio=in.timestep_ratio); loss, _ = runner.calculate_loss(out, "
                    "[in.target.col0, ...]); loss.backward()",
            "hidden_length": r["hidden_length"], "temps": r["temps"], "heights_tokens": r["heights"],
            "widths_tokens": r["widths"], "trainable_token_num": r["trainable"],
            "text_len": int(text["in.encoder_attention_mask"].shape[1]), "repeat_max_abs_diff": repeat,
            "fp64_reference": fp64, "grads_file": f"{case}_grads.safetensors"}
    write_fixture(root / case, t, side, DIT_DESCS)
    write_fixture(root / f"{case}_grads", r["grads"],
                  {"description": f"gradients of out.loss of {case} w.r.t. every parameter (one backward, fp32)"},
                  {"grad.": "d loss / d param"})
    return {"loss": float(r["loss"]), "repeat": repeat, "fp64": fp64}


def text_inputs(kind_cfg: dict, data: dict, gen) -> dict:
    import torch
    B, L = data["B"], data["text_len"]
    lens = torch.tensor(data["text_lens"])
    assert len(lens) == B and int(lens.max()) == L and int(lens.min()) >= 1
    return {"in.encoder_hidden_states": torch.randn(B, L, kind_cfg["joint_attention_dim"], generator=gen),
            "in.encoder_attention_mask": (torch.arange(L)[None, :] < lens[:, None]).long(),
            "in.pooled_projections": torch.randn(B, kind_cfg["pooled_projection_dim"], generator=gen)}


CASES = {"case_a_full_sequence": (False, "(a) full-sequence training call: each column = one clip of all noisy latent "
                                         "frames. Inputs are exactly the outputs of scheduler/noise_full_sequence "
                                         "(runner.add_pyramid_noise)."),
         "case_b_temporal_pyramid": (True, "(b) autoregressive temporal-pyramid training call: each column = "
                                           "[compressed history clips ..., noisy last unit], use_temporal_causal=True, "
                                           "interp_condition_pos=True, SDPA path. Inputs are exactly the outputs of "
                                           "scheduler/noise_temporal_pyramid "
                                           "(runner.add_pyramid_noise_with_temporal_pyramid).")}


def make_dits_and_noising(cfg: dict, out: Path, src: Path, results: dict, parts: set) -> None:
    import torch
    from pyramid_dit.flux_modules import PyramidFluxTransformer
    seed, data = cfg["seed"], cfg["data"]
    gen = torch.Generator().manual_seed(seed)
    C = cfg["flux"]["in_channels"] // 4
    assert cfg["mmdit"]["in_channels"] == C == cfg["vae"]["latent_channels"], "one latent channel count for all"
    models, runners = {}, {}
    for kind, name in (("flux", "flux_dit"), ("mmdit", "mmdit_dit")):
        init, model = make_dit(kind, cfg[kind], out / name, gen)
        runner = build_runner(out / name, f"pyramid_{kind}", data)
        checks = {"runner": compare_state(runner.dit, out / name / VARIANT, "diffusion_pytorch_model.safetensors")}
        if kind == "flux":   # the runner forces axes_dims_rope=[16,24,24] (quirk F2): the fixtures load as given
            checks["runner"]["runner_forced_axes_dims_rope"] = list(runner.dit.config.axes_dims_rope)
            with contextlib.redirect_stdout(sys.stderr):
                model = PyramidFluxTransformer.from_pretrained(str(out / name / VARIANT), torch_dtype=torch.float32,
                                                               **FLAGS)
            checks["from_pretrained"] = compare_state(model, out / name / VARIANT,
                                                      "diffusion_pytorch_model.safetensors")
        else:
            model = runner.dit
        assert all(c["ok"] for c in checks.values()), checks
        info = {"model_class": f"{type(model).__name__} ({type(model).__module__.replace('.', '/')}.py)",
                "folder": VARIANT, "init_config": init, "n_params": sum(p.numel() for p in model.parameters()),
                "exact_zero_param_values": exact_zeros(model),
                "weights": "seeded random, every parameter non-zero (see README)", "load_checks": checks}
        assert info["exact_zero_param_values"] == 0
        write_json(out / name / "model_info.json", info)
        models[name], runners[name] = model, runner
        results[f"{name}_load"] = checks

    B, (H, W) = data["B"], data["latent_hw"]
    noised = {}
    for temporal, fname, T in ((False, "noise_full_sequence", data["T_full"]),
                               (True, "noise_temporal_pyramid", data["T_ar"])):
        latent_raw = torch.randn(B, C, T, H, W, generator=gen)
        runner = build_runner(out / "flux_dit", "pyramid_flux", data)
        n = noising(runner, latent_raw, temporal, seed, src)
        again = noising(build_runner(out / "flux_dit", "pyramid_flux", data), latent_raw, temporal, seed, src)
        repeat = max(max_diff(v, again["tensors"][k]) for k, v in n["tensors"].items())
        extra = {"max_temporal_length": data["T_ar"], "video_sync_group": data["video_sync_group"],
                 "vae_shift_factor": runner.vae_shift_factor, "vae_scale_factor": runner.vae_scale_factor,
                 "vae_video_shift_factor": runner.vae_video_shift_factor,
                 "vae_video_scale_factor": runner.vae_video_scale_factor, "model_name": runner.model_name}
        fn = "add_pyramid_noise_with_temporal_pyramid" if temporal else "add_pyramid_noise"
        side = {"what": f"runner.get_vae_latent(video=in.latent_raw, use_temporal_pyramid={temporal}) with "
                        f"load_vae=False, i.e. latent normalisation -> get_pyramid_latent(x, 2) -> "
                        f"runner.{fn}(latents_list, sample_ratios={SAMPLE_RATIOS})",
                "runner_settings": runner_settings(data), "runner_extra": extra, **n["sidecar"],
                "column_batch_rule": f"column c takes samples c, c+{len(column_to_stage())}, ... of the batch "
                                     f"(index::{len(column_to_stage())})",
                "rng_note": "Every random number used comes from the draws listed above, in this order (torch global "
                            "CPU generator seeded with torch.manual_seed(seed) just before the call; the values are "
                            "what matters).",
                "repeat_max_abs_diff": repeat, "seed": seed}
        if "scheduler" in parts:
            write_fixture(out / "scheduler" / fname, n["tensors"], side,
                          {"in.latent_raw": "raw latent [B,C,T,H,W] as the VAE would give it (random)",
                           "built.latent_normalized": "after the in-place normalisation of get_vae_latent",
                           "in.latents_list.": "get_pyramid_latent output, low -> high resolution",
                           "draw.": "a random draw (see random_draws)", "out.noisy.": "noisy clip of the column",
                           "out.ratios.": "interpolation ratio r (float32)", "out.timesteps.": "timesteps (float32)",
                           "out.target.": "flow-matching target start - end"})
        results[fname] = {"repeat": repeat,
                          "units": n["sidecar"].get("sample_stage_length", {}).get("result_units_per_stage")}
        noised[temporal] = n

    if "dit" not in parts:
        return
    for name, kind in (("flux_dit", "flux"), ("mmdit_dit", "mmdit")):
        text = text_inputs(cfg[kind], data, gen)
        for case, (temporal, description) in CASES.items():
            results[f"{name}/{case}"] = dit_fixtures(name, models[name], runners["flux_dit"], noised[temporal], case,
                                                     text, out / name, description)


# ------------------------------------------------------------------------------------------------
# The causal VAE (section 5)
# ------------------------------------------------------------------------------------------------

def vae_init(v: dict) -> dict:
    n = len(v["block_out_channels"])
    down = [True] * (n - 1) + [False]
    return {"encoder_in_channels": 3, "encoder_out_channels": v["latent_channels"],
            "encoder_layers_per_block": v["enc_layers"], "encoder_down_block_types": ["DownEncoderBlockCausal3D"] * n,
            "encoder_block_out_channels": v["block_out_channels"], "encoder_spatial_down_sample": down,
            "encoder_temporal_down_sample": down, "encoder_block_dropout": [0.0] * n, "encoder_act_fn": "silu",
            "encoder_norm_num_groups": v["norm_num_groups"], "encoder_double_z": True,
            "encoder_type": "causal_vae_conv",
            "decoder_in_channels": v["latent_channels"], "decoder_out_channels": 3,
            "decoder_layers_per_block": v["dec_layers"], "decoder_up_block_types": ["UpDecoderBlockCausal3D"] * n,
            "decoder_block_out_channels": v["block_out_channels"], "decoder_spatial_up_sample": down,
            "decoder_temporal_up_sample": down, "decoder_block_dropout": [0.0] * n, "decoder_act_fn": "silu",
            "decoder_norm_num_groups": v["norm_num_groups"], "decoder_type": "causal_vae_conv", "sample_size": 256,
            "scaling_factor": 0.13025, "add_post_quant_conv": True, "interpolate": False, "downsample_scale": 8}


def xz(src: Path, dst: Path) -> dict:
    with open(src, "rb") as f, lzma.open(dst, "wb", preset=1) as out:
        while chunk := f.read(1 << 24):
            out.write(chunk)
    return {"decompressed_sha256": sha256(src), "xz_bytes": dst.stat().st_size,
            "decompressed_bytes": src.stat().st_size}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def make_vae(cfg: dict, out: Path, results: dict, parts: set, tmp: Path) -> None:
    import torch
    from video_vae.modeling_causal_vae import CausalVideoVAE
    seed, v = cfg["seed"], cfg["vae"]
    gen = torch.Generator().manual_seed(seed + 1)
    root = out / "causal_vae"
    folder = root / "causal_video_vae"
    init = vae_init(v)
    with contextlib.redirect_stdout(sys.stderr):
        vae = CausalVideoVAE(**init)
    randomize(vae, gen)
    vae.save_pretrained(str(folder), safe_serialization=True)
    with contextlib.redirect_stdout(sys.stderr):
        vae = CausalVideoVAE.from_pretrained(str(folder), torch_dtype=torch.float32, interpolate=False)
    info = {"model_class": "CausalVideoVAE (video_vae/modeling_causal_vae.py)", "folder": "causal_video_vae",
            "init_config": init, "n_params": sum(p.numel() for p in vae.parameters()),
            "exact_zero_param_values": exact_zeros(vae),
            "load_check": compare_state(vae, folder, "diffusion_pytorch_model.safetensors")}
    assert info["load_check"]["ok"] and info["exact_zero_param_values"] == 0, info

    vae.eval()
    for case, frames, (h, w) in (("encode_decode_video", v["frames"], v["hw"]),
                                 ("encode_decode_image", 1, v["image_hw"])):
        x = torch.rand(1, 3, frames, h, w, generator=gen) * 2 - 1
        runs = {}
        for dtype in (torch.float32, torch.float64)[:2 if CHECKS["repeat_and_fp64"] else 1]:
            model = vae if dtype == torch.float32 else copy.deepcopy(vae).double()
            with torch.no_grad():
                post = model.encode(x.to(dtype), is_init_image=True, temporal_chunk=False).latent_dist
                z = torch.randn(post.mean.shape, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
                runs[dtype] = {"out.moments": post.parameters, "out.mean": post.mean, "out.logvar": post.logvar,
                               "out.std": post.std,
                               "out.decoded_from_mean": model.decode(post.mode(), is_init_image=True,
                                                                     temporal_chunk=False).sample,
                               "in.z_random": z,
                               "out.decoded_from_z_random": model.decode(z, is_init_image=True,
                                                                         temporal_chunk=False).sample}
        t = {"in.x": x, **runs[torch.float32]}
        fp64 = {k: max_diff(t[k], runs[torch.float64][k]) for k in t if k.startswith("out.")} if len(runs) > 1 else {}
        side = {"description": f"{'video clip' if frames > 1 else 'image'} of {frames} frame(s)",
                "call": "vae = CausalVideoVAE.from_pretrained('causal_video_vae', torch_dtype=float32, "
                        "interpolate=False); vae.eval(); post = vae.encode(in.x, is_init_image=True, "
                        "temporal_chunk=False).latent_dist; dec = vae.decode(post.mode(), is_init_image=True, "
                        "temporal_chunk=False).sample",
                "fp64_reference": {"max_abs_diff": fp64}}
        write_fixture(root / case, t, side,
                      {"in.x": "input pixels [1,3,T,H,W] in [-1,1]", "in.z_random": "an independent N(0,1) latent",
                       "out.moments": "posterior parameters (mean ++ logvar along C)",
                       "out.": "encode / decode output (see call)"})
        results[case] = {"fp64_max_abs_diff": max(fp64.values(), default=None)}

    if "loss" in parts:
        info |= make_loss_fixtures(cfg, folder, root, results, tmp)
    write_json(root / "model_info.json", info)


def make_loss_fixtures(cfg: dict, folder: Path, root: Path, results: dict, tmp: Path) -> dict:
    import torch
    import video_vae.modeling_enc_dec as enc_dec
    import video_vae.modeling_lpips as modeling_lpips
    from video_vae.causal_video_vae_wrapper import CausalVideoVAELossWrapper
    from video_vae.modeling_discriminator import NLayerDiscriminator
    seed, v = cfg["seed"], cfg["vae"]
    gen = torch.Generator().manual_seed(seed + 3)

    # LPIPS: the original's keys (listed once with its loader bypassed), random-sign VGG weights
    # (+-sqrt(2/fan_in), which compress well), biases +-0.01, lin weights U(0,1).
    load = modeling_lpips.LPIPS.load_from_pretrained
    modeling_lpips.LPIPS.load_from_pretrained = lambda self: None
    try:
        keys = modeling_lpips.LPIPS(lpips_ckpt_path="unused").state_dict()
    finally:
        modeling_lpips.LPIPS.load_from_pretrained = load
    sign = lambda shape: torch.randint(0, 2, shape, generator=gen).float() * 2 - 1  # noqa: E731
    lpips_state = {}
    for k, p in keys.items():
        if k.startswith("scaling_layer."):
            lpips_state[k] = p.clone()
        elif k.startswith("lin"):
            lpips_state[k] = torch.rand(p.shape, generator=gen)
        elif k.endswith("weight"):
            lpips_state[k] = sign(p.shape) * math.sqrt(2 / p[0].numel())
        else:
            lpips_state[k] = sign(p.shape) * 0.01
    (root / "lpips").mkdir(parents=True, exist_ok=True)
    lpips_path = tmp / "vgg_lpips.pth"
    torch.save(lpips_state, lpips_path)
    lpips_info = xz(lpips_path, root / "lpips" / "vgg_lpips.pth.xz") | {"keys": len(lpips_state)}

    disc = NLayerDiscriminator(input_nc=3, ndf=64, n_layers=4)
    disc_state = {k: (sign(p.shape) / math.sqrt(p[0].numel()) if p.ndim > 1
                      else 0.01 * torch.randn(p.shape, generator=gen))
                  for k, p in disc.state_dict().items()}
    disc_path = tmp / "discriminator.pth"
    torch.save(disc_state, disc_path)
    disc_info = xz(disc_path, root / "discriminator.pth.xz")

    x = torch.rand(1, 3, v["loss_frames"], *v["loss_hw"], generator=gen) * 2 - 1
    for case, add_disc, step, logvar_init in (("loss_stage1_no_disc", False, 1000, 0.0),
                                              ("loss_stage2_with_disc", True, 250000, 0.25)):
        args = dict(model_path=str(folder), model_dtype="fp32", disc_start=250000, logvar_init=logvar_init,
                    kl_weight=1e-6, pixelloss_weight=10.0, perceptual_weight=1.0, disc_weight=0.5, interpolate=False,
                    add_discriminator=add_disc, freeze_encoder=False, load_loss_module=True, lpips_ckpt=str(lpips_path))
        with contextlib.redirect_stdout(sys.stderr):
            w = CausalVideoVAELossWrapper(**args)
        if add_disc:
            w.loss.discriminator.load_state_dict(disc_state)
        w.train()
        w.loss.perceptual_loss.eval()
        eps, loss_inputs = [], []
        seen = lambda a, k, o: (a[0].detach(), a[1].detach(), a[2])  # noqa: E731
        randn_tensor = enc_dec.randn_tensor

        def recorded_randn_tensor(*a, **k):
            out = randn_tensor(*a, **k)
            eps.append(out.detach().clone())
            return out

        enc_dec.randn_tensor = recorded_randn_tensor
        torch.manual_seed(seed)
        try:
            with wrapped(w.loss, "forward", loss_inputs, seen):
                rec_loss, gan_loss, log = w(x.clone(), step, identifier=["video"])
        finally:
            enc_dec.randn_tensor = randn_tensor
        rec_loss.backward()
        inputs, recon, posterior = loss_inputs[0]
        t = {"in.x": x, "draw.posterior_sample_eps": eps[0], "built.posterior_moments": posterior.parameters.detach(),
             "built.z": (posterior.mean + posterior.std * eps[0]).detach(), "built.reconstruction": recon,
             "out.rec_loss": rec_loss.detach()}
        if gan_loss is not None:
            t["out.gan_loss"] = gan_loss.detach()
        t |= {f"log.{k.replace('/', '.')}": torch.as_tensor(val).detach().float() for k, val in log.items()}
        frames = lambda y: y.transpose(1, 2).flatten(0, 1)  # noqa: E731
        with torch.no_grad():
            t["built.per_frame_mse"] = ((frames(inputs) - frames(recon)) ** 2).mean(dim=(1, 2, 3))
            t["built.per_frame_lpips"] = w.loss.perceptual_loss(frames(inputs), frames(recon)).flatten()
            if add_disc:
                t["built.logits_fake"] = w.loss.discriminator(frames(recon))
                t["built.logits_real"] = w.loss.discriminator(frames(inputs))
        t |= {f"grad.vae.{k}": (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
              for k, p in w.vae.named_parameters()}
        t["grad.loss.logvar"] = w.loss.logvar.grad.detach().clone()
        side = {"description": case,
                "wrapper_args": {**args, "model_path": "causal_video_vae",
                                 "lpips_ckpt": "lpips/vgg_lpips.pth (decompressed)"},
                "call": f"w = CausalVideoVAELossWrapper(...); w.train(); w.loss.perceptual_loss.eval(); "
                        f"rec_loss, gan_loss, log = w(in.x, {step}, identifier=['video']); rec_loss.backward()",
                "global_step": step,
                "mode": "wrapper.train() (as the trainer), but LPIPS kept in eval() so its dropout is off"}
        if add_disc:
            side["discriminator_weights"] = "discriminator.pth.xz"
            w.loss.discriminator.zero_grad(set_to_none=True)
            gan_loss.backward()
            side["disc_grad_norms_after_gan_loss_backward"] = {k: float(p.grad.norm())
                                                               for k, p in w.loss.discriminator.named_parameters()}
        write_fixture(root / case, t, side,
                      {"in.x": "input clip [1,3,T,H,W] in [-1,1]", "draw.": "posterior.sample() eps (randn_tensor)",
                       "built.": "intermediate (see README 5.4)", "out.": "wrapper return value",
                       "log.": "loss log entry", "grad.": "d rec_loss / d param"})
        results[case] = {"rec_loss": float(rec_loss.detach())}
        if gan_loss is not None:
            results[case]["gan_loss"] = float(gan_loss.detach())
    return {"lpips": lpips_info, "discriminator": disc_info}


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------

def parse_set(cfg: dict, items: list[str]) -> dict:
    """--set data.T_ar=10 --set flux.axes_dims_rope=[4,4,4] (values are JSON)."""
    cfg = json.loads(json.dumps(cfg))
    for item in items:
        key, _, value = item.partition("=")
        node = cfg
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        if last not in node:
            sys.exit(f"--set {key}: no such key (one of {sorted(node)})")
        node[last] = json.loads(value)
    return cfg


def write_readme(out: Path, cfg: dict, preset: str) -> None:
    d, f, m, v = cfg["data"], cfg["flux"], cfg["mmdit"], cfg["vae"]
    (out / "README.md").write_text(
        f"# Pyramid-Flow fixtures, set `{preset}` (seed {cfg['seed']})\n\n"
        f"Made by `tests/fixturegen/make_pyramid_fixtures.py` with the original code, in the layout and by the calls "
        f"of the public set's README (`../shared/reference/pyramid_flow/README.md`), at other tiny sizes.\n\n"
        f"- flux: {f['num_attention_heads']} heads x {f['attention_head_dim']}, {f['num_layers']} + "
        f"{f['num_single_layers']} blocks, in_channels {f['in_channels']}, text {f['joint_attention_dim']} / pooled "
        f"{f['pooled_projection_dim']}, RoPE axes {f['axes_dims_rope']}\n"
        f"- mmdit: {m['num_attention_heads']} heads x {m['attention_head_dim']}, {m['num_layers']} blocks, "
        f"in_channels {m['in_channels']}, text {m['joint_attention_dim']} / pooled {m['pooled_projection_dim']}\n"
        f"- data: B {d['B']}, text length {d['text_len']}, latent {d['latent_hw']}, full-sequence T {d['T_full']}, "
        f"AR T {d['T_ar']} (video_sync_group {d['video_sync_group']}, frame_per_unit {d['frame_per_unit']})\n"
        f"- causal VAE: channels {v['block_out_channels']}, {v['norm_num_groups']} groups, layers "
        f"{v['enc_layers']} / {v['dec_layers']}, {v['latent_channels']} latent channels; clips {v['frames']} x "
        f"{v['hw']}, image {v['image_hw']}, loss {v['loss_frames']} x {v['loss_hw']}\n\n"
        f"MANIFEST.json has every file's sha256 and the generator's results (load checks, repeats, fp64 references).\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="the folder to write (created; must be empty or absent)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="second")
    parser.add_argument("--seed", type=int, default=None, help="overrides the preset's seed")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="override one size, e.g. data.T_ar=10 or flux.num_attention_heads=5")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--quick", action="store_true",
                        help="skip the repeat and float64 runs of the DiT and VAE calls (the same fixture tensors)")
    parser.add_argument("--original", type=Path, default=PUBLIC / "original")
    parser.add_argument("--deps", type=Path, default=Path(sys.prefix) / "original-deps")
    parser.add_argument("--numpy1", type=Path, default=Path(sys.prefix) / "fixturegen-deps")
    parser.add_argument("--numpy2-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.numpy2_child:
        setup_paths(args.original.resolve(), args.deps.resolve(), None, need_numpy1=False)
        numpy2_child(args.numpy2_child)
        return 0
    if not args.out:
        parser.error("--out is required")
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS) or ("loss" in parts and "vae" not in parts):
        parser.error(f"--parts: a subset of {PARTS} ('loss' needs 'vae')")
    cfg = parse_set(PRESETS[args.preset], args.set)
    CHECKS["repeat_and_fp64"] = not args.quick
    if args.seed is not None:
        cfg["seed"] = args.seed
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        parser.error(f"{out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    original = args.original.resolve()
    setup_paths(original, args.deps.resolve(), args.numpy1.resolve() if args.numpy1.is_dir() else None)

    import numpy
    import torch
    import diffusers
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    started = time.time()
    results: dict = {}
    tmp = out / ".tmp"
    tmp.mkdir()
    timings = {"imports": round(time.time() - started, 1)}
    if "scheduler" in parts:
        write_json(out / "scheduler" / "scheduler_tables.json", with_numpy2(scheduler_tables(), args))
        timings["scheduler_tables"] = round(time.time() - started - sum(timings.values()), 1)
    if parts & {"scheduler", "dit"}:
        make_dits_and_noising(cfg, out, original / "src", results, parts)
        timings["dits_and_noising"] = round(time.time() - started - sum(timings.values()), 1)
    if "vae" in parts:
        make_vae(cfg, out, results, parts, tmp)
        timings["vae"] = round(time.time() - started - sum(timings.values()), 1)
    results["seconds"] = timings
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    write_readme(out, cfg, args.preset)
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "MANIFEST.json")
    origin = (original / "ORIGIN.md").read_text() if (original / "ORIGIN.md").is_file() else ""
    commit = next((w.strip("`") for w in origin.split() if len(w.strip("`")) == 40), "unknown")
    manifest = {"generator": "tests/fixturegen/make_pyramid_fixtures.py",
                "original_code": f"github jy0205/Pyramid-Flow @ {commit} (MIT), from {original}",
                "config_name": args.preset, "seed": cfg["seed"], "config": cfg, "parts": sorted(parts),
                "versions": {"torch": torch.__version__, "numpy": numpy.__version__, "diffusers": diffusers.__version__,
                             "python": sys.version.split()[0]},
                "total_bytes": sum(p.stat().st_size for p in files), "seconds": round(time.time() - started, 1),
                "results": results,
                "files": [{"path": str(p.relative_to(out)), "bytes": p.stat().st_size, "sha256": sha256(p)}
                          for p in files]}
    write_json(out / "MANIFEST.json", manifest)
    print(json.dumps({"out": str(out), "seed": cfg["seed"], "total_bytes": manifest["total_bytes"],
                      "seconds": manifest["seconds"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
