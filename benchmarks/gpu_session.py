"""The first GPU hour, prepared: the checks of issue 19 that need a GPU, in one run that writes JSON.

    bash benchmarks/gpu_session.sh [--out DIR]     # one GPU; sized for < 8 minutes on an H200
    bash benchmarks/gpu_session.sh --dry-run       # the same steps at toy sizes on the CPU

Each step runs as a subprocess with its own time limit, so one that fails or hangs does not stop
the others; the session stops starting steps once its budget is spent. Results: DIR/session.json
(every step's command, exit status, seconds, its JSON result and the tail of its output), and the
JSON each benchmark writes beside it.

Steps:
- varlen: varlen attention (flash varlen) against SDPA in bf16, forward and gradients of q/k/v, on
  packs with zero-length and one-row segments, an all-empty pack, strided q/k/v views (the fused
  projection's), and block-causal segments (one varlen call per frame group). Errors are relative
  to an fp32 SDPA reference, beside SDPA's own bf16 error.
- fsdp: the trainer's own pieces on a one-rank NCCL group: build_part (FSDP2 over a mesh of one,
  bf16 mixed precision, attention `auto` = varlen), the step of StepContext, pan's Checkpointer
  saving at step 2 and resuming, for each checkpointing mode (none, full, selective). Recorded: the
  resumed steps' losses against the uninterrupted run's, how many attention forwards ran again in
  the first backward (selective: 0), the timesteps the timestep embedder got (fp32, exact), TF32.
- gpu_step: `benchmarks.gpu_step` (a ~2B model's step time, MFU and peak memory per mode).
- train_resume: `train.py` on one GPU (bf16, synthetic data), stopped after 4 steps and resumed to
  8, against an uninterrupted run of 8 (the losses of steps 5-8).
- step_time: `benchmarks.step_time --device cuda --dtype bf16 --compile`.
- tests: tests/test_gpu_paths.py with the GPU visible (PAN_TEST_CUDA=1), then two CPU suite files
  on the GPU machine as the suite runs there (GPUs hidden by tests/conftest.py).

Dry run: the same steps on the CPU, gloo for NCCL, fp32/bf16 as noted in each result, toy sizes;
varlen (CUDA only) is replaced by blockwise, so the numbers only show that the harness works.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------
# varlen against SDPA
# ------------------------------------------------------------------------------------------------

def _pack_cases(device: torch.device) -> dict[str, dict]:
    """name -> (seqlens, frames of the block-causal segments, strided) of the packs compared."""
    frames = torch.arange(4).repeat_interleave(20)                    # 4 frames of 20 rows
    caption = torch.zeros(16, dtype=torch.int64)                      # caption rows are frame 0
    return {
        "segments": dict(seqlens=[37, 0, 128, 1, 64], frames=None, strided=False),
        "all_empty": dict(seqlens=[0, 0], frames=None, strided=False),
        "strided": dict(seqlens=[50, 70], frames=None, strided=True),
        "block_causal": dict(seqlens=[96, 0, 40], frames=(torch.cat([frames, caption]), None, None),
                             strided=True),
    }


def _attention_grads(backend: str, q, k, v, segments, grad):
    from pan.models.attention import attention

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, segments, backend)
    if not out.requires_grad:                 # an all-empty pack: no rows, nothing to differentiate
        return out.detach(), [torch.zeros_like(t) for t in (q, k, v)]
    return out.detach(), list(torch.autograd.grad(out, (q, k, v), grad))


def check_varlen(device: torch.device) -> dict:
    from pan.models.packing import AttnSegments

    candidate = "varlen" if device.type == "cuda" else "blockwise"   # varlen is CUDA only
    heads, dim = 8, 64
    g = torch.Generator().manual_seed(0)
    results = {"candidate": candidate, "dtype": "bf16", "cases": {}}
    for name, case in _pack_cases(device).items():
        segments = AttnSegments.from_lengths(case["seqlens"])
        if case["frames"] is not None:
            segments = dataclasses.replace(segments, frames=case["frames"])
        segments = segments.to(device)
        total = segments.total
        if case["strided"]:                       # q, k, v as the fused projection gives them
            q, k, v = torch.randn(total, 3, heads, dim, generator=g).to(device).unbind(1)
        else:
            q, k, v = (torch.randn(total, heads, dim, generator=g).to(device) for _ in range(3))
        grad = torch.randn(total, heads, dim, generator=g).to(device)
        row = {"rows": total, "strided": not q.is_contiguous()}
        try:
            ref_out, ref_grads = _attention_grads("sdpa", q.float(), k.float(), v.float(), segments, grad.float())
            bf16 = [t.bfloat16() for t in (q, k, v)]
            for label, backend in (("sdpa_bf16", "sdpa"), (candidate, candidate)):
                out, grads = _attention_grads(backend, *bf16, segments, grad.bfloat16())
                errors = [(a.float() - b).abs().max().item() if a.numel() else 0.0
                          for a, b in zip([out, *grads], [ref_out, *ref_grads])]
                row[label] = dict(zip(("out", "dq", "dk", "dv"), errors))
            # bf16 rounding bounds both; the candidate may differ from SDPA by the kernels' order of sums
            row["ok"] = all(row[candidate][key] <= 2 * row["sdpa_bf16"][key] + 2e-2 for key in row[candidate])
        except Exception as e:  # noqa: BLE001 - a case that fails is a finding, reported with the others
            row.update(ok=False, error=f"{type(e).__name__}: {e}")
        results["cases"][name] = row
    results["ok"] = all(row["ok"] for row in results["cases"].values())
    return results


# ------------------------------------------------------------------------------------------------
# one-rank FSDP2: the trainer's step, checkpointing modes, save and resume
# ------------------------------------------------------------------------------------------------

ATTENTION_FORWARDS = {"torch_attn._varlen_attn.default", "aten._flash_attention_forward.default",
                      "aten._scaled_dot_product_flash_attention.default",
                      "aten._scaled_dot_product_efficient_attention.default",
                      "aten._scaled_dot_product_cudnn_attention.default",
                      "aten._scaled_dot_product_flash_attention_for_cpu.default"}


def _attention_forward_counter():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in ATTENTION_FORWARDS:
                self.calls += 1
            return func(*args, **(kwargs or {}))

    return Counter()


def _synthetic_batches(arch, device, steps: int, dry: bool) -> list:
    """One packed micro-batch per step (video clips and an image of different grids, captions)."""
    from pan.models.packing import PackInfo
    from pan.recipes.pan.task import ModelInputs

    g = torch.Generator().manual_seed(1)
    grids = [(2, 3, 4), (1, 4, 4), (3, 2, 2)] if dry else [(4, 16, 24), (1, 32, 32), (6, 12, 16)]
    texts = [5, 3, 7] if dry else [77, 20, 128]
    p = arch.patch_volume
    batches = []
    for _ in range(steps):
        pack = PackInfo.build(grids, texts)
        nv, nt = pack.num_video_tokens, pack.num_text_tokens
        batches.append(ModelInputs(
            x=torch.randn(nv, arch.in_channels * p, generator=g), target=torch.randn(nv, arch.out_channels * p, generator=g),
            weight=torch.ones(nv), timesteps=torch.tensor([0.5012, 0.999, 0.123456]),
            text=torch.randn(nt, arch.text_embed_dim, generator=g), pack=pack, sample_ids=["a", "b", "c"],
            samples=3, tokens=nv, packing=1.0, bad_samples=0).to(device))
    return batches


def _one_rank_run(job, world, batches, output_dir: Path, resume: bool, census: bool) -> dict:
    """Train len(batches) steps (from the checkpoint of step 2 when `resume`), saving after step 2."""
    from torch.distributed.device_mesh import init_device_mesh

    from pan.checkpoint.manager import Checkpointer
    from pan.parallel.dims import ParallelDims
    from pan.parallel.mesh import MESH_DIMS
    from pan.task import StepContext, global_sum
    from pan.recipes.pan.task import PanTask
    from pan.trainer import TrainState, build_part

    dims = ParallelDims(world_size=1, local_world_size=1, cp=1, dp_replicate=1, dp_shard=1)
    mesh = init_device_mesh(world.device.type, (1, 1, 1), mesh_dim_names=MESH_DIMS)  # FSDP2 on one rank
    task = PanTask(job, world, dims)
    part = build_part(task.part_specs()[0], world, dims, mesh, job, None, fresh=True)
    seen = []
    part.model.time_embed.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().cpu()))
    state = TrainState()
    parts = {"parts": {"transformer": part}, "train_state": state, "loader": None, "task": None}
    checkpointer = Checkpointer(dataclasses.replace(job.checkpoint, output_dir=str(output_dir)), world, dims)
    start = (checkpointer.resume(parts) or 0) if resume else 0
    out = {"start": start, "loss": {}, "grad_norm": {}}
    for step in range(start + 1, len(batches) + 1):
        mb = batches[step - 1]
        ctx = StepContext(parts["parts"], step, job.trainer.dtype, world.device)
        count = global_sum(task.loss_count(mb))
        with ctx.autocast():
            loss = task.loss_sum(part.model, mb)
        counter = _attention_forward_counter() if census and step == 1 else None
        if counter is not None:
            with counter:
                (loss / count).backward()
            out["attention_forwards_in_backward"] = counter.calls
        else:
            (loss / count).backward()
        value = loss.item() / count
        out["loss"][step] = value
        out["grad_norm"][step] = ctx.update(part, value)
        state.step = step
        if step == 2 and not resume:
            checkpointer.save(step, parts)
    first = seen[0]
    out["timesteps"] = {"dtype": str(first.dtype), "values": first.tolist(),
                        "exact": bool(torch.equal(first, torch.tensor([0.5012, 0.999, 0.123456]) * 1000))}
    return out


def check_fsdp(out_dir: Path, dry: bool) -> dict:
    import torch.distributed as dist

    from pan.config import load_job_config
    from pan.parallel.world import init_world, start_process_group

    world = init_world()                   # a launch of one process: the device, no group yet
    if not dist.is_initialized():
        start_process_group("nccl" if world.device.type == "cuda" else "gloo",
                            **({"device_id": world.device} if world.device.type == "cuda" else {}))
    out_dir.mkdir(parents=True, exist_ok=True)
    csv = out_dir / "unused.csv"
    csv.write_text("path,caption\nunused.mp4,unused\n")
    arch = "--transformer_config_overrides."
    size = [] if dry else [f"{arch}hidden_size", "512", f"{arch}num_attention_heads", "8",
                           f"{arch}rope_axes_dim", "[16, 24, 24]"]
    job = load_job_config(["--config", str(ROOT / "config/tiny_cpu.yaml"), "--dtype", "bf16",
                           "--video_csv_paths", str(csv), "--output_dir", str(out_dir / "unused"),
                           "--zero_init_modulation", "false", "--attention_backend", "auto", *size],
                          warn=lambda m: None)
    batches = _synthetic_batches(job.model.transformer_config_overrides, world.device, 4, dry)
    results = {"device": str(world.device), "backend": dist.get_backend(),
               "tf32": torch.backends.cuda.matmul.fp32_precision, "modes": {}}
    for mode, (enabled, selective) in {"none": (False, False), "full": (True, False),
                                       "selective": (True, True)}.items():
        mode_job = dataclasses.replace(job, parallel=dataclasses.replace(
            job.parallel, enable_gradient_checkpointing=enabled, use_dedicated_gradient_checkpointing=selective))
        try:
            a = _one_rank_run(mode_job, world, batches, out_dir / mode, resume=False, census=True)
            b = _one_rank_run(mode_job, world, batches, out_dir / mode, resume=True, census=False)
            row = {"uninterrupted": a, "resumed": b,
                   "resume_max_rel_diff": max(abs(b["loss"][s] - a["loss"][s]) / abs(a["loss"][s])
                                              for s in b["loss"]),
                   "ok": b["start"] == 2 and a["timesteps"]["exact"]
                   and (mode != "selective" or a["attention_forwards_in_backward"] == 0)}
        except Exception:  # noqa: BLE001 - one mode failing is a finding; the others still run
            import traceback
            row = {"ok": False, "error": traceback.format_exc()[-3000:]}
        results["modes"][mode] = row
    results["ok"] = all(row["ok"] for row in results["modes"].values())
    return results


# ------------------------------------------------------------------------------------------------
# The session: every step as a subprocess with a time limit
# ------------------------------------------------------------------------------------------------

def _train_resume_script(python: str, out: Path, dry: bool) -> str:
    """train.py on synthetic data: an uninterrupted run of 8 steps, and one stopped at 4 and resumed."""
    data = out / "synth"
    common = (f"{python} train.py --config config/tiny_cpu.yaml --video_csv_paths {data}/train.csv "
              f"--dtype {'fp32' if dry else 'bf16'} --log_interval 1 --save_interval 4 "
              "--attention_backend auto --progress_bar false")
    return " && ".join([
        f"{python} -m pan.cli data synth --out {data} --num-train 16 --num-heldout 1 --size 32 --num-frames 5",
        f"{common} --output_dir {out}/whole --max_steps 8",
        f"{common} --output_dir {out}/resumed --max_steps 4",
        f"{common} --output_dir {out}/resumed --max_steps 8"])


def steps(python: str, out: Path, dry: bool) -> list[dict]:
    """name, shell command, time limit (s) of each step, in order."""
    me = f"{python} -m benchmarks.gpu_session"
    dry_flag = " --dry-run" if dry else ""
    gpu_step = "--tiny --steps 1 --warmup 0" if dry else \
        "--steps 4 --warmup 2 --modes adamw/none/varlen adamw/selective/varlen muon/full/auto"
    step_time = "--device cpu --repeats 1 --sizes 64x1x1 --samples 1" if dry else \
        "--device cuda --dtype bf16 --compile --repeats 3 --samples 8 --sizes 1024x8x2"
    tests = (f"PAN_TEST_CUDA={0 if dry else 1} {python} -m pytest -q -p no:cacheprovider tests/test_gpu_paths.py"
             f" && {python} -m pytest -q -p no:cacheprovider tests/test_world.py tests/test_parallel_checkpointing.py")
    return [
        dict(name="varlen", command=f"{me} --check varlen --result {out}/varlen.json{dry_flag}", limit=120),
        dict(name="fsdp", command=f"{python} -m torch.distributed.run --standalone --nproc_per_node 1 "
                                  f"-m benchmarks.gpu_session --check fsdp --result {out}/fsdp.json{dry_flag}",
             limit=240),
        dict(name="train_resume", command=_train_resume_script(python, out / "train", dry), limit=240),
        dict(name="gpu_step", command=f"{python} -m benchmarks.gpu_step {gpu_step} --out {out}/gpu_step.json",
             limit=240, result="gpu_step.json"),
        dict(name="step_time", command=f"{python} -m benchmarks.step_time {step_time} --out {out}/step_time.json",
             limit=240, result="step_time.json"),
        dict(name="tests", command=tests, limit=240),
    ]


def losses_of(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {row["step"]: row["loss"] for row in rows}


def run_session(out: Path, dry: bool, budget: float) -> dict:
    python = sys.executable
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TQDM_DISABLE": "1"}
    if dry:
        env["CUDA_VISIBLE_DEVICES"] = ""
    session = {"dry_run": dry, "torch": torch.__version__, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not dry else "cpu",
               "budget_s": budget, "steps": []}
    t_start = time.perf_counter()
    for step in steps(python, out, dry):
        left = budget - (time.perf_counter() - t_start)
        record = {"name": step["name"], "command": step["command"]}
        if left < 20:
            session["steps"].append({**record, "skipped": f"session budget of {budget:.0f} s spent"})
            continue
        t0 = time.perf_counter()
        try:
            run = subprocess.run(step["command"], shell=True, cwd=ROOT, env=env, capture_output=True,
                                 text=True, timeout=min(step["limit"], left))
            record.update(rc=run.returncode, tail=(run.stdout + run.stderr)[-4000:])
        except subprocess.TimeoutExpired as e:
            output = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
            record.update(rc=None, timed_out=True, tail=output[-4000:])
        record["seconds"] = round(time.perf_counter() - t0, 1)
        result = out / step.get("result", f"{step['name']}.json")
        if result.is_file():
            record["result"] = json.loads(result.read_text())
        if step["name"] == "train_resume" and record.get("rc") == 0:
            whole, resumed = losses_of(out / "train/whole"), losses_of(out / "train/resumed")
            record["result"] = {"whole": whole, "resumed": resumed, "max_rel_diff_steps_5_8": max(
                abs(resumed[s] - whole[s]) / abs(whole[s]) for s in range(5, 9))}
        session["steps"].append(record)
        print(f"{step['name']}: rc {record.get('rc')} in {record['seconds']} s", flush=True)
    session["seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "session.json").write_text(json.dumps(session, indent=1, default=str))
    return session


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/gpu_session", help="folder for the JSON results")
    parser.add_argument("--dry-run", action="store_true", help="every step at toy sizes on the CPU")
    parser.add_argument("--budget", type=float, default=470.0,
                        help="seconds: no step starts after this (the GPU session's limit is 8 minutes)")
    parser.add_argument("--check", choices=["varlen", "fsdp"], help="run one check in this process")
    parser.add_argument("--result", help="JSON path of --check's result")
    args = parser.parse_args()
    if args.check:
        device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
        result_path = Path(args.result)
        result = check_varlen(device) if args.check == "varlen" else \
            check_fsdp(result_path.parent / "fsdp_runs", args.dry_run)
        result_path.write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps({k: v for k, v in result.items() if k not in ("cases", "modes")}))
        return 0 if result["ok"] else 1
    session = run_session(Path(args.out), args.dry_run, args.budget)
    failed = [s["name"] for s in session["steps"] if s.get("rc") != 0]
    print(f"wrote {Path(args.out) / 'session.json'} ({session['seconds']} s); "
          f"{'failed or skipped: ' + ', '.join(failed) if failed else 'every step passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
