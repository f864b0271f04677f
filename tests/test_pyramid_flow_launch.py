"""The `pyramid-flow-no-ar` workflow on CPU: its YAMLs (the original script's defaults), `pan
launch-command` and its refusals, every `pan check` row of the recipe passing and failing on tiny
released-layout folders made here, `pan data precompute` writing Pyramid-Flow files that train
the recipe on exactly the inputs of the online path, and the text encoders loaded only where
captions are encoded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from pan.data.plan import Ref
from pan.data.precompute import main as precompute_main
from pan.data.reader import SampleReader, read_row_sources, rules_of
from pan.data.synth import synth_dataset
from pan.encoders import pyramid_text
from pan.encoders import vae as vae_module
from pan.encoders.vae import IdentityVAE
from pan.launch_command import main_launch_command
from pan.models.pyramid_io import save_pretrained
from pan.parallel.world import planned_task
from pan.preflight import Preflight, Row, run_preflight
from pan.recipes.pyramid_flow.rules import check_launch
from pan.recipes.pyramid_flow.task import PyramidFlowTask
from pan.trainer import build_trainer
from pyramid_reference import needs_reference
from pyramid_tiny import ENCODER_FOLDERS, FIXTURE_VAE, load, save_tiny_flux, write_released

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("diffusion_transformer_384p", "diffusion_transformer_768p", "diffusion_transformer_image")


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """A released-layout model folder: the tiny DiT under every released variant name, and its text
    encoders, as `model_path` expects them."""
    return write_released(tmp_path_factory.mktemp("pyramid_model"), VARIANTS)


def model_path_with(tmp_path: Path, released: Path, variant: str, **changes) -> Path:
    """Another model folder: the released text encoders and a DiT variant of other keys."""
    root = tmp_path / "model"
    for folder in ENCODER_FOLDERS:
        (root / folder).parent.mkdir(parents=True, exist_ok=True)
        (root / folder).symlink_to(released / folder)
    save_tiny_flux(root / variant, **changes)
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return synth_dataset(tmp_path_factory.mktemp("synth"), num_train=8, num_heldout=2, size=16,
                         num_frames=5)["train_csv"]


def write_config(path: Path, released: Path, output_dir: Path, *, csv: Path | None = None,
                 jsonl: Path | None = None, **sections) -> Path:
    """A tiny run of the recipe: 16x16 clips of 5 frames in pixel space (identity VAE)."""
    sources = {"video_csv_paths": [str(csv)] if csv else [],
               "annotation_paths": [str(jsonl)] if jsonl else []}
    cfg = {"recipe": "pyramid_flow",
           "model": {"model_name": "pyramid_flux", "model_path": str(released), "vae_type": "identity",
                     **sections.pop("model", {})},
           "training": {"learning_rate": 2e-3, "max_steps": 2, "dtype": "fp32", "use_muon": False},
           "data": {**sources, "resolution_buckets": ["16x16"], "min_frames": 5, "max_frames": 5,
                    "frames_mod": 1, "frames_remainder": 0, "max_tokens_per_batch": 600,
                    "max_samples_per_batch": 4, "packed_dataloader_num_workers": 0,
                    **sections.pop("data", {})},
           "output": {"output_dir": str(output_dir), "save_interval": 2, "log_interval": 1,
                      "progress_bar": False},
           **sections}
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def precomputed(tmp_path_factory, released, data) -> Path:
    """`pan data precompute` of the synthetic CSV for the tiny run: the JSONL it writes."""
    tmp = tmp_path_factory.mktemp("precompute")
    config = write_config(tmp / "p.yaml", released, tmp / "run", csv=data)
    assert precompute_main(["--config", str(config), "--out", str(tmp / "pre")]) == 0
    return tmp / "pre" / "train.jsonl"


# ---- the YAMLs and `pan launch-command` ----------------------------------------------------------

def filled_in(released: Path, jsonl: Path, output_dir: Path) -> list[str]:
    """Overrides that replace the YAMLs' placeholders with this test's folders (the released VAE:
    the fixture's)."""
    return ["--model_path", str(released), "--vae_path", str(FIXTURE_VAE),
            "--annotation_paths", json.dumps([str(jsonl)]), "--output_dir", str(output_dir)]


@needs_reference
def test_the_yamls_are_the_original_scripts_defaults_per_variant(tmp_path, released, precomputed):
    raw = {name: yaml.safe_load((REPO / f"config/pyramid_flow_{name}.yaml").read_text())
           for name in ("384p", "768p", "image")}
    for name in raw:
        job = load(REPO / f"config/pyramid_flow_{name}.yaml", *filled_in(released, precomputed, tmp_path / "run"))
        check_launch(job)  # variant, buckets, batch and stage sizes agree: no refusal
        o, t = job.optim, job.trainer
        # --lr 1e-4 --lr_scheduler constant_with_warmup --warmup_steps 1000 --opt adamw --opt_beta1 0.9
        # --opt_beta2 0.95 --weight_decay 1e-4 --clip_grad 1.0; 20 epochs x 2000 iterations, seed 42, bf16
        assert (o.learning_rate, o.lr_scheduler_type, o.warmup_steps, o.use_muon, o.adam_beta1, o.adam_beta2,
                o.weight_decay, o.max_grad_norm) == (1e-4, "constant", 1000, False, 0.9, 0.95, 1e-4, 1.0)
        assert (t.max_steps, t.seed, t.dtype, t.gradient_accumulation_steps) == (40000, 42, "bf16", 1)
        assert (job.data.max_samples_per_batch, job.tasks.cfg_drop_prob, job.pyramid.sample_ratios) == \
            (4, 0.1, [1, 2, 1])
        assert (job.checkpoint.save_interval, job.logging.log_interval, job.logging.report_to) == \
            (2000, 40, "tensorboard")
        assert job.vae.vae_type == "causal_video_vae"  # the released workflow's VAE, as the AR YAMLs
    sections = [s for s, keys in raw["384p"].items() if isinstance(keys, dict)]
    differing = {(s, k) for s in sections for k in raw["384p"][s]
                 if any(raw[n][s].get(k) != raw["384p"][s][k] for n in raw)}
    assert differing == {("model", "model_variant"), ("data", "resolution_buckets"),
                         ("data", "max_tokens_per_batch"), ("data", "annotation_paths"),
                         ("distributed", "enable_gradient_checkpointing")}


def launch_command(capsys, *argv) -> tuple[int, list[str], str]:
    code = main_launch_command(["--workflow", "pyramid-flow-no-ar", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, [line for line in out.splitlines() if line and not line.startswith("#")], err


def test_the_launch_script_is_the_shared_launcher_with_the_384p_default():
    """Like scripts/pretrain.sh: a Slurm header, the default YAML, the shared body (the run itself is
    tested under Slurm in test_launch_scripts.py)."""
    def body(name: str) -> list[str]:
        return [line for line in (REPO / "scripts" / name).read_text().splitlines()
                if line and not line.startswith("#") and not line.startswith("PAN_DEFAULT_CONFIG=")]

    script = (REPO / "scripts" / "train_pyramid_flow_without_ar.sh").read_text()
    assert body("train_pyramid_flow_without_ar.sh") == body("pretrain.sh")
    assert "PAN_DEFAULT_CONFIG=config/pyramid_flow_384p.yaml" in script and "#SBATCH --nodes=1" in script


@needs_reference
def test_launch_command_refuses_the_template_and_prints_the_filled_in_run(tmp_path, released, precomputed,
                                                                          capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # the workflow's YAML and script are repository paths
    code, _, err = launch_command(capsys, "--nodes", 1, "--gpus-per-node", 8)
    assert code == 2 and "/path/to/pyramid-flow-miniflux" in err and "/path/to/annotation" in err
    # A placeholder left in any path key is refused as such when the config loads.
    code, _, err = launch_command(capsys, "--nodes", 1, "--gpus-per-node", 8,
                                  *filled_in(released, precomputed, "/path/to/output_dir"))
    assert code == 2 and "`output_dir`" in err and "placeholder /path/to/output_dir" in err
    overrides = filled_in(released, precomputed, tmp_path / "run")
    code, lines, err = launch_command(capsys, "--nodes", 2, "--gpus-per-node", 4, *overrides)
    assert code == 0, err
    assert lines[-1].split()[:5] == ["PAN_NPROC_PER_NODE=4", "sbatch", "--nodes=2",
                                     "scripts/train_pyramid_flow_without_ar.sh", "config/pyramid_flow_384p.yaml"]


@pytest.fixture()
def tiny(tmp_path, released, precomputed) -> Path:
    return write_config(tmp_path / "tiny.yaml", released, tmp_path / "run", jsonl=precomputed)


@pytest.mark.parametrize("extra, gpus, words", [
    (["--max_samples_per_batch", "6"], 2, "`max_samples_per_batch`: is 6, but each rank's samples take the "
                                          "pyramid stages in turn, in cycles of sum(sample_ratios [1, 2, 1]) = 4"),
    (["--sample_ratios", "[1, 1, 1]"], 2, "fix: use a multiple of 3, e.g. 3"),  # the fix on a line of its own
    (["--model_variant", VARIANTS[1]], 2, "16x16 is not 768p, the resolution diffusion_transformer_768p"),
    (["--resolution_buckets", '["20x20", "16x16"]'], 2, "20x20 has a 20x20 latent"),
    (["--cp_size", "2"], 3, "does not divide the 3 processes per node"),
], ids=["batch", "batch-follows-sample-ratios", "variant-resolution", "stage-sizes", "layout"])
def test_launch_command_refusals(tiny, capsys, extra, gpus, words):
    assert launch_command(capsys, "--nodes", 1, "--gpus-per-node", gpus, "--config", tiny)[0] == 0
    code, _, err = launch_command(capsys, "--nodes", 1, "--gpus-per-node", gpus, "--config", tiny, *extra)
    assert code == 2 and words in err, err


def test_launch_command_refuses_buckets_the_sd3_position_table_cannot_hold(tmp_path, released, precomputed, capsys):
    from pan.models.pyramid_mmdit import PyramidMMDiT, PyramidMMDiTConfig
    root = tmp_path / "sd3"
    save_pretrained(PyramidMMDiT(PyramidMMDiTConfig(
        sample_size=16, patch_size=2, in_channels=3, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        caption_projection_dim=32, joint_attention_dim=24, pooled_projection_dim=20, pos_embed_max_size=12)),
        root / VARIANTS[0])
    config = write_config(tmp_path / "sd3.yaml", root, tmp_path / "run", jsonl=precomputed,
                          model={"model_name": "pyramid_mmdit"})
    assert launch_command(capsys, "--nodes", 1, "--gpus-per-node", 1, "--config", config)[0] == 0
    code, _, err = launch_command(capsys, "--nodes", 1, "--gpus-per-node", 1, "--config", config,
                                  "--resolution_buckets", '["32x32"]')
    assert code == 2 and "wider than the 12 x 12 position table" in err


# ---- `pan check` ---------------------------------------------------------------------------------

def check_rows(config: Path, *extra, gpus: int = 1, sample_rows: int = 4) -> dict[str, list[Row]]:
    """check name -> its rows, for a config that loads."""
    by_check: dict[str, list[Row]] = {}
    for row in run_preflight(Preflight(load(config, *extra), 1, gpus, sample_rows)):
        by_check.setdefault(row.check, []).append(row)
    return by_check


def status(rows: dict[str, list[Row]], check: str) -> tuple[str, str]:
    """The worst status of a check's rows and all their details."""
    found = rows[check]
    worst = next(s for s in ("fail", "warn", "pass") if any(r.status == s for r in found))
    return worst, " ".join(f"{r.detail} {r.fix}" for r in found)  # a refusal's fix is its own field


def test_a_healthy_run_passes_every_check(tmp_path, released, data, precomputed):
    renamed = precomputed.with_name("precomputed.jsonl")  # file stems name streams: train.csv is there
    shutil.copy(precomputed, renamed)
    config = write_config(tmp_path / "ok.yaml", released, tmp_path / "run", csv=data, jsonl=renamed)
    rows = check_rows(config, gpus=2)
    assert {"layout", "placeholders", "stage batch", "variant resolution", "stage sizes", "model folder",
            "text encoders", "vae", "data", "cpu", "output dir", "resume"} <= set(rows)
    failed = {name: status(rows, name)[1] for name in rows if status(rows, name)[0] == "fail"}
    assert not failed
    assert [r.status for r in rows["data"]] == ["pass", "pass"]  # the CSV and the JSONL
    assert "62 tensors" in status(rows, "model folder")[1]


@pytest.mark.parametrize("extra, gpus, check, words", [
    (["--max_samples_per_batch", "6"], 1, "stage batch", "use a multiple of 4, e.g. 4"),
    ([], 16, "stage batch", "train.jsonl has 8 samples, fewer than the 16 data-parallel ranks"),
    (["--model_variant", VARIANTS[1]], 1, "variant resolution", "16x16 is not 768p"),
    (["--resolution_buckets", '["20x20"]'], 1, "stage sizes", "20x20 has a 20x20 latent"),
    (["--cp_size", "2"], 3, "layout", "does not divide the 3 processes per node"),
], ids=["batch", "dp-ranks", "variant-resolution", "stage-sizes", "layout"])
def test_each_launch_rule_is_a_failed_row(tiny, extra, gpus, check, words):
    worst, detail = status(check_rows(tiny, *extra, gpus=gpus), check)
    assert worst == "fail" and words in detail, detail


def test_model_folder_weights_must_fit_the_config(tmp_path, released, precomputed):
    model = model_path_with(tmp_path, released, VARIANTS[0], num_single_layers=2)
    config_json = model / VARIANTS[0] / "config.json"
    saved = json.loads(config_json.read_text())
    config_json.write_text(json.dumps({**saved, "num_single_layers": 1}))  # weights of 2 blocks, config of 1
    config = write_config(tmp_path / "c.yaml", model, tmp_path / "run", jsonl=precomputed)
    worst, detail = status(check_rows(config), "model folder")
    assert worst == "fail" and "unexpected: single_transformer_blocks.1." in detail

    # A config.json asking for activation checkpointing: the trainer applies only its own key.
    save_tiny_flux(model / VARIANTS[0], use_gradient_checkpointing=True)
    assert status(check_rows(config), "model folder")[0] == "warn"
    assert status(check_rows(config, "--enable_gradient_checkpointing", "true"), "model folder")[0] == "pass"


def test_text_encoders_must_load_and_fit_the_dit(tmp_path, tiny, released):
    encoders = tmp_path / "encoders"
    for folder in ENCODER_FOLDERS:
        shutil.copytree(released / folder, encoders / folder)
    clip = encoders / "text_encoder" / "config.json"
    clip.write_text(json.dumps({**json.loads(clip.read_text()), "hidden_size": 16}))  # pooled 16, DiT 20
    worst, detail = status(check_rows(tiny, "--text_encoder_dir", encoders), "text encoders")
    assert worst == "fail" and "pooled CLIP features are 16 wide, the DiT's `pooled_projection_dim` is 20" in detail
    (encoders / "tokenizer_2" / "tokenizer.json").unlink()
    worst, detail = status(check_rows(tiny, "--text_encoder_dir", encoders), "text encoders")
    assert worst == "fail" and "holds no T5 tokenizer" in detail


def test_vae_must_give_the_dits_latent_channels_where_rows_are_encoded_online(tmp_path, released, data,
                                                                            precomputed):
    model = model_path_with(tmp_path, released, VARIANTS[0], in_channels=16)  # 4 latent channels
    online = write_config(tmp_path / "online.yaml", model, tmp_path / "run", csv=data)
    worst, detail = status(check_rows(online), "vae")
    assert worst == "fail" and "3 latent channels" in detail and "the DiT takes 4" in detail
    offline = write_config(tmp_path / "offline.yaml", model, tmp_path / "run", jsonl=precomputed)
    rows = check_rows(offline)
    assert status(rows, "vae")[0] == "warn"  # only validation samples would decode with it
    worst, detail = status(rows, "data")  # and the precomputed latents are not this DiT's
    assert worst == "fail" and "its latent has 3 channels, the DiT takes 4" in detail


def annotation_file(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_annotation_rows_are_read_and_judged_against_the_dit(tmp_path, released, precomputed):
    pre = precomputed.parent
    good = [json.loads(line) for line in precomputed.read_text().splitlines()]
    for row in good:  # absolute paths: the rows move to another folder
        row.update({k: str(pre / row[k]) for k in ("video", "latent", "text_fea")})
    latent = torch.load(good[0]["latent"])                        # [1, 3, 5, 16, 16]
    features = torch.load(good[0]["text_fea"])

    def saved(name: str, obj) -> str:
        torch.save(obj, tmp_path / name)
        return str(tmp_path / name)

    def rows_of(*rows) -> tuple[str, str]:
        jsonl = annotation_file(tmp_path / "rows.jsonl", list(rows))
        config = write_config(tmp_path / "c.yaml", released, tmp_path / "run", jsonl=jsonl)
        return status(check_rows(config, sample_rows=len(rows)), "data")

    assert rows_of(*good[:3])[0] == "pass"
    worst, detail = rows_of(good[0], {**good[1], "latent": str(tmp_path / "gone.pt")}, "{not json")
    assert worst == "warn" and "#1 missing_file" in detail and "#2 bad_row" in detail  # skipped in training
    worst, detail = rows_of({**good[1], "latent": str(tmp_path / "gone.pt")}, "{not json")
    assert worst == "fail" and "0/2" in detail  # nothing usable
    # Rows the DiT cannot take are skipped in training as `unfit` (the reader's own check), and
    # pan check reads them with that reader: a warning while other rows fit.
    for bad, words in (({"latent": saved("c4.pt", torch.zeros(1, 4, 5, 16, 16))}, "latent has 4 channels"),
                       ({"latent": saved("12.pt", latent[..., :12, :12].clone())}, "not made of whole"),
                       ({"text_fea": saved("t.pt", {**features, "prompt_embed": features["prompt_embed"][..., :16]})},
                        "is 16 wide, the DiT takes")):
        worst, detail = rows_of(good[0], {**good[1], **bad})
        assert worst == "warn" and "#1 unfit" in detail and words in detail, detail
        worst, detail = rows_of({**good[1], **bad})
        assert worst == "fail" and "0/1" in detail, detail
    worst, detail = rows_of(good[0], {**good[1], "latent": saved("big.pt", torch.zeros(1, 3, 40, 16, 16))})
    assert worst == "warn" and "#1 over_budget" in detail


# ---- `pan data precompute` for the recipe -----------------------------------------------------------

def task_for(job) -> PyramidFlowTask:
    task = planned_task(job)
    task.load_encoders()
    return task


def first_rows(job, n: int):
    """A packed batch of the first n rows of the job's one data file, read as training reads them."""
    sources = read_row_sources(job.data)
    (stream, _), = sources.items()
    reader = SampleReader(sources, None, rules_of(job.data))
    samples = [reader[Ref(i, stream, 0, i, i)].sample for i in range(n)]
    return SimpleNamespace(samples=samples, skipped={}, packing_efficiency=1.0)


class ShiftedIdentityVAE(IdentityVAE):
    """Pixels as latents, normalised as (x - 0.5) / 2: its latents are not its raw latents, so a
    precompute that saved `encode`'s output instead of the raw latent would show."""

    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        return self.normalize(super().encode(frames))

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        return super().decode(self.unnormalize(latent))

    def unnormalize(self, latent: torch.Tensor) -> torch.Tensor:
        return latent * 2.0 + 0.5

    def normalize(self, raw: torch.Tensor) -> torch.Tensor:
        return (raw - 0.5) / 2.0


def test_precomputed_files_train_the_recipe_on_the_online_inputs(tmp_path, released, data, monkeypatch):
    monkeypatch.setitem(vae_module._BUILDERS, "identity", lambda cfg, device, dtype: ShiftedIdentityVAE(device))
    online = write_config(tmp_path / "online.yaml", released, tmp_path / "a", csv=data,
                          tasks={"cfg_drop_prob": 0.5})  # some captions dropped, the same ones
    assert precompute_main(["--config", str(online), "--out", str(tmp_path / "pre")]) == 0
    jsonl = tmp_path / "pre" / "train.jsonl"
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(rows) == 8 and all((jsonl.parent / r["text_fea"]).is_file() for r in rows)
    assert (jsonl.parent / "text_fea" / "empty.pt").is_file()  # caption dropout; the original never writes it
    raw = torch.load(jsonl.parent / rows[0]["latent"])  # the raw latent, with the batch dim of the original
    assert raw.shape == (1, 3, 5, 16, 16) and raw.min() >= -1 and raw.max() <= 1

    offline = write_config(tmp_path / "offline.yaml", released, tmp_path / "b", jsonl=jsonl,
                           tasks={"cfg_drop_prob": 0.5})
    a_job, b_job = load(online), load(offline)
    a, b = task_for(a_job).prepare(first_rows(a_job, 4)), task_for(b_job).prepare(first_rows(b_job, 4))
    assert first_rows(b_job, 4).samples[0].raw_latent is not None  # read from the files, not decoded
    # Exact: the same frames through the same encoders (the precompute encodes one caption at a
    # time, training a batch: equal here, tiny T5 / CLIP in fp32 on CPU).
    for field in ("x", "target", "weight", "timesteps", "text", "pooled"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert a.pack.layouts == b.pack.layouts and a.sample_ids == b.sample_ids

    build_trainer(b_job).fit()  # trains from annotation_paths alone
    logged = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2] and all(torch.isfinite(torch.tensor(r["loss"])) for r in logged)


def test_text_encoders_load_only_where_captions_are_encoded(tmp_path, released, precomputed, monkeypatch):
    import pan.recipes.pyramid_flow.task as pyramid_task  # where the task looks the encoder builder up

    loads = []
    build = pyramid_text.build_text_encoder
    monkeypatch.setattr(pyramid_task, "build_text_encoder", lambda *a: loads.append(a) or build(*a))

    def task_and_loads(jsonl: Path, *extra) -> tuple[PyramidFlowTask, int]:
        loads.clear()
        task = task_for(load(write_config(tmp_path / "t.yaml", released, tmp_path / "run", jsonl=jsonl), *extra))
        return task, len(loads)

    def write_rows(path: Path, rows: list[dict]) -> Path:
        path.parent.mkdir(exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return path

    first, *rest = [json.loads(line) for line in precomputed.read_text().splitlines()]
    empty = pyramid_text.load_features(precomputed.parent / "text_fea" / "empty.pt")
    # Every row has its text_fea and the precompute wrote the empty caption's beside them: no encoder,
    # and each dropped caption (all of them here) takes the written empty caption.
    task, n = task_and_loads(precomputed, "--cfg_drop_prob", "1.0")
    inputs = task.prepare(first_rows(task.job, 4))
    assert n == 0 and not loads
    assert torch.equal(inputs.text, torch.cat([empty.caption_rows()] * 4))
    assert torch.equal(inputs.pooled, torch.stack([empty.pooled_prompt_embed] * 4))
    # Validation prompts are encoded: the encoders load, and their empty caption is the written one.
    task, n = task_and_loads(precomputed, "--validation_interval", "1", "--validation_prompts", "[a red square]")
    assert n == 1 and all(torch.equal(a, b) for a, b in zip(task.empty.tensors(), empty.tensors()))
    # A row without text_fea is encoded online.
    without_text_fea = {k: v for k, v in first.items() if k != "text_fea"}
    assert task_and_loads(write_rows(precomputed.with_name("partly.jsonl"), [without_text_fea, *rest]))[1] == 1
    # Files of the original's tools (no empty caption beside them): the encoders load to make it.
    absolute = [{k: str(precomputed.parent / v) if k in ("video", "latent", "text_fea") else v for k, v in row.items()}
                for row in (first, *rest)]
    task, n = task_and_loads(write_rows(tmp_path / "moved" / "train.jsonl", absolute))
    assert n == 1 and torch.equal(task.empty.prompt_embed, empty.prompt_embed)


def test_precompute_skips_what_exists_and_refuses_other_settings(tmp_path, released, data, capsys):
    config = write_config(tmp_path / "p.yaml", released, tmp_path / "run", csv=data)
    out = tmp_path / "pre"
    assert precompute_main(["--config", str(config), "--out", str(out), "--limit", "2"]) == 0
    assert precompute_main(["--config", str(config), "--out", str(out), "--limit", "3"]) == 0
    assert "1 latents written, 2 already there" in capsys.readouterr().out
    assert len((out / "train.jsonl").read_text().splitlines()) == 3
    assert precompute_main(["--config", str(config), "--out", str(out), "--t5_max_length", "64"]) == 2
    assert "text.t5_max_length changed" in capsys.readouterr().err
