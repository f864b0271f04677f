"""The seeded order of a stream at any size (pan/data/plan.py): each epoch's shuffle is a bijection
of [0, N) computed slot by slot (no array of N rows in any process), the same in every process, and
an elastic resume's share of the old ranks' unfinished epochs is computed as it is drawn, its state
the old ranks' cursors (O(ranks), not O(rows)). Checked exhaustively at small sizes and by sampling
at 10 million rows."""

from __future__ import annotations

import json
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pan.data.packed import unconsumed
from pan.data.plan import Head, Planner, Shuffle, StreamOrder

REPO = Path(__file__).resolve().parents[1]
TEN_MILLION = 10_000_000


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 7, 8, 9, 100, 255, 256, 257, 1000, 4097])
def test_every_shuffle_is_a_bijection(size):
    for key in range(3):
        assert sorted(Shuffle(size, key)(i) for i in range(size)) == list(range(size))


def test_a_ten_million_row_shuffle_maps_slots_to_distinct_rows_and_holds_no_array():
    order = StreamOrder("video:clips", TEN_MILLION, seed=0, dp_rank=0, dp_size=1)
    slots = random.Random(0).sample(range(TEN_MILLION), 20_000)
    rows = [order.at(3, slot) for slot in slots]
    assert len(set(rows)) == len(rows) and all(0 <= r < TEN_MILLION for r in rows)
    # A shuffle, not a shift: neighbouring slots land far apart, and epochs differ.
    first = [order.at(0, slot) for slot in range(1000)]
    assert sum(abs(a - b) < 1000 for a, b in zip(first, first[1:])) < 5
    assert sum(order.at(1, slot) == row for slot, row in zip(range(1000), first)) < 5
    assert abs(sum(rows) / len(rows) / TEN_MILLION - 0.5) < 0.02
    assert len(pickle.dumps(order)) < 2000  # the order's whole state: no per-row array


def test_the_order_is_the_same_in_every_process():
    code = ("from pan.data.plan import StreamOrder; o = StreamOrder('video:clips', 10_000_000, 7, 0, 1); "
            "print([o.at(e, s) for e in (0, 5) for s in (0, 1, 9_999_999)])")
    here = StreamOrder("video:clips", TEN_MILLION, 7, 0, 1)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str([here.at(e, s) for e in (0, 5) for s in (0, 1, TEN_MILLION - 1)])


def test_rank_shares_are_disjoint_and_an_epoch_covers_every_row_once():
    size, dp = 1003, 4
    orders = [StreamOrder("s", size, 1, r, dp) for r in range(dp)]
    drawn = [o.index(2, pos) for o in orders for pos in range(o.share)]
    assert len(drawn) == len(set(drawn)) == size // dp * dp
    assert sorted(StreamOrder("s", size, 1, 0, 1).index(2, p) for p in range(size)) == list(range(size))


def cursor_state(size: int, epoch_pos: list[tuple[int, int]], buffers: list[list] | None = None,
                 heads: list[dict] | None = None) -> list[dict]:
    """The data cursors of len(epoch_pos) old ranks of stream "s"."""
    return [{"buffer": (buffers or [[]] * len(epoch_pos))[r],
             "planner": {"step": 0, "streams": {"s": {"epoch": e, "pos": p, "size": size}},
                         "head": {"s": heads[r]} if heads and heads[r] else {}}}
            for r, (e, p) in enumerate(epoch_pos)]


