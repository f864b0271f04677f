"""The released Pyramid-Flow DiTs (miniFLUX, SD3-MMDiT) as pan models, against the original's fixtures.

Tolerances: pan's fp32 outputs, losses and gradients are compared with the fixtures (the original's,
in fp32 on another CPU) at rtol=1e-4 and an atol of NOISE_FACTOR (4) x the fp32 rounding of the same
call, measured in the test, one value per quantity (the outputs, the loss, the gradients): pan's
fp32 result against the same model run in float64 on the same weights and inputs
(pyramid_reference.fp32_noise: max |fp32 - float64|, at least an ulp of the largest value). The
float64 pass computes the time features in float64 too: pan computes them in fp32, as the original
does, and their cos/sin of arguments up to 1000 is where another CPU's fp32 rounds most differently
(the public set's `built.temb` is 4e-6 off this machine's; with the features in fp32 in both passes
the fixture's timestep-MLP gradients lie 12.6x the measured noise away). Measured (2026-12-07): the
noise is 1.4e-5 to 2.9e-5 on outputs up to 4.9 and 0.8e-6 to 1.6e-6 on gradients up to 0.32, on the
public set and a second one; the public fixture lies within 0.85x of it from pan's float64 values
(0.03x for a set made on this machine). Loading, saving, positions and masks are exact.

Every size (widths, head counts, frames, columns) is read from the fixture set's files, so the tests
run on any set in its layout (`PAN_PYRAMID_FIXTURES`, tests/pyramid_reference.py); the context-parallel
sizes are chosen from the head counts the configs give.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dist_utils import run_distributed
from pan.config.core import ConfigError
from pan.models import pyramid_blocks
from pan.models.attention import ATTENTION_BACKENDS, set_attention_backend
from pan.models.packing import PackInfo, SampleLayout
from pan.models.pyramid_flux import PyramidFluxTransformer
from pan.models.pyramid_io import load_config, load_pretrained, save_pretrained
from pan.models.pyramid_mmdit import PyramidMMDiT
from pyramid_reference import REFERENCE, cp_size_for, dit_config, fp32_noise, load_fixture, needs_reference, read_json

pytestmark = needs_reference

MODELS = {"flux_dit": PyramidFluxTransformer, "mmdit_dit": PyramidMMDiT}
CASES = ("case_a_full_sequence", "case_b_temporal_pyramid")
# Against the fixtures: this multiple of the measured fp32 noise (module doc). 2 for the triangle
# inequality (pan's fp32 values and the fixture's each lie within their rounding of the float64 values),
# and 2 for another CPU's fp32 rounding reaching twice as far as this machine's.
NOISE_FACTOR = 4
# compiled blocks against eager ones: the same fp32 model, other kernels (fusions) for a few of its sums
COMPILED_TOL = dict(atol=1e-5, rtol=1e-4)
# attention backends that train on CPU: the masked reference, and the block-sparse one where it exists
CPU_BACKENDS = [b for b in ("sdpa", "blockwise") if b in ATTENTION_BACKENDS]


def folder(name: str):
    return REFERENCE / name / "diffusion_transformer_384p"


def released(name: str) -> torch.nn.Module:
    return load_pretrained(folder(name), MODELS[name])


class Batch:
    """A fixture call as one pan pack: sample (column c, row i) is batch row r = i * columns + c."""

    def __init__(self, model, t: dict):
        columns = sorted({int(k.split(".col")[1].split(".")[0]) for k in t if k.startswith("in.sample.")})
        mask = t["in.encoder_attention_mask"]
        xs, texts, layouts, rows, self.targets, self.where = [], [], [], [], [], []
        for c in columns:
            clips = sorted((k for k in t if k.startswith(f"in.sample.col{c}.")),
                           key=lambda k: int(k.rsplit("clip", 1)[1]))
            for i in range(t[clips[0]].shape[0]):
                r = i * len(columns) + c
                text = t["in.encoder_hidden_states"][r][mask[r] == 1]     # valid caption rows only
                xs.append(torch.cat([model.patchify(t[k][i]) for k in clips]))
                texts.append(text)
                layouts.append(model.sample_layout([model.patch_grid(t[k][i].shape) for k in clips],
                                                   text.shape[0]))
                rows.append(r)
                self.targets.append(t[f"in.target.col{c}"][i])
                self.where.append((c, i))
        self.rows = torch.tensor(rows)
        self.x, self.text = torch.cat(xs), torch.cat(texts)
        self.timesteps = t["in.timestep_ratio"][self.rows]
        self.pooled = t["in.pooled_projections"][self.rows]
        self.pack = PackInfo.from_layouts(layouts)

    def inputs(self, pack=None):
        pack = pack or self.pack
        x, text = pack.shard_inputs(self.x, self.text)
        return x, self.timesteps, text, self.pooled, pack

    def predictions(self, model, out):
        """The trained (last) clip of every sample, as latents [C, t, H, W]."""
        preds, start = [], 0
        for layout in self.pack.layouts:
            last = layout.clips[-1]
            end = start + layout.video_len
            preds.append(model.unpatchify(out[end - last.tokens:end], last.grid))
            start = end
        return preds

    def token_targets(self, model):
        """[Nv, out] target tokens (0 on history rows) and [Nv] per-row loss weights: the loss is the
        mean over samples of each sample's MSE over its trained clip, as the original's."""
        target = torch.zeros(self.x.shape[0], model.proj_out.out_features)
        weight = torch.zeros(self.x.shape[0])
        start, b = 0, self.pack.num_samples
        for layout, latent in zip(self.pack.layouts, self.targets):
            end = start + layout.video_len
            n = layout.clips[-1].tokens
            target[end - n:end] = model.target_tokens(latent)
            weight[end - n:end] = 1.0 / (b * latent.numel())
            start = end
        return target, weight


def loss_of(out, target, weight):
    return (weight[:, None] * (out - target).square()).sum()


# ------------------------------------------------------------------------------------------------
# Loading and saving the released layout
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_released_folder_loads_bit_identically(name):
    from safetensors.torch import load_file
    model = released(name)
    stored = load_file(str(folder(name) / "diffusion_pytorch_model.safetensors"))
    state = model.state_dict()
    assert state.keys() == stored.keys()
    for key, tensor in stored.items():
        assert state[key].dtype == tensor.dtype and torch.equal(state[key], tensor), key
    config = json.loads((folder(name) / "config.json").read_text())
    assert {k: v for k, v in config.items() if not k.startswith("_")} == vars(model.config)
    assert sum(p.numel() for p in model.parameters()) == read_json(f"{name}/model_info.json")["n_params"]


@pytest.mark.parametrize("name", MODELS)
def test_save_then_load_is_bit_identical_with_the_released_keys(name, tmp_path):
    model = released(name)
    save_pretrained(model, tmp_path / "out")
    again = load_pretrained(tmp_path / "out", MODELS[name])
    for (key, a), (key_b, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert key == key_b and a.dtype == b.dtype and torch.equal(a, b), key
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    original = json.loads((folder(name) / "config.json").read_text())
    assert written.keys() == original.keys()
    assert {k: v for k, v in written.items() if k != "_diffusers_version"} == \
           {k: v for k, v in original.items() if k != "_diffusers_version"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in folder(name).iterdir())


def _folder_with_config(tmp_path, name, **changes):
    out = tmp_path / "dit"
    shutil.copytree(folder(name), out)
    (out / "config.json").chmod(0o644)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _head_dim(config: dict) -> int:
    return config["attention_head_dim"]


def _inner(config: dict) -> int:
    return config["num_attention_heads"] * config["attention_head_dim"]


def _axes_not_summing_to_the_head_dim(config: dict) -> list[int]:
    # the original forces [16, 24, 24] (F2), which fits 64-dim heads only
    return [16, 24, 24] if _head_dim(config) != 64 else [16, 24, 26]


@pytest.mark.parametrize("name, changes, key", [
    ("flux_dit", lambda c: {"axes_dims_rope": _axes_not_summing_to_the_head_dim(c)}, "axes_dims_rope"),
    ("flux_dit", {"patch_size": 2}, "patch_size"),
    ("flux_dit", lambda c: {"in_channels": c["in_channels"] + 2}, "in_channels"),   # not 4 x latent channels
    ("flux_dit", {"num_layerz": 2}, "num_layerz"),
    ("flux_dit", {"use_temporal_causal": "maybe"}, "use_temporal_causal"),
    ("flux_dit", {"gradient_checkpointing_ratio": 1.5}, "gradient_checkpointing_ratio"),
    ("flux_dit", {"_class_name": "PyramidDiffusionMMDiT"}, "_class_name"),
    ("mmdit_dit", {"pos_embed_type": "rope"}, "pos_embed_type"),      # M1
    ("mmdit_dit", {"temp_pos_embed_type": "sincos"}, "temp_pos_embed_type"),
    ("mmdit_dit", {"use_t5_mask": False}, "use_t5_mask"),
    ("mmdit_dit", lambda c: {"caption_projection_dim": _inner(c) + _head_dim(c)}, "caption_projection_dim"),
])
def test_unsupported_config_values_are_refused_with_the_key(tmp_path, name, changes, key):
    if callable(changes):   # a wrong value for this set's sizes
        changes = changes(dit_config(name))
    path = _folder_with_config(tmp_path, name, **changes)
    with pytest.raises(ConfigError) as err:
        load_config(path, MODELS[name])
    problems = getattr(err.value, "errors", [err.value])
    assert [e.key for e in problems] == [key]
    assert str(path / "config.json") in str(err.value)


def test_weights_load_strictly_and_every_problem_is_listed(tmp_path):
    from safetensors.torch import load_file, save_file
    path = _folder_with_config(tmp_path, "flux_dit")
    weights = path / "diffusion_pytorch_model.safetensors"
    weights.chmod(0o644)
    state = load_file(str(weights))
    rows, width = state["x_embedder.weight"].shape          # [inner dim, in_channels] of this set
    assert (rows, width) == (_inner(dit_config("flux_dit")), dit_config("flux_dit")["in_channels"])
    del state["proj_out.bias"]
    state["extra.weight"] = torch.zeros(1)
    state["x_embedder.weight"] = torch.zeros(rows, width - 4)
    save_file(state, str(weights))
    with pytest.raises(ValueError) as err:
        load_pretrained(path, PyramidFluxTransformer)
    message = str(err.value)
    assert "missing (1): proj_out.bias" in message and "unexpected (1): extra.weight" in message
    assert f"x_embedder.weight: file ({rows}, {width - 4}), model ({rows}, {width})" in message


# ------------------------------------------------------------------------------------------------
# The fixtures: outputs, loss, gradients, positions, masks
# ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def float64_time_features():
    """pan's time features (fp32 in pan, as in the original) computed in float64 while it lasts: the
    float64 pass of a noise measurement runs the whole model in float64 (module doc)."""
    def features(timesteps, dim=pyramid_blocks.TIMESTEP_FEATURES):
        half = dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
        args = timesteps.double()[:, None] * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    with mock.patch.object(pyramid_blocks, "timestep_features", features):
        yield


def fixture_run(name: str, case: str, backend: str | None, dtype=torch.float32, trained_only=False) -> dict:
    """pan's fixture call in `dtype` (the released weights and the fixture's inputs converted; in
    float64 the time features too), by quantity: {"outputs": {"col<c>.<i>": prediction} (or
    {"trained_rows": ...} with `trained_only`), "loss": {"loss": ...}, "gradients": {"grad.<param>":
    ...}}. `backend` None: the released config's."""
    model = released(name).to(dtype)
    if backend is not None:
        set_attention_backend(model, backend)
    t, _ = load_fixture(f"{name}/{case}")
    batch = Batch(model, {k: v.to(dtype) if v.is_floating_point() else v for k, v in t.items()})
    with float64_time_features() if dtype == torch.float64 else contextlib.nullcontext():
        out = model(*batch.inputs(), trained_only=trained_only)
    if trained_only:
        target, weight = (v[batch.pack.video_trained] for v in batch.token_targets(model))
        loss, outputs = loss_of(out, target, weight), {"trained_rows": out}
    else:
        preds = batch.predictions(model, out)
        loss = torch.stack([F.mse_loss(p, y) for p, y in zip(preds, batch.targets)]).mean()
        torch.testing.assert_close(loss_of(out, *batch.token_targets(model)), loss, rtol=1e-6, atol=0)
        outputs = {f"col{c}.{i}": pred for (c, i), pred in zip(batch.where, preds)}
    loss.backward()
    return {"outputs": {k: v.detach() for k, v in outputs.items()}, "loss": {"loss": loss.detach()},
            "gradients": {f"grad.{k}": p.grad if p.grad is not None else torch.zeros_like(p)
                          for k, p in model.named_parameters()}}


