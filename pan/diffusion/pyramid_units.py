"""The units of autoregressive pyramid training and sampling: a clip is cut in units of
`frame_per_unit` latent frames (the first unit is frame 0 alone, an image); a column trains one unit
and reads the ones before it as history clips, at decreasing resolution going back in time (the
temporal pyramid). How many units each stage's columns train on, the frames of a unit count, and
where each history clip lies in the pyramid.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor


def stage_unit_counts(*, step: int, rank: int, video_sync_group: int, frame_per_unit: int,
                      max_frames: int, clip_units: int, stages: int = 3) -> list[int]:
    """Units (groups of `frame_per_unit` latent frames; the first unit is frame 0 alone) each stage's
    columns train on, for the `step`-th call on this rank (0 for the first call).

    The highest stage's count walks through 1..M (M = units of `max_frames` latent frames) as the
    rank within its video sync group and the call count advance; lower stages take the rest,
    1 + M - high, so every column carries about the same number of tokens. Counts are clipped to
    [1, clip_units], the units of this batch's clip. Returns [low, ..., low, high].
    """
    units_max = 1 + (max_frames - 1) // frame_per_unit
    turns = units_max // video_sync_group
    if turns < 1:
        raise ValueError(f"video_sync_group ({video_sync_group}) must be <= the units of max_frames "
                         f"({units_max})")
    turn = (step + 1) % turns  # the original advances its counter before using it
    high = rank % video_sync_group + 1 + turn * video_sync_group
    low = max(1 + units_max - high, 1)
    return [min(n, clip_units) for n in [low] * (stages - 1) + [high]]


def unit_frames(units: int, frame_per_unit: int) -> int:
    """Latent frames of the first `units` units: the first unit is frame 0 alone (an image)."""
    return 1 + (units - 1) * frame_per_unit


def history_spans(stage: int, units: int, frames: int, frame_per_unit: int) -> list[tuple[int, int, int]]:
    """(pyramid level, first frame, end frame) of each history clip of a column of `stage` that
    trains its `units`-th unit, newest first; `frames` = frames up to and including that unit.

    The temporal pyramid: the previous unit at the column's own stage, then one older unit per lower
    stage down to stage 1, then every older frame as one clip at stage 0. Units are counted back
    from the end, so any prefix (a truncated history at sampling time) works the same.
    """
    if units < 2:
        return []

    def unit_back(k: int) -> tuple[int, int]:  # the k-th unit before the trained one (k = 0: it)
        return max(frames - (k + 1) * frame_per_unit, 0), frames - k * frame_per_unit

    spans = [(stage, *unit_back(1))]
    taken, level = 2, stage
    while taken < units:
        level = max(level - 1, 0)
        if level == 0:
            break
        spans.append((level, *unit_back(taken)))
        taken += 1
    if level == 0 and taken < units:
        spans.append((0, 0, frames - taken * frame_per_unit))
    return spans


def history_clips(latents: Sequence[Tensor], stage: int, units: int, frames: int,
                  frame_per_unit: int) -> list[Tensor]:
    """The clean history clips (see `history_spans`) of pyramid levels [b, C, T, h_k, w_k], newest first."""
    return [latents[level][:, :, start:end]
            for level, start, end in history_spans(stage, units, frames, frame_per_unit)]
