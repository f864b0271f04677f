"""PanVideoDiffusionTransformer: size, packing exactness, isolation, CP bookkeeping, init, FLOPs, fitting."""

import dataclasses
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pan.config.core import ConfigError
from pan.models import LEGACY_NAMES, PackInfo, PanDiTConfig, PanVideoDiffusionTransformer, attention

TINY = dict(in_channels=6, out_channels=3, patch_size=[1, 2, 2], hidden_size=32, num_attention_heads=2,
            num_layers=2, num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, text_mlp_ratio=1.5,
            refiner_mlp_ratio=2.0, text_embed_dim=24, rope_axes_dim=[4, 6, 6])
GRIDS = [(2, 3, 2), (1, 2, 4), (3, 1, 3)]
TEXT_LENS = [5, 3, 7]


def tiny_model(zero_init_modulation=False, seed=0, **overrides) -> PanVideoDiffusionTransformer:
    torch.manual_seed(seed)
    model = PanVideoDiffusionTransformer(PanDiTConfig(**{**TINY, **overrides}), zero_init_modulation)
    return model.double()


def batch(model, grids=GRIDS, text_lens=TEXT_LENS, seed=1):
    c = model.config
    g = torch.Generator().manual_seed(seed)
    nv = sum(t * h * w for t, h, w in grids)
    x = torch.randn(nv, c.in_channels * c.patch_volume, generator=g, dtype=torch.float64)
    text = torch.randn(sum(text_lens), c.text_embed_dim, generator=g, dtype=torch.float64)
    sigmas = torch.rand(len(grids), generator=g, dtype=torch.float64)
    return x, sigmas, text, PackInfo.build(grids, text_lens)


def test_production_defaults_are_the_29b_model():
    with torch.device("meta"):
        model = PanVideoDiffusionTransformer(PanDiTConfig())
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - 29.2e9) < 0.3e9, n
    # Per the released shapes: 44 joint blocks of 637.7M, 4 refiner blocks of 268.4M.
    assert abs(sum(p.numel() for p in model.blocks[0].parameters()) - 637.7e6) < 0.1e6
    assert abs(sum(p.numel() for p in model.refiner[0].parameters()) - 268.4e6) < 0.1e6


