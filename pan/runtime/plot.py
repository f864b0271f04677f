"""Plots of a training run: `pan plot RUN_DIR` draws the loss, grad norm, learning rate and seconds per
step of the run's metrics.jsonl (one row per log interval, pan/runtime/metrics.py) into one PNG."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: training nodes and CI have no display, and no GUI toolkit is needed
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot is imported)
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import LogFormatter  # noqa: E402

from pan.config.arguments import ValueType, output_file  # noqa: E402

Records = list[dict]


def read_records(path: Path) -> Records:
    """The rows of a metrics.jsonl that are JSON objects with a numeric step; others are skipped (a run
    killed mid-write leaves a partial last line)."""
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and is_number(row.get("step")):
            records.append(row)
    return records


def is_number(value: object) -> bool:
    # NaN and inf are logged for a window of skipped (non-finite) steps: nothing to draw there.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def series(records: Records, key: str) -> tuple[list[float], list[float]]:
    """Steps and values of the rows that hold a finite `key`."""
    rows = [r for r in records if is_number(r.get(key))]
    return [r["step"] for r in rows], [r[key] for r in rows]


def ema(values: list[float], span: int) -> list[float]:
    """Exponential moving average (pandas' `ewm(span=span, adjust=False)`): it follows the trend
    without the lag at the ends that a centred window would need to pad for."""
    alpha, out = 2 / (span + 1), []
    for v in values:
        out.append(v if not out else alpha * v + (1 - alpha) * out[-1])
    return out


class PlainLogFormatter(LogFormatter):
    """matplotlib's choice of which log ticks to label, written plainly: 0.6, not 6e-01 or 6 x 10^-1."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return f"{x:g}" if super().__call__(x, pos) else ""


def log_y(ax: Axes, values: list[float]) -> None:
    """A log y-axis; symlog (linear within +-linthresh) where a loss reaches 0 or below, as the causal
    VAE's does (its GAN term and learned log-variance are signed): a log axis would drop those points."""
    if min(values) > 0:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(PlainLogFormatter())
        ax.yaxis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False))
        ax.set_ylabel("loss (log scale)")
        return
    nonzero = [abs(v) for v in values if v]
    linthresh = max(min(nonzero), max(nonzero) * 1e-4)  # at most 4 decades of log scale below the top
    ax.set_yscale("symlog", linthresh=linthresh)
    ax.set_ylabel(f"loss (symlog: linear within +-{linthresh:.2g})")


def panel(ax: Axes, records: Records, keys: list[str], title: str, ylabel: str,
          loss: bool = False) -> None:
    """One panel: a line per key against step (a loss: log y, smoothed), or "not logged" when no row
    holds any of the keys."""
    lines = {key: series(records, key) for key in keys}
    # A loss term that is switched off (the VAE's perceptual loss without LPIPS) logs 0s: nothing to see.
    lines = {k: (steps, values) for k, (steps, values) in lines.items() if steps and (not loss or any(values))}
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if not lines:
        ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center",
                color="gray", fontsize=14)
        return
    for i, (key, (steps, values)) in enumerate(lines.items()):
        colour, marker = f"C{i % 10}", "." if len(steps) < 50 else None  # a short run's few points
        # The raw log-interval means, faint, under their EMA; the span grows with the run so that a
        # long run's noise is averaged over a similar share of it as a short run's.
        span = len(values) // 20
        if loss and span > 1:
            ax.plot(steps, values, color=colour, alpha=0.3, linewidth=0.8, marker=marker)
            ax.plot(steps, ema(values, span), color=colour, linewidth=1.8,
                    label=f"{key} (EMA over {span} points; raw faint)")
        else:
            ax.plot(steps, values, color=colour, linewidth=1.2, marker=marker, label=key)
    if loss:
        log_y(ax, [v for _, values in lines.values() for v in values])
    ax.grid(True, which="major", alpha=0.3)
    if loss or len(lines) > 1:
        ax.legend(fontsize="small")


def keys_where(records: Records, test: Callable[[str], bool]) -> list[str]:
    """The keys that pass `test`, in the order they first appear (the trainer's `loss` before parts)."""
    keys: dict[str, None] = {}
    for r in records:
        keys.update((k, None) for k in r if k != "step" and test(k))
    return list(keys)


# Each panel's title, y label and keys, for every recipe: the trainer writes `loss`, `grad_norm`, `lr`
# and `step_time`; recipes add parts such as `loss/kl`, `loss/disc`, `grad_norm/discriminator` and a
# learning rate per extra model part, `lr/<part>` (the causal VAE).
PANELS: list[tuple[str, str, Callable[[str], bool]]] = [
    ("training loss", "loss", lambda k: k == "loss" or k.startswith("loss/") or k.endswith("loss")),
    ("gradient norm (last step of each log interval, before clipping)", "L2 norm",
     lambda k: "grad_norm" in k),
    ("learning rate", "learning rate", lambda k: k == "lr" or k.startswith("lr/") or k.endswith("lr")),
    ("time per step (mean over each log interval)", "seconds per step", lambda k: k == "step_time"),
]


def draw(records: Records, title: str | None = None) -> Figure:
    """The run's four panels (2x2): loss (log y), grad norm, learning rate, seconds per step."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), dpi=100, layout="constrained")
    for i, (ax, (panel_title, ylabel, wanted)) in enumerate(zip(axes.flat, PANELS)):
        panel(ax, records, keys_where(records, wanted), panel_title, ylabel, loss=i == 0)
    if title:
        fig.suptitle(title)
    return fig


def plot_run(run_dir_or_metrics_file: str | Path, out: str | Path | None = None) -> Path:
    """Draw a run's metrics.jsonl (given the run's folder or the file) to `out`, by default
    metrics.png beside it; the path written. FileNotFoundError or ValueError when there is nothing."""
    path = Path(run_dir_or_metrics_file)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (is it a run's output_dir?)")
    records = read_records(path)
    if not records:
        raise ValueError(f"{path} holds no metrics row (a JSON object with a step on a line)")
    out = Path(out) if out is not None else path.parent / "metrics.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = draw(records, title=str(path.parent))
    try:
        fig.savefig(out)
    finally:
        plt.close(fig)  # pyplot keeps every figure alive until closed: a long process would leak them
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pan plot", description="Plot a run's loss, grad norm, "
                                     "learning rate and seconds per step (metrics.jsonl) to a PNG.")
    # Judged by plot_run (a one-line message, exit 2): missing, no metrics.jsonl, no metrics row.
    parser.add_argument("run_dir", metavar="RUN_DIR", type=ValueType("path", Path, "path"),
                        help="the run's output_dir, or its metrics.jsonl")
    parser.add_argument("--out", metavar="FILE", type=output_file("the PNG file to write"), default=None,
                        help="the PNG to write (default: RUN_DIR/metrics.png)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        print(plot_run(args.run_dir, args.out))
    except (OSError, ValueError) as e:  # a wrong path or an empty log is the user's to fix: no traceback
        print(f"pan plot: RUN_DIR: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
