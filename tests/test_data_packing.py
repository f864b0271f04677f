"""The lookahead best-fit packer: budgets, bounded delay, determinism and efficiency."""

from __future__ import annotations

import random

import pytest

from pan.data.packing import LookaheadPacker, Pending, take_batch

BUCKETS_720P = [(704, 1248), (1248, 704), (960, 960)]


def wan_tokens(t: int, h: int, w: int) -> int:
    """Wan 2.2 (4x time, 16x space) with patch (1, 2, 2): 858 tokens per latent frame at 704x1248."""
    return ((t - 1) // 4 + 1) * (h // 32) * (w // 32)


def mixed_sizes(rng: random.Random, image_prob: float) -> int:
    """A mixed-resolution set: three aspect buckets, clips of 17..121 frames, and images."""
    h, w = rng.choice(BUCKETS_720P)
    frames = 1 if rng.random() < image_prob else rng.choice(range(17, 122, 4))
    return wan_tokens(frames, h, w)


def run_packer(packer: LookaheadPacker, sizes, batches: int) -> list[list[Pending]]:
    out, seq = [], 0
    for _ in range(batches):
        while packer.wants_more():
            packer.add(seq, next(sizes), seq)
            seq += 1
        out.append(packer.take())
    return out


def endless(image_prob: float, seed: int = 0):
    rng = random.Random(seed)
    while True:
        yield mixed_sizes(rng, image_prob)


def test_oldest_first_then_best_fit_within_budget_and_cap():
    def buffer():
        return [Pending(i, t, i) for i, t in enumerate([50, 30, 30, 20, 10, 5, 5, 5])]
    # oldest (50), then the largest that still fits: 10 (20 and 30 do not fit the 14 left)
    assert [p.seq for p in take_batch(buffer(), budget=64, max_samples=8)] == [0, 4]
    # budget 100: 50 + 30 + 20 fills it exactly; a cap of 2 samples stops after 50 + 30
    assert [p.seq for p in take_batch(buffer(), budget=100, max_samples=8)] == [0, 1, 3]
    left = buffer()
    assert [p.seq for p in take_batch(left, budget=100, max_samples=2)] == [0, 1]
    assert [p.seq for p in left] == [2, 3, 4, 5, 6, 7]  # the rest stays, in arrival order


def test_a_sample_larger_than_the_budget_is_refused():
    packer = LookaheadPacker(budget=100, max_samples=4, lookahead=2)
    with pytest.raises(ValueError):
        packer.add(0, 101, None)


@pytest.mark.parametrize("image_prob", [0.0, 0.3])
def test_efficiency_on_a_mixed_resolution_set(image_prob):
    budget = 65536  # about 2.5 of the longest clips (121 frames at 720p = 26,598 tokens)
    batches = run_packer(LookaheadPacker(budget, 64, 32), endless(image_prob), 300)
    efficiency = [sum(p.tokens for p in b) / budget for b in batches]
    assert all(sum(p.tokens for p in b) <= budget for b in batches)
    assert sum(efficiency) / len(efficiency) >= 0.97


def test_more_lookahead_packs_tighter():
    def mean_efficiency(lookahead):
        batches = run_packer(LookaheadPacker(65536, 64, lookahead), endless(0.0, seed=1), 200)
        return sum(sum(p.tokens for p in b) for b in batches) / (65536 * len(batches))
    assert mean_efficiency(1) < mean_efficiency(8) < mean_efficiency(32)


def test_no_sample_waits_long_and_none_is_lost():
    packer = LookaheadPacker(65536, 64, 16)
    sizes, arrived, left, seq = endless(0.3, seed=2), {}, {}, 0
    for i in range(400):
        while packer.wants_more():
            packer.add(seq, next(sizes), seq)
            arrived[seq] = i
            seq += 1
        for p in packer.take():
            assert p.seq not in left  # nothing packed twice
            left[p.seq] = i
    assert set(left) | {p.seq for p in packer.buffer} == set(arrived)  # nothing lost
    # The oldest sample always goes first, and the buffer never holds more than max_samples (64),
    # so every sample leaves within 64 batches of its arrival.
    assert max(left[s] - arrived[s] for s in left) <= 64


def test_same_input_same_batches():
    a = run_packer(LookaheadPacker(65536, 64, 32), endless(0.3, seed=3), 50)
    b = run_packer(LookaheadPacker(65536, 64, 32), endless(0.3, seed=3), 50)
    assert [[p.seq for p in x] for x in a] == [[p.seq for p in x] for x in b]