def fixture_tolerance(fp32: dict, fp64: dict) -> dict:
    """assert_close keywords for pan's fp32 values of one quantity against the fixture's: rtol 1e-4
    and NOISE_FACTOR x their fp32 rounding measured against `fp64` (pyramid_reference.fp32_noise;
    module doc). That must be rounding: under 1e-4 of the largest value (measured: under 7e-6), not
    a difference between the two passes that would widen the tolerance."""
    noise, largest = fp32_noise(fp32, fp64), max(v.abs().max().item() for v in fp64.values())
    assert noise < 1e-4 * largest, (noise, largest)
    return {"atol": NOISE_FACTOR * noise, "rtol": 1e-4}


def noise_tolerances(name: str, case: str, backend: str | None, trained_only=False) -> tuple[dict, dict]:
    """(pan's fp32 fixture_run, {quantity: fixture_tolerance}: its noise against the float64 run)."""
    ours, exact = (fixture_run(name, case, backend, dtype, trained_only) for dtype in (torch.float32, torch.float64))
    return ours, {quantity: fixture_tolerance(ours[quantity], exact[quantity]) for quantity in ours}


def assert_matches_the_fixture(name: str, case: str, ours: dict, tol: dict) -> None:
    """fp32 values of the fixture call by quantity (fixture_run's keys; "loss" may be absent) against
    the fixture's outputs, loss and gradients, each within `tol[quantity]` (noise_tolerances)."""
    t, _ = load_fixture(f"{name}/{case}")
    grads, _ = load_fixture(f"{name}/{case}_grads")
    for key, pred in ours["outputs"].items():
        if key != "trained_rows":       # (the fixture holds each sample's prediction)
            c, i = map(int, key.removeprefix("col").split("."))
            torch.testing.assert_close(pred, t[f"out.col{c}"][i], **tol["outputs"],
                                       msg=f"column {c} sample {i} (atol {tol['outputs']['atol']:.2e})")
    if "loss" in ours:
        torch.testing.assert_close(ours["loss"]["loss"], t["out.loss"], **tol["loss"])
    assert set(ours["gradients"]) == set(grads)
    for key, grad in ours["gradients"].items():
        torch.testing.assert_close(grad, grads[key], **tol["gradients"],
                                   msg=f"{key} (atol {tol['gradients']['atol']:.2e})")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", MODELS)
