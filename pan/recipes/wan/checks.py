"""`pan check`'s rows of the Wan recipe (its `checks` hook): the folder as its JSON files describe it
(the variant, each expert's sizes, the text encoder and the VAE; of the weights only the headers
are read, against the model each trained expert builds: the run loads them strictly at start), a
sample of every data source read as training reads it, the shared run rows, and memory: the shared
estimate (probe.py's micro-batch traced on fake tensors) beside the same parameters, gradients and
optimizer states counted by hand from config.json (`hand_count`).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from pan.lora.adapters import base_names
from pan.models.pyramid_io import weight_files
from pan.models.state_dict import ShapeDiff
from pan.preflight.checks import (
    check_cpu,
    check_data,
    check_layout,
    check_memory,
    check_output_dir,
    check_resume,
    check_step_time,
    check_warm_start,
    gib,
)
from pan.preflight.core import Preflight, Row
from pan.recipes.wan.probe import encodes_online, hand_count, loads_text_encoder, transformer_parameters
from pan.recipes.wan.weights import IGNORED_KEYS, load_config


# safetensors' own bound on a header (its loader refuses larger ones)
MAX_HEADER_BYTES = 100_000_000


def stored_shapes(folder: Path) -> dict[str, tuple[int, ...]] | None:
    """name -> shape from the safetensors headers of a transformer folder (one file or the shards its
    index lists), less the tensors diffusers' loader drops; None where it holds no weights (the config
    check refuses that for a trained expert: `missing_weights`). Only each file's header is read (no
    mapping of the file: a 14B expert is 57 GB); a file shorter or longer than its header says (a
    download cut short) raises ValueError naming it."""
    try:
        files = weight_files(folder)
    except FileNotFoundError:
        return None
    shapes = {}
    for path in files:
        shapes.update(header_shapes(path))
    return {k: v for k, v in shapes.items() if not IGNORED_KEYS.fullmatch(k)}


def header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of a safetensors file's header; ValueError when it is not one, or when the file's
    length is not the header's (8 bytes, the header, then every tensor's bytes)."""
    with open(path, "rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < size <= MAX_HEADER_BYTES:
            raise ValueError(f"{path} is not a safetensors file (no header)")
        try:
            header = json.loads(f.read(size))
            tensors = {k: v for k, v in header.items() if k != "__metadata__"}
            end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
            shapes = {k: tuple(int(n) for n in v["shape"]) for k, v in tensors.items()}
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise ValueError(f"{path}'s safetensors header cannot be read ({type(e).__name__}: {e})") from None
    length = path.stat().st_size
    if length != 8 + size + end:
        raise ValueError(f"{path} is {length:,} bytes, where its header describes {8 + size + end:,}: the file is "
                         "incomplete or damaged")
    return shapes


def check_wan_folder(ctx: Preflight) -> list[Row]:
    """The release the folder holds: its pipeline, experts, conditioning and each expert's sizes (from
    config.json), the parameters counted by hand against the model pan builds from it, and each trained
    expert's weights (their safetensors headers) against that model."""
    job = ctx.job
    folder = job.model.folder()
    rows, counted = [], {}
    for name in folder.experts:
        c = load_config(folder.expert_dir(name))
        matrices, vectors = transformer_parameters(c)
        counted[name] = matrices + vectors
        trained = name in job.model.trained_experts()
        rows.append(f"{name}{'' if trained else ' (not trained)'}: {c.num_layers} blocks, width "
                    f"{c.inner_dim} ({c.num_attention_heads} heads x {c.attention_head_dim}), MLP {c.ffn_dim}, "
                    f"patch {c.patch_size}, {c.in_channels} -> {c.output_channels} channels, text {c.text_dim}: "
                    f"{(matrices + vectors) / 1e9:.3f}B parameters")
    built = {name: sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
             for name, model in ctx.models.items()}
    differ = {name: (n, counted[name]) for name, n in built.items() if n != counted[name]}
    if differ:
        return [Row("wan folder", "fail", f"the transformers built from {folder.path}'s config.json files have "
                    f"other parameter counts than their values give (built, counted): {differ}.",
                    "report this: the hand count (pan/recipes/wan/probe.py) and the model disagree.")]
    # the weights each trained expert loads strictly at start, from their headers
    for name, model in ctx.models.items():
        try:
            stored = stored_shapes(folder.expert_dir(name))
        except ValueError as e:
            return [Row("wan folder", "fail", f"{e}.", f"download the release's {name}/ folder again, whole.")]
        if stored is None:
            continue
        diff = ShapeDiff.of(stored, {k: tuple(v.shape) for k, v in base_names(model.state_dict()).items()})
        if diff.differ or diff.unexpected:
            examples = diff.lines("missing") + [f"{n} not in the model" for n in diff.unexpected]
            return [Row("wan folder", "fail", f"{folder.expert_dir(name)}'s weights do not fit the transformer its "
                        f"config.json describes: {len(diff.missing)} model tensors missing, {len(diff.unexpected)} "
                        f"not in the model, {len(diff.mismatched)} of another shape (e.g. {'; '.join(examples[:3])}).",
                        f"copy the release's {name}/ folder whole (config.json and its safetensors together).")]
    boundary = (f"; experts split at boundary_ratio {folder.boundary_ratio} (transformer: t >= it)"
                if len(folder.experts) == 2 else "")
    return [Row("wan folder", "pass", f"{folder.path}: {folder.pipeline}, {folder.derived_conditioning}"
                f"{boundary}; trains {', '.join(job.model.trained_experts())} "
                f"({job.model.resolved_conditioning()}).\n" + "\n".join(rows)
                + "\n(config.json and the weights' headers: the weights are loaded strictly when the run "
                "starts.)")]


def check_text_encoder(ctx: Preflight) -> list[Row]:
    """umT5's shape (text_encoder/config.json) and whether training loads it."""
    folder = ctx.job.model.folder()
    path = folder.text_encoder_dir / "config.json"
    loaded = loads_text_encoder(ctx.job)
    if not path.is_file():
        if loaded:
            return [Row("text encoder", "fail", f"{path} is missing, and training encodes captions (or the empty "
                        "caption) with umT5.", "copy the folder's text_encoder/ and tokenizer/, or precompute "
                        "every row and the empty caption (`pan data precompute`).")]
        return [Row("text encoder", "pass", "not in the folder, and not loaded in training: every caption and the "
                    "empty caption are precomputed.")]
    config = json.loads(path.read_text())
    shape = (f"umT5 {config.get('num_layers')} layers, width {config.get('d_model')} (MLP {config.get('d_ff')}, "
             f"{config.get('num_heads')} heads), {ctx.job.model.max_text_tokens} rows per caption")
    where = ("loaded on every data-reading rank (captions encoded in training)" if loaded else
             "not loaded in training: every caption and the empty caption are precomputed")
    return [Row("text encoder", "pass", f"{shape}; {where}.")]


def check_vae(ctx: Preflight) -> list[Row]:
    """The VAE's latent geometry (vae/config.json) against the transformer's channels and patches."""
    folder, geometry = ctx.job.model.folder(), ctx.task.geometry
    pt, ph, pw = folder.transformer.patch_size
    where = ("loaded (fp32) on every data-reading rank: some rows are encoded in training"
             if encodes_online(ctx.job) else "not loaded in training: every row is precomputed")
    return [Row("vae", "pass", f"AutoencoderKLWan: {geometry.latent_channels} latent channels, "
                f"{geometry.temporal_factor}x in time, {geometry.spatial_factor}x in space; a token is "
                f"{pt}x{ph * geometry.spatial_factor}x{pw * geometry.spatial_factor} latent frames x pixels; "
                f"{where}.")]


def check_memory_by_hand(ctx: Preflight) -> list[Row]:
    """Parameters, gradients and optimizer states per device counted from config.json alone, beside the
    estimate's (which counts them from the model built on the meta device): they must agree."""
    if ctx.job.lora.enabled and ctx.job.lora.lora_target_modules is not None:
        return [Row("memory by hand", "pass", "not counted by hand: the hand count covers adapters on every "
                    "linear of every block (lora_target_modules: null); the estimate counts these targets.")]
    count = hand_count(ctx)
    mine = count.bytes
    est = ctx.estimate.device
    differ = [f"{k} {gib(mine[k])} by hand, {gib(est.get(k, 0))} estimated"
              for k in ("parameters", "frozen parameters", "optimizer states") if mine[k] != est.get(k, 0)]
    if est.get("gradients", 0) > mine["gradients"]:
        differ.append(f"gradients {gib(est['gradients'])} estimated, more than all of them ({gib(mine['gradients'])})")
    if differ:
        return [Row("memory by hand", "fail", "; ".join(differ) + ".", "report this: the hand count "
                    "(pan/recipes/wan/probe.py) and the estimate disagree.")]
    return [Row("memory by hand", "pass", count.arithmetic() + f"; the estimate's gradients at the peak: "
                f"{gib(est.get('gradients', 0))}, activations {gib(est.get('activations', 0))}.")]


# `pan check`'s table, in order: the layout, the folder, what the run reads, the machine and the output
# folder, then memory (the estimate, and by hand) and step time (`pan.recipes.wan.probe.wan_probe`).
CHECKS = [check_layout, check_wan_folder, check_text_encoder, check_vae, check_data, check_warm_start, check_cpu,
          check_output_dir, check_resume, check_memory, check_memory_by_hand, check_step_time]