def brute_force_left(order: StreamOrder, epoch_pos: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """What the old ranks had not drawn, slot by slot (the pre-index definition)."""
    dp, share = len(epoch_pos), order.size // len(epoch_pos)
    return [(epoch, order.at(epoch, slot))
            for epoch in range(min(e for e, _ in epoch_pos), max(e for e, _ in epoch_pos) + 1)
            for slot in range(share * dp) if (epoch, slot // dp) >= epoch_pos[slot % dp]]


def test_the_old_ranks_undrawn_slots_are_exactly_the_unconsumed_ones():
    order = StreamOrder("s", 103, 0, 0, 1)
    cursors = [(2, 5), (2, 0), (3, 1), (2, 25)]
    left = unconsumed(order, cursor_state(103, cursors, [[[9, "s", 1, 3, 40]], [], [], [[11, "other", 2, 1, 7]]]), "s")
    assert sorted(left[j] for j in range(len(left))) == sorted(brute_force_left(order, cursors) + [(1, 40)])


def test_a_ten_million_row_elastic_head_is_dealt_lazily_and_saved_small():
    """4 ranks stop mid-epoch at 10 M rows; 2 ranks deal what is left: disjoint halves, every row of
    the unfinished epoch covered once with what the old ranks drew, a cursor of a few hundred bytes,
    and a resume inside the head (saved state reloaded) continuing it exactly."""
    size = TEN_MILLION
    order = StreamOrder("s", size, 0, 0, 1)
    cursors = [(0, 2_400_000), (0, 2_499_990), (0, 1_000_000), (1, 3)]
    states = cursor_state(size, cursors)
    left = unconsumed(order, states, "s")
    share = size // 4
    # epoch 0: what ranks 0-2 had not drawn; epoch 1 (rank 3's): all of ranks 0-2's shares, rank 3's rest
    assert len(left) == sum(share - p for _, p in cursors[:3]) + 3 * share + (share - 3)
    heads = [Head(left, r, 2) for r in range(2)]
    assert len(heads[0]) + len(heads[1]) == len(left)
    planners = []
    for r in range(2):
        planner = Planner({"s": StreamOrder("s", size, 0, r, 2)}, {"s": 1.0}, 0.0, seed=0, dp_rank=r)
        planner.head["s"] = heads[r]
        planners.append(planner)
    drawn = [[planners[r].next_ref() for _ in range(500)] for r in range(2)]
    assert not {(x.epoch, x.index) for x in drawn[0]} & {(x.epoch, x.index) for x in drawn[1]}
    saved = json.dumps(planners[0].state_dict())
    assert len(saved) < 1000, saved
    again = Planner({"s": StreamOrder("s", size, 0, 0, 2)}, {"s": 1.0}, 0.0, seed=0, dp_rank=0)
    again.head["s"] = Head.from_state(json.loads(saved)["head"]["s"], again.streams["s"])
    again.step = planners[0].step
    assert [again.next_ref() for _ in range(50)] == [planners[0].next_ref() for _ in range(50)]
    # Rank 0 of epoch 0 drew positions < 2.4 M: none of those rows is dealt again.
    already = {order.at(0, pos * 4) for pos in random.Random(1).sample(range(2_400_000), 2000)}
    assert not already & {index for epoch, index in (left[j] for j in range(0, len(left), 997)) if epoch == 0}


def test_a_second_resize_inside_a_head_deals_its_rest_again():
    """4 ranks -> 3 (heads dealt) -> 2 before the heads are drawn: nothing lost, nothing twice."""
    size = 101
    order = StreamOrder("s", size, 0, 0, 1)
    cursors = [(0, 10), (0, 12), (0, 9), (0, 20)]
    first = unconsumed(order, cursor_state(size, cursors), "s")
    heads = [Head(first, r, 3, taken=t) for r, t in zip(range(3), (2, 0, 5))]
    taken = [first[h.first + k * 3] for h in heads for k in range(h.taken)]
    states = cursor_state(size, [(1, 0)] * 3, heads=[h.state_dict() for h in heads])
    second = unconsumed(order, states, "s")
    everything = [first[j] for j in range(len(first))]
    again = [second[j] for j in range(len(second)) if second[j][0] == 0]
    assert sorted(taken + again) == sorted(everything) and len(set(again)) == len(again)


def test_a_head_saved_by_an_older_pan_as_a_list_is_drawn_as_listed():
    head = Head.from_state([[0, 5], [1, 7]], StreamOrder("s", 10, 0, 0, 1))
    assert len(head) == 2 and [head.popleft(), head.popleft()] == [(0, 5), (1, 7)] and not head
