"""Attention backends, packed-batch bookkeeping (incl. the strided context-parallel shard), RoPE, patches."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from pan.models import AttnSegments, PackInfo, attention, patchify, set_attention_backend, unpatchify
from pan.models.attention import InnerAttention
from pan.models.rope import apply_rope, rope_frequencies


def naive_attention(q, k, v, seqlens, masks=None):
    """softmax(QK^T / sqrt(d) + block-diagonal mask) V over the whole packed sequence at once."""
    total = sum(seqlens)
    allowed = torch.zeros(total, total, dtype=torch.bool)
    start = 0
    for i, n in enumerate(seqlens):
        allowed[start:start + n, start:start + n] = True if masks is None else masks[i]
        start += n
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def random_qkv(total, heads=3, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, heads, dim, generator=g, dtype=torch.float64) for _ in range(3)]


def test_sdpa_backend_equals_naive_block_diagonal_attention():
    seqlens = [5, 0, 17, 1, 9]                      # an empty segment (caption-less sample) included
    q, k, v = random_qkv(sum(seqlens))
    out = attention(q, k, v, AttnSegments.from_lengths(seqlens), backend="sdpa")
    torch.testing.assert_close(out, naive_attention(q, k, v, seqlens), rtol=1e-10, atol=1e-10)


def test_auto_backend_on_cpu_is_sdpa_and_varlen_refuses_cpu():
    seqlens = [4, 6]
    q, k, v = random_qkv(10)
    seg = AttnSegments.from_lengths(seqlens)
    torch.testing.assert_close(attention(q, k, v, seg, "auto"), attention(q, k, v, seg, "sdpa"))
    with pytest.raises(ValueError, match="CUDA"):
        attention(q, k, v, seg, "varlen")
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention(q, k, v, seg, "flash")


def test_block_causal_frames_are_applied_per_segment():
    seqlens = [6, 4]
    q, k, v = random_qkv(10, seed=1)
    frames = torch.tensor([0, 0, 1, 1, 2, 0])             # 2 rows per frame, then a caption row
    seg = dataclasses.replace(AttnSegments.from_lengths(seqlens), frames=(frames, None))
    out = attention(q, k, v, seg, "sdpa")
    causal = frames[:, None] >= frames[None, :]
    expected = naive_attention(q, k, v, seqlens, masks=[causal, torch.ones(4, 4, dtype=torch.bool)])
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(out, attention(q, k, v, AttnSegments.from_lengths(seqlens), "sdpa"))


def test_sharded_segments_need_a_context_parallel_attention():
    pack = PackInfo.build([(1, 2, 2)], [3]).shard(1, 2)
    q = torch.randn(pack.num_video_tokens + pack.num_text_tokens, 2, 4)
    with pytest.raises(ValueError, match="context-parallel"):
        InnerAttention("sdpa")(q, q, q, pack.joint)


def test_set_attention_backend_reaches_every_inner_attention():
    model = torch.nn.Sequential(InnerAttention(), torch.nn.ModuleList([InnerAttention()]))
    set_attention_backend(model, "sdpa")
    assert [m.backend for m in model.modules() if isinstance(m, InnerAttention)] == ["sdpa", "sdpa"]
    with pytest.raises(ValueError, match="unknown attention backend"):
        set_attention_backend(model, "flash")


GRIDS = [(2, 3, 2), (1, 1, 5), (3, 2, 2)]
TEXT_LENS = [4, 0, 7]


def test_pack_layout_of_a_whole_batch():
    pack = PackInfo.build(GRIDS, TEXT_LENS)
    assert pack.video_lens == (12, 5, 12)
    assert pack.joint.seqlens == (16, 5, 19) and pack.joint.cu_seqlens.tolist() == [0, 16, 21, 40]
    assert pack.text.seqlens == (4, 0, 7) and pack.joint.max_seqlen == 19
    assert pack.video_sample.tolist() == [0] * 12 + [1] * 5 + [2] * 12
    assert pack.text_sample.tolist() == [0] * 4 + [2] * 7
    # joint order: [v0 (12); t0 (4); v1 (5); v2 (12); t2 (7)]
    assert pack.video_joint_rows.tolist() == list(range(12)) + list(range(16, 21)) + list(range(21, 33))
    assert pack.text_joint_rows.tolist() == [12, 13, 14, 15] + list(range(33, 40))
    # (t, h, w) positions in raster order within each sample
    assert pack.video_pos[:4].tolist() == [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]]
    assert pack.video_pos[12:17, 2].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("cp_size", [2, 3])
def test_strided_shards_partition_the_joint_sequence(cp_size):
    full = PackInfo.build(GRIDS, TEXT_LENS)
    total = full.joint.total
    # Full joint index of every stream row, from the unsharded layout.
    video_joint = full.video_joint_rows
    text_joint = full.text_joint_rows
    seen = torch.zeros(total, dtype=torch.long)
    for rank in range(cp_size):
        shard = full.shard(rank, cp_size)
        local = shard.joint.local_index
        assert local.tolist() == list(range(rank, total, cp_size))
        # Each local stream row sits in the local joint order at the position of its global index.
        torch.testing.assert_close(local[shard.video_joint_rows], video_joint[shard.video_index])
        torch.testing.assert_close(local[shard.text_joint_rows], text_joint[shard.text_index])
        # Per-token data is the full pack's, restricted to the held rows.
        torch.testing.assert_close(shard.video_sample, full.video_sample[shard.video_index])
        torch.testing.assert_close(shard.video_pos, full.video_pos[shard.video_index])
        torch.testing.assert_close(shard.text_sample, full.text_sample[shard.text_index])
        torch.testing.assert_close(shard.text.local_index, shard.text_index)
        assert shard.joint.seqlens == full.joint.seqlens
        seen[local] += 1
        x, t = torch.arange(full.num_video_tokens), torch.arange(full.num_text_tokens)
        xs, ts = shard.shard_inputs(x, t)
        assert xs.tolist() == shard.video_index.tolist() and ts.tolist() == shard.text_index.tolist()
    assert seen.eq(1).all()


def test_shard_rejects_bad_rank():
    with pytest.raises(ValueError):
        PackInfo.build(GRIDS, TEXT_LENS).shard(2, 2)


def test_patchify_is_the_conv3d_patch_embedding_and_unpatchify_inverts_it():
    c, patch, grid = 3, (1, 2, 2), (2, 3, 4)
    x = torch.randn(c, 2, 6, 8, dtype=torch.float64)
    tokens = patchify(x, patch)
    assert tokens.shape == (24, 12)
    torch.testing.assert_close(unpatchify(tokens, grid, patch), x)
    conv = torch.nn.Conv3d(c, 5, kernel_size=patch, stride=patch, dtype=torch.float64)
    expected = conv(x[None])[0].flatten(1).T                            # [t*h*w, 5]
    torch.testing.assert_close(F.linear(tokens, conv.weight.flatten(1), conv.bias), expected)


def test_rope_rotates_by_relative_position_only():
    axes, theta = [4, 6, 6], 256.0
    pos = torch.tensor([[0, 0, 0], [3, 1, 2], [5, 4, 4], [8, 5, 6]])
    freqs = rope_frequencies(pos, axes, theta, frame_scale=16 / 24)
    q, k = torch.randn(2, 1, 1, 16, dtype=torch.float64).unbind(0)
    rq = apply_rope(q.expand(4, 1, 16).contiguous(), freqs)
    rk = apply_rope(k.expand(4, 1, 16).contiguous(), freqs)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1).expand(4, 1), rtol=1e-5, atol=1e-5)
    dots = (rq[:, None] * rk[None]).sum(-1)[..., 0]                     # [4, 4]: <q at i, k at j>
    # Shifting every position by the same offset leaves all q.k products unchanged.
    shifted = rope_frequencies(pos + torch.tensor([7, 2, 9]), axes, theta, frame_scale=16 / 24)
    rq2 = apply_rope(q.expand(4, 1, 16).contiguous(), shifted)
    rk2 = apply_rope(k.expand(4, 1, 16).contiguous(), shifted)
    torch.testing.assert_close((rq2[:, None] * rk2[None]).sum(-1)[..., 0], dots, rtol=1e-4, atol=1e-4)
    # The frame axis is scaled: frame 3 at scale 16/24 rotates like frame 2 at scale 1.
    a = rope_frequencies(torch.tensor([[3, 0, 0]]), axes, theta, frame_scale=16 / 24)
    b = rope_frequencies(torch.tensor([[2, 0, 0]]), axes, theta, frame_scale=1.0)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, rope_frequencies(torch.tensor([[3, 0, 0]]), axes, theta, 1.0))


def test_rope_leaves_float_positions_as_they_were():
    # Positions of clips interpolated onto a reference grid are float64: scaling the frame axis must
    # not rescale the pack's own positions on every call.
    pos = torch.tensor([[1.0, 0.5, 1.5], [3.0, 2.5, 0.5]], dtype=torch.float64)
    before = pos.clone()
    first = rope_frequencies(pos, [4, 6, 6], 256.0, frame_scale=16 / 24)
    second = rope_frequencies(pos, [4, 6, 6], 256.0, frame_scale=16 / 24)
    torch.testing.assert_close(pos, before, rtol=0, atol=0)
    torch.testing.assert_close(second, first, rtol=0, atol=0)
