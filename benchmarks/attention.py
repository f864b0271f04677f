"""Attention backends under the full and the block-causal rule: time and peak memory, side by side.

One packed batch of 16-frame samples (default: 2 samples of 16 x 8 x 8 video tokens + 32 caption
tokens, 4 heads of 64, fp32), attended by each backend under both rules:
- `sdpa`: one SDPA call per sample (the block-causal rule as a per-sample [Ls, Ls] mask built lazily);
- `blockwise`: block-causal samples as unmasked calls, one per frame's queries (full = sdpa);
- `dense`: one SDPA call over the whole pack with one [L, L] mask (the layout the backends avoid);
- `flex`: torch's flex_attention with the pack's BlockMask, eager and (unless --no-compile) compiled.
  torch has no flex backward on CPU, so on CPU flex is timed forward only.

Times are medians of interleaved rounds (every candidate once per round): `train` is a forward +
backward, `fwd` a forward alone (no grad); `_ms` is wall time, `_cpu_ms` this process's CPU time
(steadier on a shared machine; it also counts OpenMP threads spinning at barriers). Ratios put each
block-causal cost over the full rule measured in the same rounds: `/own_full` against the same
candidate, `/sdpa_full` against per-sample sdpa. The load average before and after is printed: on
an oversubscribed CPU, candidates made of many small kernels (blockwise) lose most. `peak_MB`: the
peak of the bytes torch allocates during one call above what was live before it (torch.profiler's
memory events, CPU allocator included; the training call where there is one); `mask_MB`: the bytes
of the masks the candidate builds (counted, not measured).

    OMP_NUM_THREADS=2 python benchmarks/attention.py [--frames 16] [--hw 8] [--threads 2] [--no-flex]
                                                     [--out benchmarks/results/attention.json]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

try:
    from benchmarks.common import interleaved_times, median, print_table, write_json
except ModuleNotFoundError:  # run as `python benchmarks/attention.py`: its folder is on the path
    from common import interleaved_times, median, print_table, write_json
from pan.models.attention import attention, flex_block_mask
from pan.models.packing import AttnSegments, PackInfo, SampleLayout

RULES = ("full", "block_causal")


def packed_segments(args, rule: str) -> AttnSegments:
    layouts = [SampleLayout.single((args.frames, args.hw, args.hw), args.text, rule)] * args.samples
    return PackInfo.from_layouts(layouts).joint


def whole_pack_mask(segments: AttnSegments) -> torch.Tensor:
    """[L, L] bool: same sample AND frame_q >= frame_k (the one dense mask the backends avoid)."""
    seqlens = torch.tensor(segments.seqlens)
    sample = torch.repeat_interleave(torch.arange(len(seqlens)), seqlens)
    frames = segments.frames or (None,) * len(seqlens)
    frame = torch.cat([torch.zeros(n, dtype=torch.int64) if f is None else f
                       for n, f in zip(segments.seqlens, frames)])
    return (sample[:, None] == sample[None, :]) & (frame[:, None] >= frame[None, :])


def dense_attention(mask: torch.Tensor) -> Callable:
    def run(q, k, v, segments):
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)[0].transpose(0, 1)
    return run


def compiled_flex(segments: AttnSegments) -> Callable:
    """flex_attention compiled for this pack (forward only on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = flex_block_mask(segments, torch.device("cpu"))
    kernel = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v, segments):
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        return kernel(qs, ks, vs, block_mask=block_mask)[0].transpose(0, 1)
    return run


def backend(name: str) -> Callable:
    return lambda q, k, v, segments: attention(q, k, v, segments, name)


def training_call(fn, segments, qkv, grad_out) -> Callable[[], None]:
    leaves = [t.clone().requires_grad_() for t in qkv]

    def step():
        for t in leaves:
            t.grad = None
        fn(*leaves, segments).backward(grad_out)
    return step


def forward_call(fn, segments, qkv) -> Callable[[], None]:
    def step():
        with torch.no_grad():
            fn(*qkv, segments)
    return step


def peak_bytes(fn: Callable[[], None]) -> int | None:
    """Peak bytes allocated by torch during fn() above the level before it (profiler memory events)."""
    fn()  # warm: lazily built masks and compiled kernels are not part of a call's peak
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    try:
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    except AttributeError:  # the profiler's raw events moved: report no number rather than a wrong one
        return None
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def candidates(args) -> list[dict]:
    """Every (name, rule) measured: its callables and the bytes of the masks it builds."""
    rows = []
    for rule in RULES:
        seg = packed_segments(args, rule)
        largest = max(seg.seqlens)
        mine = [
            {"name": "sdpa", "fn": backend("sdpa"), "mask_bytes": 0 if rule == "full" else largest ** 2},
            {"name": "blockwise", "fn": backend("blockwise"), "mask_bytes": 0},
            {"name": "dense", "fn": dense_attention(whole_pack_mask(seg)), "mask_bytes": seg.total ** 2}]
        if args.flex:
            mine.append({"name": "flex eager", "fn": backend("flex"), "forward_only": True})
        if args.flex and args.compile:
            mine.append({"name": "flex compiled", "fn": compiled_flex(seg), "forward_only": True})
        rows += [{**row, "rule": rule, "key": f"{row['name']}/{rule}", "segments": seg} for row in mine]
    return rows


