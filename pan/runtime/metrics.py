"""Training metrics: the console log, a progress bar, and `report_to` backends."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch

from pan.config.core import knob, require
from pan.logging import get_logger


@dataclass(kw_only=True)
class MetricsConfig:
    SECTION: ClassVar[str] = "output"
    TRAINING_ONLY: ClassVar[bool] = True  # not checked where a trained model is only used (pan sample)

    log_interval: int = knob(10, "log loss, grad norm, lr, throughput and MFU every this many steps",
                             ge=1)
    report_to: Literal["none", "wandb", "tensorboard"] = knob(
        "none", "where metrics also go: wandb (WANDB_PROJECT / WANDB_RUN_ID / WANDB_API_KEY from the "
                "environment) or tensorboard (output_dir/tensorboard)")
    progress_bar: bool = knob(True, "show a progress bar on the console (rank 0, when it is a terminal; "
                                        "piped or redirected output gets the log lines only)")

    def check(self, job) -> None:
        package = {"wandb": "wandb", "tensorboard": "tensorboard"}.get(self.report_to)
        require(package is None or importlib.util.find_spec(package) is not None, "report_to",
                f"is {self.report_to}, but the {package} package is not installed: "
                f"pip install {package}, or set report_to: none.")


# Dense (no sparsity) bf16 tensor-core peaks in FLOP/s, from NVIDIA's datasheets, for MFU on GPUs; CPUs
# are measured at start-up instead. Matched against torch.cuda.get_device_name() in this order, as
# whole words ("NVIDIA H100 PCIe", "NVIDIA GB200"): a form factor before its chip's SXM entry (PCIe
# and NVL parts run at lower clocks and power), and GB200 is not B200.
GPU_PEAK_FLOPS: list[tuple[str, float]] = [
    (r"\bGB200\b", 2500e12),
    (r"\bB200\b", 2250e12),
    (r"\bH200\b.*\bNVL\b", 835e12),
    (r"\bH200\b", 989e12),
    (r"\bH100\b.*\bNVL\b", 835e12),
    (r"\bH100\b.*\bPCIe\b", 756e12),
    (r"\bH100\b", 989e12),            # SXM ("NVIDIA H100 80GB HBM3")
    (r"\bH800\b.*\bPCIe\b", 756e12),
    (r"\bH800\b", 989e12),
    (r"\bA100\b", 312e12),            # SXM and PCIe alike
    (r"\bA800\b", 312e12),
    (r"\bL40S\b", 362e12),
    (r"\bL40\b", 181e12),
    (r"\bL4\b", 121e12),
    (r"\bA10\b", 125e12),
]


# Why a CPU run logs a few percent where `pan check` estimates more.
CPU_MFU_NOTE = ("; on a CPU the yardstick is one large matmul of the run's dtypes (the fastest), which a small "
                "model's small matmuls, elementwise work and per-operation overhead run far below: a few percent "
                "is normal, and `pan check`'s step-time MFU counts compute alone")
# The torch dtypes of the `dtype` key's values.
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def datasheet_bf16_peak(name: str) -> float | None:
    """The dense bf16 peak of the GPU called `name` (torch.cuda.get_device_name), None if unknown."""
    for pattern, peak in GPU_PEAK_FLOPS:
        if re.search(pattern, name):
            return peak
    return None


def measured_matmul_peak(device: torch.device, n: int = 1024, repeats: int = 5,
                         dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a square matmul of `dtype` on this device (the best of `repeats`, after a warm-up).
    Where one of size n takes over a quarter second (bf16 on a CPU without bf16 instructions runs
    tens of times slower than fp32), a smaller one is timed: the rate is the point, not the size."""
    def run(a, b) -> float:
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    while True:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        if run(a, b) < 0.25 or n <= 128:
            break
        n //= 2
    best = min(run(a, b) for _ in range(repeats))
    return 2 * n ** 3 / best


def matmul_rate(device: torch.device, dtype: str) -> float:
    """`measured_matmul_peak` of the `dtype` key's value on this device (4096-square on a GPU,
    1024-square on a CPU, at the threads torch uses now), measured once per process."""
    return _matmul_rate(device, dtype, torch.get_num_threads())