def test_meta_build_then_init_weights_matches_a_direct_build():
    # init_weights must overwrite every parameter: to_empty leaves garbage wherever it does not.
    direct = PanVideoDiffusionTransformer(PanDiTConfig(**TINY))
    torch.manual_seed(3)
    direct.init_weights()
    with torch.device("meta"):
        meta = PanVideoDiffusionTransformer(PanDiTConfig(**TINY))
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.init_weights()
    for (name, a), b in zip(direct.state_dict().items(), meta.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_packed_forward_equals_per_sample_forwards():
    model = tiny_model()
    x, sigmas, text, pack = batch(model)
    with torch.no_grad():
        packed = model(x, sigmas, text, pack)
        v0 = t0 = 0
        for i, (grid, tl) in enumerate(zip(GRIDS, TEXT_LENS)):
            nv = grid[0] * grid[1] * grid[2]
            alone = model(x[v0:v0 + nv], sigmas[i:i + 1], text[t0:t0 + tl], PackInfo.build([grid], [tl]))
            torch.testing.assert_close(packed[v0:v0 + nv], alone, rtol=1e-10, atol=1e-10)
            v0, t0 = v0 + nv, t0 + tl
    assert packed.shape == (x.shape[0], 3 * 4)


def test_attention_does_not_leak_across_samples():
    model = tiny_model()
    x, sigmas, text, pack = batch(model)
    nv0, nv1 = 12, 8
    x2, text2, sigmas2 = x.clone(), text.clone(), sigmas.clone()
    x2[nv0:nv0 + nv1] += 1.0              # sample 1's video, caption and timestep change
    text2[5:8] -= 1.0
    sigmas2[1] = 1 - sigmas2[1]
    with torch.no_grad():
        a, b = model(x, sigmas, text, pack), model(x2, sigmas2, text2, pack)
    torch.testing.assert_close(a[:nv0], b[:nv0], rtol=0, atol=0)
    torch.testing.assert_close(a[nv0 + nv1:], b[nv0 + nv1:], rtol=0, atol=0)
    assert (a[nv0:nv0 + nv1] - b[nv0:nv0 + nv1]).abs().max() > 1e-3


def test_gradients_are_exact_through_the_packed_layout():
    # Joint/stream permutations and per-sample broadcasts have hand-picked backwards: check them
    # against finite differences, with and without captions.
    model = tiny_model(in_channels=2, patch_size=[1, 1, 1], hidden_size=16, num_attention_heads=2,
                       rope_axes_dim=[2, 2, 4], text_embed_dim=4)
    for text_lens in ([2, 1], [0, 0]):
        x, sigmas, text, pack = batch(model, grids=[(1, 1, 2), (1, 2, 1)], text_lens=text_lens)
        x.requires_grad_(True)
        text.requires_grad_(True)
        assert torch.autograd.gradcheck(lambda a, b: model(a, sigmas, b, pack), (x, text))


class FakeContextParallel(torch.nn.Module):
    """Ulysses stand-in inside one process: each cp rank is a thread; an attention call gathers every
    rank's q/k/v rows into the full sequence, attends, and hands each rank its own rows back."""

    def __init__(self, cp_size: int):
        super().__init__()
        self.cp_size = cp_size
        self.barrier = threading.Barrier(cp_size)
        self.rank = threading.local()
        self.slots = [None] * cp_size

    def forward(self, q, k, v, segments):
        self.slots[self.rank.value] = (segments.local_index, q, k, v)
        self.barrier.wait()
        full = [q.new_zeros(segments.total, *q.shape[1:]) for _ in range(3)]
        for index, *qkv in self.slots:
            for dst, src in zip(full, qkv):
                dst[index] = src
        self.barrier.wait()                 # everyone has read the slots before they are reused
        return attention(*full, segments.unsharded(), "sdpa")[segments.local_index]


@pytest.mark.parametrize("cp_size", [2, 3])
def test_context_parallel_shards_reproduce_the_unsharded_forward(cp_size):
    model = tiny_model()
    x, sigmas, text, pack = batch(model)
    with torch.no_grad():
        expected = model(x, sigmas, text, pack)
    cp = FakeContextParallel(cp_size)
    for module in model.modules():        # attach from outside, as pan.parallel does
        if hasattr(module, "inner_attention"):
            module.inner_attention = cp
    outputs, errors = [None] * cp_size, []

    def run_rank(rank):
        try:
            cp.rank.value = rank
            shard = pack.shard(rank, cp_size)
            x_local, text_local = shard.shard_inputs(x, text)
            with torch.no_grad():
                outputs[rank] = (shard, model(x_local, sigmas, text_local, shard))
        except Exception as e:  # surfaced below; a dead rank would hang the others at the barrier
            errors.append(e)
            cp.barrier.abort()

    threads = [threading.Thread(target=run_rank, args=(r,)) for r in range(cp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    got = torch.empty_like(expected)
    for shard, out in outputs:
        assert out.shape[0] == shard.num_video_tokens
        got[shard.video_index] = out
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_zero_init_modulation_makes_every_block_the_identity():
    # AdaLN-Zero: all gates 0, so the final layer sees the patch embedding itself (not the caption),
    # and the zeroed output projection makes the first prediction exactly 0.
    model = tiny_model(zero_init_modulation=True)
    x, sigmas, text, pack = batch(model)
    seen = {}
    model.final.register_forward_pre_hook(lambda m, args: seen.update(final_in=args[0]))
    with torch.no_grad():
        out = model(x, sigmas, text, pack)
        torch.testing.assert_close(seen["final_in"], model.patch_embed(x), rtol=0, atol=0)
    assert out.abs().max() == 0
    # Without it the blocks mix the caption into the video tokens from the start.
    model = tiny_model(zero_init_modulation=False)
    with torch.no_grad():
        a = model(x, sigmas, text, pack)
        b = model(x, sigmas, text + 1, pack)
    assert (a - b).abs().max() > 1e-3


def test_hidden_matrices_split_attention_and_mlp_weights_from_the_rest():
    model = tiny_model()
    hidden = model.hidden_matrices()
    params = dict(model.named_parameters())
    for name, splits in hidden.items():
        assert params[name].ndim == 2 and sum(splits) == params[name].shape[0], name
    expected = set()
    for i in range(2):
        expected |= {f"blocks.{i}.{s}_{p}.weight" for s in ("video", "text") for p in ("out",)}
        expected |= {f"blocks.{i}.{s}_qkv.qkv.weight" for s in ("video", "text")}
        expected |= {f"blocks.{i}.{s}_mlp.fc{j}.weight" for s in ("video", "text") for j in (1, 2)}
    expected |= {"refiner.0.attn_qkv.qkv.weight", "refiner.0.attn_out.weight",
                 "refiner.0.ffn.w13.weight", "refiner.0.ffn.w2.weight",
                 "single_blocks.0.linear1.weight", "single_blocks.0.linear2.weight"}
    assert set(hidden) == expected
    assert hidden["blocks.0.video_qkv.qkv.weight"] == (32, 32, 32)
    assert hidden["single_blocks.0.linear1.weight"] == (32, 32, 32, 64)


def test_forward_flops_match_flop_counter():
    model = tiny_model(num_layers=2, num_single_layers=1, num_refiner_layers=2).float()
    x, sigmas, text, pack = batch(model)
    x, sigmas, text = x.float(), sigmas.float(), text.float()
    # The math SDPA backend decomposes into matmuls, which FlopCounterMode counts independently
    # of any registered attention formula.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fwd:
        out = model(x, sigmas, text, pack)
    assert fwd.get_total_flops() == model.forward_flops(pack)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as step:
        model(x, sigmas, text, pack).square().mean().backward()
    # Backward skips the input grads of the two linears whose inputs need none (the patch tokens and
    # the sinusoidal timestep features): 3x forward minus those two matmuls.
    patch_embed = 2 * x.shape[0] * x.shape[1] * model.config.hidden_size
    timestep_fc1 = 2 * len(GRIDS) * model.config.timestep_freq_dim * model.config.hidden_size
    assert step.get_total_flops() == 3 * model.forward_flops(pack) - patch_embed - timestep_fc1
    assert out.shape[0] == x.shape[0]


def test_legacy_names_map_old_keys_onto_real_fields():
    fields = {f.name for f in dataclasses.fields(PanDiTConfig)}
    assert set(LEGACY_NAMES.values()) <= fields
    assert not set(LEGACY_NAMES) & fields
    assert LEGACY_NAMES["heads_num"] == "num_attention_heads"
    assert LEGACY_NAMES["mm_double_blocks_depth"] == "num_layers"


@pytest.mark.parametrize("overrides, key", [
    (dict(hidden_size=30, num_attention_heads=4), "num_attention_heads"),
    (dict(rope_axes_dim=[4, 6, 4]), "rope_axes_dim"),                 # sums to 14, head dim 16
    (dict(rope_axes_dim=[5, 5, 6]), "rope_axes_dim"),                 # odd
    (dict(num_layers=0, num_single_layers=0), "num_layers"),
    (dict(timestep_freq_dim=7), "timestep_freq_dim"),
    (dict(patch_size=[1, 0, 2]), "patch_size"),
])
def test_config_validation_names_the_bad_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        PanDiTConfig(**{**TINY, **overrides}).check(None)
    assert e.value.key == f"transformer_config_overrides.{key}"
    with pytest.raises(ConfigError):
        PanVideoDiffusionTransformer(PanDiTConfig(**{**TINY, **overrides}))


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    model = PanVideoDiffusionTransformer(PanDiTConfig(**{**TINY, "hidden_size": 64, "num_attention_heads": 4,
                                                         "rope_axes_dim": [4, 6, 6]}))
    x, sigmas, text, pack = batch(model)
    x, sigmas, text = x.float(), sigmas.float(), text.float()
    target = torch.randn(x.shape[0], 12, generator=torch.Generator().manual_seed(5))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(30):  # a fixed number of steps, not seconds: the result must not depend on load
        loss = F.mse_loss(model(x, sigmas, text, pack), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 20, (losses[0], losses[-1])   # measured: / 250 after 30 steps


def test_compiled_blocks_do_not_recompile_for_each_new_batch_layout():
    """compile_transformer compiles each block; packed batches change their number of samples and
    every sample's size each step. After the first few layouts (static, then dynamic shapes, and
    one sample vs several) new layouts must reuse the compiled code, not recompile each step until
    torch's recompile limit silently drops the blocks back to eager; and the results must equal
    eager ones."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    eager = tiny_model().float()
    compiled = tiny_model().float()
    counter = CompileCounter()  # dynamo's guards and recompiles, without inductor's codegen time
    for block in compiled.fsdp_blocks():
        block.compile(backend=counter)
    frames = []
    for step in range(12):
        n = 1 + step % 4
        grids = [(1 + (step + i) % 3, 2 + (step * i) % 3, 2 + i % 2) for i in range(n)]
        x, t, text, pack = batch(eager, grids, [3 + (step + i) % 5 for i in range(n)], seed=step)
        x, t, text = x.float(), t.float(), text.float()
        torch.testing.assert_close(compiled(x, t, text, pack), eager(x, t, text, pack), rtol=1e-5, atol=1e-6)
        frames.append(counter.frame_count)
    assert frames[-1] == frames[5], frames  # the last six layouts, all new, compiled nothing
    torch._dynamo.reset()
