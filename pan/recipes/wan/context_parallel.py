"""Context parallel for the Wan recipe's micro-batches: cp rank 0's whole `WanBatch` -> every rank's share.

Each trained expert's inputs are split as the transformer takes them under Ulysses (model.py, `WanPlan`):
the video rows (tokens, targets, loss weights, and per-token TI2V timesteps) strided over the group as
`PackInfo.shard` says, the caption rows, I2V's image rows and per-sample values (timesteps, sigmas)
whole on every rank (the cross-attention's keys and values are every text and image row of a sample).
The batch's counters stay on cp rank 0 (`samples`, `tokens`, `bad_samples`, each expert's `counted`),
so that sums over all ranks count each sample once. This module imports no other of the recipe's: the
batch's types come with it (task.py imports this one).
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from pan.parallel.context_parallel import ContextParallel

VIDEO, WHOLE = "video", "whole"


def split_of(inputs) -> dict[str, str]:
    """How each tensor field of one expert's inputs is split over the cp group."""
    per_token = inputs.timesteps.shape[0] != inputs.pack.num_samples
    split = {"x": VIDEO, "target": VIDEO, "weight": VIDEO, "timesteps": VIDEO if per_token else WHOLE,
             "text": WHOLE, "sigmas": WHOLE}
    if getattr(inputs, "image", None) is not None:   # I2V: each sample's CLIP rows, keys like the text
        split["image"] = WHOLE
    return split


def share_batch(cp: ContextParallel | None, batch):
    """cp rank 0 passes its whole micro-batch, the others None; every rank gets back its share."""
    if cp is None or cp.size == 1:
        return batch
    if (batch is None) != (cp.rank != 0):
        raise ValueError("exactly cp rank 0 provides the Wan micro-batch to share.")
    box = [None]
    if cp.rank == 0:
        box = [{"type": type(batch), "parts": list(batch.parts),
                "scalars": {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if f.name != "parts"}}]
    dist.broadcast_object_list(box, group=cp.group, group_src=0, device=cp.device)
    meta = box[0]
    parts = {}
    for name in meta["parts"]:
        mine = batch.parts[name] if cp.rank == 0 else None
        parts[name] = cp.distribute(mine, split_of(mine) if mine is not None else None)
    scalars = dict(meta["scalars"])
    if cp.rank:
        scalars.update(samples=0, tokens=0, bad_samples=0, counted=dict.fromkeys(scalars["counted"], 0))
    return meta["type"](parts=parts, **scalars)
