"""`pan check`: everything that can stop a run, checked before any process group or weight exists.

    pan check --config config/X.yaml [--key value ...] [--nodes N] [--gpus-per-node G]

The preflight loads the config (every ConfigError of the loader), then runs the environment's checks
and the recipe's (pan/preflight/core.py), each returning rows of `check | pass/warn/fail | detail`;
a failed row says how to fix it. Checks read files and metadata only: the model is built on the meta
device, checkpoints and state dicts are compared by their recorded shapes, media are decoded with
the data pipeline's own functions. Nothing is trained and no process group is started.

Exit codes: 0 when nothing failed (warnings allowed), 1 when a check failed, 2 when the config does not
load at all (the loader's error is then the only config row; fix it and run again to see the rest).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import textwrap

import torch

from pan.config import ConfigError, load_job_config
from pan.config.arguments import COUNT, POSITIVE
from pan.preflight.checks import gib
from pan.preflight.core import (
    DEFAULT_SAMPLE_ROWS,
    EXIT_CONFIG_ERROR,
    EXIT_FAILED,
    EXIT_OK,
    Preflight,
    Row,
    config_rows,
    run_preflight,
)

def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="pan check", allow_abbrev=False,
        description="Preflight: validate a config, its data, weights, output_dir and this machine "
                    "for a planned layout, without training. Exit 0: ok (warnings allowed); 1: a "
                    "check failed; 2: the config does not load.",
        usage="pan check --config config/X.yaml [--key value ...] [--nodes N] [--gpus-per-node G] "
              "[--explain-memory] [--json] [--device-memory GIB]")
    parser.add_argument("--nodes", type=COUNT, default=1, help="nodes of the planned run (default 1)")
    parser.add_argument("--gpus-per-node", type=COUNT, default=None,
                        help="processes per node (default: the GPUs visible here, or 1)")
    parser.add_argument("--sample-rows", type=COUNT, default=DEFAULT_SAMPLE_ROWS,
                        help=f"samples decoded per data source (default {DEFAULT_SAMPLE_ROWS})")
    parser.add_argument("--explain-memory", action="store_true",
                        help="also print the estimated memory of one device by category")
    parser.add_argument("--json", action="store_true",
                        help="print every row and the memory / step-time estimate as JSON instead")
    parser.add_argument("--device-memory", type=POSITIVE, default=None, metavar="GIB",
                        help="memory of one device in GiB to plan for (default: this machine's GPU, or "
                             "its available host memory shared by the node's processes)")
    args, rest = parser.parse_known_args(argv)
    if args.gpus_per_node is None:
        args.gpus_per_node = max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1
    return args, rest


def main_check(argv: list[str]) -> int:
    """`pan check`: print the preflight table; the exit code says whether to launch."""
    args, rest = parse_args(argv)
    try:
        job = load_job_config(rest, warn=lambda msg: print(f"pan check: {msg}", file=sys.stderr))
    except ConfigError as e:
        ctx = Preflight(None, args.nodes, args.gpus_per_node, args.sample_rows)
        rows = config_rows("config", e)  # every problem found, one a row
        report(rows + run_preflight(ctx), None, args)
        return EXIT_CONFIG_ERROR
    ctx = Preflight(job, args.nodes, args.gpus_per_node, args.sample_rows, device_memory=args.device_memory)
    rows = [Row("config", "pass", f"loads: recipe {job.recipe}, {len(job.explicit_keys)} keys set "
                "to non-default values.")]
    rows += run_preflight(ctx)
    report(rows, ctx, args)
    return EXIT_FAILED if any(r.status == "fail" for r in rows) else EXIT_OK


def report(rows: list[Row], ctx: Preflight | None, args: argparse.Namespace) -> None:
    """The table (and with --explain-memory the memory breakdown), or with --json all of it."""
    estimate = ctx.__dict__.get("estimate") if ctx is not None else None  # only if a check made it
    if args.json:
        out = {"rows": [dataclasses.asdict(r) for r in rows],
               "exit_code": EXIT_FAILED if any(r.status == "fail" for r in rows) else EXIT_OK}
        if estimate is not None:
            out["estimate"] = estimate.to_json()
            out["fitting_changes"] = [{"keys": c.keys, "estimate": c.estimate.to_json()}
                                      for c in ctx.__dict__.get("fitting_changes", [])]
        print(json.dumps(out, indent=2, default=str))
        return
    print(format_table(rows, width=shutil.get_terminal_size((100, 20)).columns))
    if args.explain_memory:
        print()
        print(format_memory(estimate) if estimate is not None else
              "no memory estimate: the memory row did not run (see the table).")


def format_table(rows: list[Row], width: int = 100) -> str:
    """check | status | detail, wrapped; a warning's or failure's fix on a `fix:` line below it."""
    name_w = max([len("check")] + [len(r.check) for r in rows])
    text_w = max(40, width - name_w - 10)
    lines = [f"{'check':<{name_w}} | status | detail", f"{'-' * name_w}-+--------+-{'-' * text_w}"]
    for r in rows:
        # A detail or fix of several problems holds one a line ("\n"): each is wrapped by itself.
        body = [w for line in r.detail.splitlines() for w in textwrap.wrap(line, text_w)] or [""]
        if r.fix and r.status != "pass":
            body += [w for line in ("fix: " + r.fix).splitlines()
                     for w in textwrap.wrap(line, text_w)]
        lines.append(f"{r.check:<{name_w}} | {r.status:<6} | {body[0]}")
        lines += [f"{'':<{name_w}} | {'':<6} | {more}" for more in body[1:]]
    counts = {s: sum(r.status == s for r in rows) for s in ("pass", "warn", "fail")}
    lines.append(f"{counts['pass']} passed, {counts['warn']} warnings, {counts['fail']} failed")
    return "\n".join(lines)


def format_memory(est) -> str:
    """`pan check --explain-memory`: the breakdown of one device's estimated peak."""
    width = max(len(k) for k in [*est.device, *est.host, "category"])
    lines = [f"{'category':<{width}} | {'per device':>12}", f"{'-' * width}-+-{'-' * 12}"]
    lines += [f"{k:<{width}} | {gib(v):>12}" for k, v in est.device.items()]
    lines.append(f"{'total':<{width}} | {gib(est.total):>12}   of {gib(est.capacity)} ({est.capacity_source})")
    if torch.cuda.is_available():
        lines += [f"{k + ' (host)':<{width}} | {gib(v):>12}" for k, v in est.host.items()]
    lines.append(f"micro-batch: {est.batch}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main_check(sys.argv[1:]))
