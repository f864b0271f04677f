"""`pan check` and the checks it runs, before any process group or weight exists.

    core.py     the framework: a row, the context checks read (`Preflight`), running the checks
                (the environment's, then the recipe's list), train.py's refusal at start
    checks.py   the run checks any recipe may list (layout, cpu, output dir, warm start, resume,
                memory, step time) and what the recipes' data rows share
    command.py  `pan check` itself: its arguments, the table, --json, --explain-memory

The names recipes (a plugin's too: docs/adding_a_recipe.md) and the tests use are re-exported here.
"""

from pan.preflight.checks import (
    check_cpu,
    check_layout,
    check_memory,
    check_output_dir,
    check_resume,
    check_data,
    check_step_time,
    check_warm_start,
    checkpoint_bytes,
    lora_base_too_large,
    source_sizes,
    spread_rows,
    unopened_row,
    with_annotation_scan,
)
from pan.preflight.command import main_check
from pan.preflight.core import (
    DEFAULT_SAMPLE_ROWS,
    ENVIRONMENT_CHECKS,
    EXIT_CONFIG_ERROR,
    EXIT_FAILED,
    EXIT_OK,
    Check,
    Preflight,
    Row,
    StartRefused,
    Status,
    check_name,
    config_rows,
    format_refusal,
    job_rows,
    one_line,
    recipe_checks,
    refuse_at_start,
    run_preflight,
)

__all__ = [
    "DEFAULT_SAMPLE_ROWS", "ENVIRONMENT_CHECKS", "EXIT_CONFIG_ERROR", "EXIT_FAILED", "EXIT_OK", "Check", "Preflight",
    "Row", "StartRefused", "Status", "check_cpu", "check_layout", "check_memory", "check_name", "check_output_dir",
    "check_resume", "check_data", "check_step_time", "check_warm_start", "checkpoint_bytes", "config_rows", "format_refusal",
    "job_rows", "lora_base_too_large", "main_check", "one_line", "recipe_checks", "refuse_at_start",
    "run_preflight", "source_sizes", "spread_rows", "unopened_row", "with_annotation_scan",
]