@functools.cache
def _matmul_rate(device: torch.device, dtype: str, threads: int) -> float:
    return measured_matmul_peak(device, 4096 if device.type == "cuda" else 1024, dtype=TORCH_DTYPES[dtype])


def dtypes_of(dtype: str) -> list[str]:
    """The dtypes a run's matmuls compute in: bf16 autocast keeps some in fp32 (the master weights'
    optimizer step, what autocast leaves in fp32); fp32 runs compute in fp32 alone."""
    return ["bf16", "fp32"] if dtype == "bf16" else ["fp32"]


def measured_peak(device: torch.device, dtype: str) -> tuple[float, str]:
    """The fastest measured matmul rate of the dtypes a run computes in (`dtypes_of`), and where it
    comes from: no part of the step outruns it, whichever dtype is the faster on this device (bf16
    on a CPU with AMX or AVX-512 BF16, fp32 on one without)."""
    rates = {d: matmul_rate(device, d) for d in dtypes_of(dtype)}
    fastest = max(rates, key=rates.get)
    others = "; ".join(f"{d} {r / 1e9:,.1f} GFLOP/s" for d, r in rates.items() if d != fastest)
    where = "" if device.type == "cpu" else f"{torch.cuda.get_device_name(device)} "
    return rates[fastest], f"{where}measured {fastest} matmul" + (f", the faster here; {others}" if others else "")