def test_forward_loss_and_gradients_match_the_original(name, case, backend):
    assert_matches_the_fixture(name, case, *noise_tolerances(name, case, backend))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", MODELS)
def test_predicting_the_trained_rows_only_gives_the_originals_loss_and_gradients(name, case, backend):
    # What the recipes train with: the model predicts each sample's trained (last) clip only, and
    # skips the last single-stream block's work for history and caption rows.
    model = released(name)
    set_attention_backend(model, backend)
    t, _ = load_fixture(f"{name}/{case}")
    batch = Batch(model, t)
    with torch.no_grad():
        every = model(*batch.inputs())
        out = model(*batch.inputs(), trained_only=True)
    trained = batch.pack.video_trained
    assert out.shape == (int(trained.sum()), every.shape[1])
    # the same rows: a few fp32 roundings apart at most (an attention kernel blocks fewer queries otherwise)
    torch.testing.assert_close(out, every[trained], rtol=1e-5, atol=1e-6)
    assert_matches_the_fixture(name, case, *noise_tolerances(name, case, backend, trained_only=True))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", MODELS)
def test_pack_positions_and_embedded_tokens_are_the_originals(name, case):
    model = released(name)
    t, _ = load_fixture(f"{name}/{case}")
    batch = Batch(model, t)
    with torch.no_grad():
        embedded = model.x_embedder(batch.x) if name == "flux_dit" else model.pos_embed(batch.x, batch.pack)
        exact = model.double().x_embedder(batch.x.double()) if name == "flux_dit" else \
            model.double().pos_embed(batch.x.double(), batch.pack)
    tol = fixture_tolerance({"embedded": embedded}, {"embedded": exact})     # its fp32 noise (module doc)
    start = 0
    for (c, i), layout in zip(batch.where, batch.pack.layouts):
        end = start + layout.video_len
        ids = t[f"built.pos_ids.col{c}"][i]                          # [L_pad + N, 3 or 1], text first
        text_len = ids.shape[0] - layout.video_len
        pos = batch.pack.video_pos[start:end, :ids.shape[1]].to(torch.float32)
        assert torch.equal(pos, ids[text_len:]), (c, i)              # exact
        assert not ids[:text_len].any()                              # caption rows are not rotated
        torch.testing.assert_close(embedded[start:end], t[f"built.embedded_tokens.col{c}"][i], **tol)
        start = end