def flex_setup_seconds(args) -> dict:
    """One-off costs of flex per pack: building the BlockMask, compiling (first call) when asked."""
    out = {}
    for rule in RULES:
        seg = packed_segments(args, rule)
        start = time.perf_counter()
        block_mask = flex_block_mask(seg, torch.device("cpu"))
        out[f"block_mask_{rule}_s"] = time.perf_counter() - start
        out[f"block_mask_{rule}_bytes"] = sum(t.numel() * t.element_size() for t in block_mask.as_tuple()
                                             if isinstance(t, torch.Tensor))
    return out


def measure(rows: list[dict], args) -> dict:
    """Check each candidate against the reference, then time all of them side by side and take
    their memory; fills the rows in place and returns the raw times."""
    total = rows[0]["segments"].total
    qkv = [torch.randn(total, args.heads, args.head_dim) for _ in range(3)]
    grad_out = torch.randn(total, args.heads, args.head_dim)
    reference = {rule: attention(*qkv, packed_segments(args, rule), "sdpa") for rule in RULES}
    train, infer = {}, {}
    for row in rows:
        with torch.no_grad():   # correctness first: every candidate gives the reference's answer
            out = row["fn"](*qkv, row["segments"])
        row["max_err"] = (out - reference[row["rule"]]).abs().max().item()
        infer[row["key"]] = forward_call(row["fn"], row["segments"], qkv)
        if not row.get("forward_only"):
            train[row["key"]] = training_call(row["fn"], row["segments"], qkv, grad_out)
    times = {"train": interleaved_times(train, args.repeats), "fwd": interleaved_times(infer, args.repeats)}
    for row in rows:
        for step in ("train", "fwd"):
            for clock, suffix in (("wall", "ms"), ("cpu", "cpu_ms")):
                got = times[step].get(row["key"])
                row[f"{step}_{suffix}"] = None if got is None else 1e3 * median(got[clock])
        peak = peak_bytes(train.get(row["key"]) or infer[row["key"]])
        row["peak_MB"] = None if peak is None else peak / 1e6
        row["mask_MB"] = row["mask_bytes"] / 1e6 if "mask_bytes" in row else None
    return times


def add_ratios(rows: list[dict]) -> None:
    """Block-causal over full: against the same candidate's full rule, and against per-sample sdpa."""
    full = {r["name"]: r for r in rows if r["rule"] == "full"}
    for row in rows:
        for value in ("train_ms", "train_cpu_ms", "fwd_ms"):
            if row[value] is not None:
                row[f"{value[:-3]}/own_full"] = row[value] / full[row["name"]][value]
                row[f"{value[:-3]}/sdpa_full"] = row[value] / full["sdpa"][value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2, help="samples in the pack")
    parser.add_argument("--frames", type=int, default=16, help="latent frames per sample (post-patch)")
    parser.add_argument("--hw", type=int, default=8, help="tokens per frame side (post-patch)")
    parser.add_argument("--text", type=int, default=32, help="caption tokens per sample")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (after one warm-up round)")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="skip compiled flex (its first call compiles for seconds)")
    parser.add_argument("--no-flex", dest="flex", action="store_false",
                        help="skip flex (eager flex on CPU holds [heads, L, L] scores: slow at large L)")
    parser.add_argument("--out", default="benchmarks/results/attention.json", help="JSON output path")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")

    load_before = os.getloadavg()
    rows = candidates(args)
    times = measure(rows, args)
    add_ratios(rows)
    load_after = os.getloadavg()
    total = rows[0]["segments"].total
    print(f"pack: {args.samples} x ({args.frames} x {args.hw} x {args.hw} video + {args.text} caption) "
          f"= {total} tokens, {args.heads} heads x {args.head_dim}, fp32, {args.threads} threads, median "
          f"of {args.repeats}; load average {load_before[0]:.1f} -> {load_after[0]:.1f} "
          f"on {os.cpu_count()} cores")
    columns = ["name", "rule", "train_ms", "train/own_full", "train_cpu_ms", "train_cpu/own_full",
               "train/sdpa_full", "fwd_ms", "fwd/own_full", "peak_MB", "mask_MB", "max_err"]
    print_table([{c: ("-" if r.get(c) is None else r[c]) for c in columns} for r in rows], columns)
    setup = flex_setup_seconds(args) if args.flex else {}
    if setup:
        print("flex BlockMask build (eager, once per pack): " + ", ".join(
            f"{rule} {setup[f'block_mask_{rule}_s']:.3f} s" for rule in RULES))
    for row in rows:
        del row["fn"], row["segments"]
    path = write_json(args.out, {
        "benchmark": "attention", "samples": args.samples, "frames": args.frames, "hw": args.hw,
        "text": args.text, "heads": args.heads, "head_dim": args.head_dim, "tokens": total,
        "repeats": args.repeats, "load_average": [load_before, load_after],
        "memory": "peak_MB: peak of torch's allocations during one call above the level before it "
                  "(torch.profiler memory events); mask_MB: bytes of the masks built (counted)",
        "flex_setup": setup, "rows": rows, "times": times})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