def peak_flops(device: torch.device, dtype: str) -> tuple[float, str]:
    """The FLOP/s MFU is measured against, and where the number comes from. A known GPU: its dense
    bf16 datasheet peak, for fp32 runs half of it with TF32 on (allow_tf32); any other device (a
    CPU, a GPU not in the table): the measured rate of the run's dtypes (`measured_peak`)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = datasheet_bf16_peak(name)
        if peak is not None and dtype == "bf16":
            return peak, f"{name} datasheet, dense bf16"
        if peak is not None and torch.backends.cuda.matmul.fp32_precision == "tf32":
            return peak / 2, f"{name} datasheet, dense TF32"
    return measured_peak(device, dtype)


def mfu_text(mfu: float, digits: int = 1) -> str:
    """An MFU as printed: a percentage, or, above 100% (work counted faster than the peak it is
    measured against allows), that it is unreliable."""
    if mfu > 1:
        return "MFU unreliable (above 100% of the peak it is measured against)"
    return f"MFU {100 * mfu:.{digits}f}%"


# The trainer's own numbers in each step's values; every other key is a recipe metric.
TRAINER_KEYS = {"loss", "grad_norm", "finite", "samples", "tokens", "flops", "bad_samples",
                "bad_samples_distinct", "packing", "lr", "step_time", "data_wait", "skipped_steps"}


def recipe_metrics(finite_steps: list[dict], last: dict) -> dict[str, float]:
    """The recipe's extra metrics of a log window: means over its finite steps; the latest value of
    per-part learning rates (`lr/<part>`)."""
    keys = [k for k in last if k not in TRAINER_KEYS]
    out = {}
    for k in keys:
        if k.startswith("lr/"):
            out[k] = float(last[k])
            continue
        values = [float(v[k]) for v in finite_steps if k in v]
        out[k] = sum(values) / len(values) if values else float("nan")
    return out


class Metrics:
    """Console log every `log_interval` steps, a progress bar, and the `report_to` backend (rank 0).

    `step()` takes global numbers: samples, tokens and FLOPs summed over all ranks.
    """

    def __init__(self, cfg: MetricsConfig, output_dir: Path, world, device: torch.device, dtype: str,
                 job_sections: dict | None = None):
        self.cfg, self.output_dir, self.world = cfg, Path(output_dir), world
        self.log = get_logger()
        self.peak, self.peak_source = peak_flops(device, dtype)
        self.on_cpu = device.type == "cpu"
        self.peak *= world.size
        self.window: list[dict] = []
        self.bar = None
        self.backend = None
        self.jsonl = None
        if world.is_main:
            self.jsonl = open(self.output_dir / "metrics.jsonl", "a")
            self.backend = self._open_backend(job_sections or {})

    def _open_backend(self, sections: dict):
        if self.cfg.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            return SummaryWriter(str(self.output_dir / "tensorboard"))
        if self.cfg.report_to == "wandb":
            import wandb
            wandb.init(project=os.environ.get("WANDB_PROJECT"), id=os.environ.get("WANDB_RUN_ID"),
                       resume="allow", config=sections, dir=str(self.output_dir))
            return wandb
        return None

    def start(self, step: int, max_steps: int) -> None:
        self.log.info("MFU is the model's FLOPs per wall-clock second of the logged steps (data waits and "
                      "warm-up included) against %.1f GFLOP/s in all (%s)%s", self.peak / 1e9, self.peak_source,
                      CPU_MFU_NOTE if self.on_cpu else "")
        # The bar is for terminals: piped into a file (CI, Slurm's output file, tee) its carriage
        # returns would run into the log lines.
        if self.world.is_main and self.cfg.progress_bar and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=max_steps, initial=step, desc="train", unit="step", dynamic_ncols=True)

    def step(self, step: int, values: dict) -> None:
        """One step's numbers: the recipe's scalar metrics (`loss`, `grad_norm`, any others such as
        `loss/kl`) and the trainer's (samples, tokens, flops, lr..., step_time, data_wait...)."""
        self.window.append(values)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{values['loss']:.4f}")
        if step % self.cfg.log_interval == 0:
            self._flush(step)

    def _flush(self, step: int) -> None:
        w, self.window = self.window, []
        seconds = sum(v["step_time"] for v in w)
        finite = [v for v in w if v["finite"]]
        row = {
            "step": step,
            "loss": sum(v["loss"] for v in finite) / len(finite) if finite else float("nan"),
            "grad_norm": w[-1]["grad_norm"],
            "lr": w[-1]["lr"],
            "step_time": seconds / len(w),
            "samples_per_s": sum(v["samples"] for v in w) / max(seconds, 1e-9),
            "tokens_per_s": sum(v["tokens"] for v in w) / max(seconds, 1e-9),
            "mfu": sum(v["flops"] for v in w) / max(seconds, 1e-9) / self.peak,
            "data_wait": sum(v["data_wait"] for v in w) / max(seconds, 1e-9),
            "packing": sum(v["packing"] for v in w) / len(w),
            "skipped_steps": w[-1]["skipped_steps"],
            "bad_samples": w[-1].get("bad_samples", 0),
            "bad_samples_distinct": w[-1].get("bad_samples_distinct", 0),
        }
        mfu = mfu_text(row["mfu"])
        if row["mfu"] > 1:   # more than the peak allows: not a number to plot
            row["mfu"] = None
        extra = recipe_metrics(finite, w[-1])
        row.update(extra)
        if not self.world.is_main:
            return
        message = (f"step {step} | loss {row['loss']:.4f} | grad {row['grad_norm']:.3f} | "
                   f"lr {row['lr']:.2e} | {row['step_time']:.2f} s/step | "
                   f"{row['samples_per_s']:.1f} samples/s | {row['tokens_per_s']:.0f} tok/s | "
                   f"{mfu} | data wait {100 * row['data_wait']:.1f}% | "
                   f"packing {100 * row['packing']:.1f}% | bad samples {row['bad_samples']} "
                   f"({row['bad_samples_distinct']} distinct)")
        message += "".join(f" | {k} {v:.4g}" for k, v in extra.items())
        self._write(message)
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        self._report("train", {k: v for k, v in row.items() if k != "step" and v is not None}, step)

    def record(self, step: int, values: dict[str, float]) -> None:
        """Metrics outside the step rhythm (validation): console, validation.jsonl, the backend."""
        if not self.world.is_main or not values:
            return
        self._write(f"validation at step {step}: " + " | ".join(f"{k} {v:.4f}" for k, v in values.items()))
        with open(self.output_dir / "validation.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        self._report("val", values, step)

    def _write(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message)
        else:
            self.log.info(message)

    def _report(self, prefix: str, values: dict[str, float], step: int) -> None:
        if self.cfg.report_to == "tensorboard":
            for k, v in values.items():
                self.backend.add_scalar(f"{prefix}/{k}", v, step)
        elif self.cfg.report_to == "wandb":
            self.backend.log({f"{prefix}/{k}": v for k, v in values.items()}, step=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.cfg.report_to == "tensorboard" and self.backend is not None:
            self.backend.close()
        elif self.cfg.report_to == "wandb" and self.backend is not None:
            self.backend.finish()