@pytest.mark.parametrize("case", CASES)
def test_padded_caption_rows_are_never_attended_and_the_rule_is_the_originals_mask(case):
    # The original masks padded caption rows away from every valid query, so pan drops them; on the
    # valid rows its mask is pan's block-causal rule with captions as frame 0.
    model = released("flux_dit")
    t, _ = load_fixture(f"flux_dit/{case}")
    batch = Batch(model, t)
    mask = t["in.encoder_attention_mask"].bool()
    for s, ((c, i), layout) in enumerate(zip(batch.where, batch.pack.layouts)):
        original = t[f"built.attn_mask.col{c}"][i, 0]               # [L_pad + N]^2, [text; video]
        valid = torch.cat([mask[batch.rows[s]], torch.ones(layout.video_len, dtype=torch.bool)])
        assert not original[valid][:, ~valid].any()
        frames = batch.pack.joint.frames[s]                          # pan joint order: [video; text]
        frames = torch.cat([frames[layout.video_len:], frames[:layout.video_len]])
        assert torch.equal(original[valid][:, valid], frames[:, None] >= frames[None, :]), (c, i)


# ------------------------------------------------------------------------------------------------
# Packing, causality, the config's rules
# ------------------------------------------------------------------------------------------------

def _float64_batch(name):
    model = released(name).double()
    t, _ = load_fixture(f"{name}/case_b_temporal_pyramid")
    return model, Batch(model, {k: v.double() if v.is_floating_point() else v for k, v in t.items()})


@pytest.mark.parametrize("name", MODELS)
def test_packed_batch_equals_per_sample_forwards(name):
    model, batch = _float64_batch(name)
    with torch.no_grad():
        packed = model(*batch.inputs())
        v0 = t0 = 0
        for s, layout in enumerate(batch.pack.layouts):
            v1, t1 = v0 + layout.video_len, t0 + layout.text_len
            alone = model(batch.x[v0:v1], batch.timesteps[s:s + 1], batch.text[t0:t1], batch.pooled[s:s + 1],
                          PackInfo.from_layouts([layout]))
            torch.testing.assert_close(packed[v0:v1], alone, rtol=1e-10, atol=1e-10)
            v0, t0 = v1, t1


@pytest.mark.parametrize("name", MODELS)
def test_later_frames_never_change_earlier_frames(name):
    model, batch = _float64_batch(name)
    s = len(batch.pack.layouts) - 1                       # the last column's (highest stage) last sample:
    start = sum(batch.pack.video_lens[:s])                # the most frames, over the most clips
    frames = batch.pack.layouts[s].frame_of_tokens()
    rows = torch.arange(start, start + len(frames))
    last = int(frames.max())
    assert last >= 2, "the fixture's AR case has a history of at least two frames"
    with torch.no_grad():
        base = model(*batch.inputs())
        for frame in (last // 2, last):                   # a history frame, and the trained one
            x = batch.x.clone()
            x[rows[frames == frame]] += torch.randn_like(x[rows[frames == frame]])
            out = model(x, *batch.inputs()[1:])
            changed = (out - base).abs().amax(dim=1)
            assert changed[rows[frames < frame]].max() <= 1e-12, frame
            assert changed[rows[frames >= frame]].min() > 1e-6, frame     # the perturbation reaches them
            assert changed[:start].max() <= 1e-12                         # other samples untouched


def test_a_pack_must_follow_the_models_attention_rule_and_positions():
    model = released("flux_dit")
    t, _ = load_fixture("flux_dit/case_b_temporal_pyramid")
    batch = Batch(model, t)
    layouts = list(batch.pack.layouts)
    grids = [c.grid for c in layouts[-1].clips]
    for wrong, key in ((SampleLayout.stacked(grids, layouts[-1].text_len, ref_hw=grids[-1][1:],
                                             trained=(False,) * 3 + (True,)), "use_temporal_causal"),
                       (SampleLayout.stacked(grids, layouts[-1].text_len, trained=(False,) * 3 + (True,),
                                             attention="block_causal"), "interp_condition_pos")):
        pack = PackInfo.from_layouts(layouts[:-1] + [wrong])
        with pytest.raises(ValueError, match=key):
            model(*batch.inputs(pack))


# ------------------------------------------------------------------------------------------------
# Init, optimizer split, parallel units, FLOPs
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_meta_build_then_init_weights_starts_at_zero_output(name):
    config = load_config(folder(name), MODELS[name])
    with torch.device("meta"):
        model = MODELS[name](config)
    model.to_empty(device="cpu")
    model.init_weights()
    for key, tensor in model.state_dict().items():
        assert torch.isfinite(tensor).all(), key
    if name == "mmdit_dit":   # the sin-cos table is built as the original builds (and saves) it
        stored = released(name).pos_embed.pos_embed
        assert torch.equal(model.pos_embed.pos_embed, stored)
    t, _ = load_fixture(f"{name}/case_b_temporal_pyramid")
    batch = Batch(model, t)
    with torch.no_grad():
        assert model(*batch.inputs()).abs().max() == 0      # zeroed output layer (AdaLN-Zero init)


@pytest.mark.parametrize("name", MODELS)
def test_hidden_matrices_and_parallel_units(name):
    model = released(name)
    params = dict(model.named_parameters())
    hidden = model.hidden_matrices()
    for key, splits in hidden.items():
        assert params[key].ndim == 2 and sum(splits) == params[key].shape[0], key
        assert key.startswith(("transformer_blocks.", "single_transformer_blocks.")) and ".norm" not in key
    assert "transformer_blocks.0.attn.to_q.weight" in hidden and "transformer_blocks.0.ff.net.2.weight" in hidden
    assert not any("norm1" in k or k.startswith(("proj_out", "x_embedder", "context_embedder")) for k in hidden)
    blocks = model.fsdp_blocks()
    assert blocks[0] is model.transformer_blocks[0] and len(blocks) == len(model.transformer_blocks) + len(
        getattr(model, "single_transformer_blocks", []))
    assert all(hasattr(b.attn, "inner_attention") for b in blocks)
    assert model.num_attention_heads == model.config.num_attention_heads
    assert model.checkpointed_blocks() == []                # use_gradient_checkpointing: false
    model.config.use_gradient_checkpointing = True
    assert model.checkpointed_blocks()[0] is blocks[0]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", MODELS)
def test_forward_flops_match_flop_counter(name, backend):
    # sdpa evaluates the masked pairs too; the block-sparse backends only the allowed ones
    model = released(name)
    set_attention_backend(model, backend)
    t, _ = load_fixture(f"{name}/case_b_temporal_pyramid")
    batch = Batch(model, t)
    # the math SDPA kernel runs attention as matmuls, which FlopCounterMode counts
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(*batch.inputs())
    assert counter.get_total_flops() == model.forward_flops(batch.pack)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as trained_only:
        model(*batch.inputs(), trained_only=True)
    assert trained_only.get_total_flops() == model.forward_flops(batch.pack, trained_only=True)
    assert trained_only.get_total_flops() < counter.get_total_flops()
    if backend != "sdpa":
        set_attention_backend(model, "sdpa")
        assert model.forward_flops(batch.pack) > counter.get_total_flops()


def test_a_flux_dit_without_single_stream_blocks_counts_its_trained_only_forward():
    # No last single-stream block to trim: only the output layer runs on the trained rows alone.
    config = load_config(folder("flux_dit"), PyramidFluxTransformer)
    config.num_single_layers = 0
    model = PyramidFluxTransformer(config)
    t, _ = load_fixture("flux_dit/case_b_temporal_pyramid")
    batch = Batch(model, t)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(*batch.inputs(), trained_only=True)
    assert out.shape[0] == int(batch.pack.video_trained.sum())
    assert counter.get_total_flops() == model.forward_flops(batch.pack, trained_only=True)
    assert counter.get_total_flops() < model.forward_flops(batch.pack)


def random_pack(model, step: int, generator: torch.Generator):
    """A new packed batch layout for each step: 1-3 samples, each a last clip of 1-2 frames with 0-2
    history frames at half its resolution (the temporal pyramid's shape) and 1-4 caption rows."""
    c = model.config
    xs, texts, layouts = [], [], []
    n = 1 + step % 3
    for i in range(n):
        h, w = 4 * (1 + (step + i) % 2), 4 * (1 + (step * i) % 3)
        clips = ([(1 + (step + i) % 2, h // 2, w // 2)] if (step + i) % 3 else []) + [(1 + i % 2, h, w)]
        latents = [torch.randn(model.latent_channels, *clip, generator=generator) for clip in clips]
        xs += [model.patchify(latent) for latent in latents]
        texts.append(torch.randn(1 + (step + 2 * i) % 4, c.joint_attention_dim, generator=generator))
        layouts.append(model.sample_layout([model.patch_grid(latent.shape) for latent in latents],
                                           texts[-1].shape[0]))
    return (torch.cat(xs), 1000 * torch.rand(n, generator=generator), torch.cat(texts),
            torch.randn(n, c.pooled_projection_dim, generator=generator), PackInfo.from_layouts(layouts))


@pytest.mark.parametrize("name", MODELS)
def test_compiled_blocks_give_eager_outputs_without_recompiling_for_each_new_layout(name):
    """`compile_transformer` on both released DiTs: every new pack layout (sample count, clip sizes,
    history, caption lengths) reuses the compiled blocks after the first few (static shapes, then
    dynamic ones, then a pack of one sample), instead of recompiling each step until torch's limit
    drops the blocks back to eager; and the compiled blocks (RoPE in real arithmetic there, since
    inductor has no code for complex operators) give the eager model's outputs."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    eager, compiled = released(name), released(name)
    counter = CompileCounter()  # dynamo's guards and recompiles, without inductor's codegen time
    for block in compiled.fsdp_blocks():
        block.compile(backend=counter)
    generator, frames = torch.Generator().manual_seed(0), []
    for step in range(12):
        inputs = random_pack(eager, step, generator)
        with torch.no_grad():
            torch.testing.assert_close(compiled(*inputs), eager(*inputs), **COMPILED_TOL)
        frames.append(counter.frame_count)
    assert frames[-1] == frames[5], frames  # the last six layouts, all new, compiled nothing
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------
# FSDP2 + Ulysses context parallel (2 gloo processes)
# ------------------------------------------------------------------------------------------------

def _fsdp_ulysses_worker(names: tuple[str, ...]) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from pan.parallel.context_parallel import attach_ulysses

    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,))
    results = {}
    for name in names:
        model = released(name)
        t, _ = load_fixture(f"{name}/case_b_temporal_pyramid")
        batch = Batch(model, t)
        target, weight = batch.token_targets(model)
        assert model.num_attention_heads % size == 0, (name, model.num_attention_heads, size)
        attach_ulysses(model, dist.group.WORLD)
        for block in model.fsdp_blocks():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        shard = batch.pack.shard(rank, size)
        out = model(*batch.inputs(shard))
        rows = shard.video_index
        loss_of(out, target[rows], weight[rows]).backward()   # this rank's share; grads summed by FSDP
        results[name] = {"rows": rows, "out": out.detach(),
                         "grads": {k: p.grad.full_tensor() for k, p in model.named_parameters()}}
    return results


def test_fsdp2_and_ulysses_reproduce_the_fixture_outputs_and_gradients():
    # FSDP2 over all ranks, and Ulysses over the same ranks: as many as the smallest split of each
    # fixture DiT's heads (models whose heads allow the same size share one process group).
    by_size: dict[int, list[str]] = {}
    for name in MODELS:
        by_size.setdefault(cp_size_for(dit_config(name)["num_attention_heads"]), []).append(name)
    unsplittable = by_size.pop(1, [])                 # one head: nothing for Ulysses to split
    results = {}
    for size, names in by_size.items():
        ranks = run_distributed(_fsdp_ulysses_worker, world_size=size, args=(tuple(names),))
        results |= {name: ranks for name in names}
    for name, ranks in results.items():
        model = released(name)
        t, _ = load_fixture(f"{name}/case_b_temporal_pyramid")
        batch = Batch(model, t)
        out = torch.empty(batch.x.shape[0], model.proj_out.out_features)
        for result in ranks:
            out[result[name]["rows"]] = result[name]["out"]
        ours = {"outputs": {f"col{c}.{i}": pred for (c, i), pred in zip(batch.where, batch.predictions(model, out))},
                "gradients": {f"grad.{key}": grad for key, grad in ranks[0][name]["grads"].items()}}
        # within the fp32 noise of the same call in one process (fp32 against float64)
        assert_matches_the_fixture(name, "case_b_temporal_pyramid", ours,
                                   noise_tolerances(name, "case_b_temporal_pyramid", None)[1])
    if unsplittable:
        pytest.skip(f"one attention head: Ulysses cannot split {unsplittable}")
