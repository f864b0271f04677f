"""What `pan check` fails, train.py and `pan launch-command` refuse (issue 29): exit 2, the same
message, nothing built.

One source of truth: the cases below are checked against the recipes' own check lists
(`pan.preflight.ENVIRONMENT_CHECKS` + each recipe's `checks` hook). A check that can fail needs a
case here (a config, made tiny, on which that row fails); a check that cannot fail for a recipe, or
not on this machine, is declared in CANNOT_FAIL with the reason. A new check without either fails
`test_every_check_has_a_case_or_a_reason`.

Each case runs `pan check` and `pan train` (train.py's entry: pan.cli) in this process, through the
arguments a user types: `pan check` exits 1 with the row failed (2 when the config loader refuses
it first), `pan train` exits 2 printing that row's problem, without a traceback, and output_dir holds
no config.yaml, lease or checkpoint. A few cases also run `python train.py` as a subprocess.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from pan.checkpoint.layout import MARKER
from pan.checkpoint.lease import LEASE_FILE
from pan.preflight import ENVIRONMENT_CHECKS, check_name, recipe_checks
from pan.recipe import recipe_names

ROOT = Path(__file__).resolve().parents[1]
# A launch inside pytest: no thread that watches pytest's parent process.
IN_PROCESS = ["--exit_when_launcher_dies", "false"]

# (recipe, check) -> why no config makes that row fail here. "*" stands for every recipe.
CANNOT_FAIL = {
    ("*", "devices"): "fails only where fewer GPUs are visible than the planned processes per node; "
                      "a CPU machine has none, which is a warning (tests/test_preflight.py fakes GPUs)",
    ("*", "backend"): "fails only with a torch build without torch.distributed / gloo / NCCL",
    ("*", "cpu"): "never fails: oversubscribed cores are a warning",
    ("*", "step time"): "never fails: it reports the estimate (the memory row is the one that refuses)",
    ("*", "placeholders"): "a template placeholder in a path key is refused when the config loads, for "
                           "every recipe (pan.config.core.placeholder_in): the row passes once it loads",
    ("causal_vae", "frames"): "never fails: an unbalanced context split is a warning",
    ("causal_vae", "gan"): "never fails: no discriminator, or a disc_start the run never reaches, is a warning",
    ("wan", "warm start"): "the recipe has no warm-start keys (no part is `warm_start`): each trained part starts "
                           "from the folder's own transformer weights, and the row only says so (the folder's "
                           "problems are the `wan folder`, `text encoder` and `vae` rows')",
    ("wan", "memory by hand"): "fails only where the hand count of config.json (pan/recipes/wan/probe.py) disagrees "
                               "with the estimate's count of the model built: tests/test_wan_check.py checks they "
                               "agree (test_hand_count_is_the_model, test_estimate_is_what_a_step_allocates) and "
                               "that the row passes (test_shipped_config_fits_its_layout)",
}


@dataclass
class PyramidRelease:
    """A tiny released Pyramid-Flow folder (tests/pyramid_tiny.py: the tiny miniFLUX under the 384p
    and the 768p variants' names, the tiny T5 / CLIP encoders) and clips it trains on through the
    identity VAE."""
    model: Path
    clips_csv: Path          # 4 synthetic clips, 5 frames of 16x16


@dataclass
class WanRelease:
    """A tiny diffusers Wan 2.1 T2V folder (tests/wan_tiny.py) and synthetic clips of its geometry,
    which the base run encodes online (its VAE and umT5)."""
    model: Path
    clips_csv: Path          # 2 synthetic clips of clip_geometry(model): 5 frames of 32x32
    geometry: dict


# The workflow `pan launch-command` prints each recipe's commands with.
WORKFLOWS = {"pan": "pretrain", "causal_vae": "causal-video-vae", "toy_gan": "toy-gan",
             "pyramid_flow": "pyramid-flow-no-ar", "pyramid_flow_ar": "pyramid-flow-ar"}
# Recipes that declare no workflow (`Recipe.workflows`), so `pan launch-command` has none to print;
# `test_every_recipe_has_a_workflow_or_a_reason` checks that each still declares none.
NO_WORKFLOW = {"wan": "it declares no workflow yet (its runs start with train.py / torchrun on a config)"}


@dataclass
class Work:
    """A case's folder and the shared tiny inputs."""
    dir: Path
    clips_csv: Path          # 4 synthetic clips, 9 frames of 32x32 (pan data synth)
    pyramid: PyramidRelease | None = None   # the Pyramid-Flow recipes' (only built for their cases)
    wan: WanRelease | None = None           # the Wan recipe's (only built for its cases)

    @property
    def out(self) -> Path:
        return self.dir / "run"


# Each recipe's tiny base config (it passes `pan check`), as the arguments a user types.
def pan_base(w: Work) -> list[str]:
    return ["--config", str(ROOT / "config/tiny_cpu.yaml"), "--video_csv_paths", str(w.clips_csv),
            "--output_dir", str(w.out)]


def causal_vae_base(w: Work) -> list[str]:
    return ["--config", str(ROOT / "config/causal_vae_tiny.yaml"), "--video_csv_paths", str(w.clips_csv),
            "--output_dir", str(w.out)]


def toy_gan_base(w: Work) -> list[str]:
    cfg = {"recipe": "toy_gan", "model": {"toy_width": 8, "toy_samples": 12, "toy_batch": 2},
           "training": {"max_steps": 2, "learning_rate": 1e-2, "warmup_steps": 0, "dtype": "fp32"},
           "output": {"output_dir": str(w.out), "save_interval": 2, "log_interval": 1, "progress_bar": False}}
    path = w.dir / "toy_gan.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return ["--config", str(path)]


def pyramid_config(w: Work, recipe: str, **sections) -> list[str]:
    """A tiny run of a released Pyramid-Flow folder on 16x16 clips (identity VAE: 3 latent channels,
    the tiny DiT's); `sections` add keys to the YAML's sections."""
    cfg = {"recipe": recipe,
           "model": {"model_name": "pyramid_flux", "model_path": str(w.pyramid.model), "vae_type": "identity"},
           "training": {"max_steps": 2, "learning_rate": 2e-3, "dtype": "fp32", "use_muon": False,
                        **sections.pop("training", {})},
           "data": {"video_csv_paths": [str(w.pyramid.clips_csv)], "resolution_buckets": ["16x16"],
                    "min_frames": 1, "frames_mod": 1, "frames_remainder": 0, "max_samples_per_batch": 4,
                    "packed_dataloader_num_workers": 0, **sections.pop("data", {})},
           "output": {"output_dir": str(w.out), "save_interval": 2, "log_interval": 1, "progress_bar": False},
           **sections}
    path = w.dir / f"{recipe}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return ["--config", str(path)]


def pyramid_flow_base(w: Work) -> list[str]:
    """Whole 5-frame clips: a cycle of the 4 stages' samples is 500 tokens."""
    return pyramid_config(w, "pyramid_flow", data={"max_frames": 5, "max_tokens_per_batch": 512})


def pyramid_flow_ar_base(w: Work) -> list[str]:
    """Windows of 2 latent frames = 2 units of 1 frame, one sync group of 2 slots on 1 rank x 2
    micro-batches."""
    return pyramid_config(w, "pyramid_flow_ar", autoregressive={"frame_per_unit": 1, "video_sync_group": 2},
                          training={"gradient_accumulation_steps": 2},
                          data={"max_frames": 2, "max_tokens_per_batch": 1000})


def wan_base(w: Work) -> list[str]:
    """The tiny Wan folder fine-tuned on its clips, encoded online: 2 clips of 8 tokens a micro-batch."""
    g = w.wan.geometry
    cfg = {"recipe": "wan", "model": {"model_path": str(w.wan.model)},
           "training": {"max_steps": 2, "learning_rate": 1e-3, "dtype": "fp32"},
           "data": {"video_csv_paths": [str(w.wan.clips_csv)], "resolution_buckets": [f"{g['size']}x{g['size']}"],
                    "min_frames": g["frames"], "max_frames": g["frames"], "max_tokens_per_batch": 2 * g["tokens"],
                    "max_samples_per_batch": 2, "packed_dataloader_num_workers": 0},
           "output": {"output_dir": str(w.out), "save_interval": 2, "log_interval": 1, "progress_bar": False}}
    path = w.dir / "wan.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return ["--config", str(path)]


BASES: dict[str, Callable[[Work], list[str]]] = {"pan": pan_base, "causal_vae": causal_vae_base,
                                                  "toy_gan": toy_gan_base, "pyramid_flow": pyramid_flow_base,
                                                  "pyramid_flow_ar": pyramid_flow_ar_base, "wan": wan_base}


# ---- what makes each row fail: extra arguments (and files) on top of the recipe's base ----------

def output_dir_is_a_file(w: Work) -> list[str]:
    w.dir.mkdir(parents=True, exist_ok=True)
    w.out.write_text("not a folder\n")
    return []


def unreadable_checkpoint(w: Work) -> list[str]:
    """A complete-looking checkpoint whose files are gone: none is readable, so no resume."""
    ckpt = w.out / "checkpoint-2"
    ckpt.mkdir(parents=True)
    (ckpt / MARKER).write_text(json.dumps({"files": {"meta.json": 10}}))
    return []


def args(*extra: str) -> Callable[[Work], list[str]]:
    return lambda w: list(extra)


def missing_clip_csv(w: Work) -> list[str]:
    csv = w.dir / "missing.csv"
    csv.write_text("path,caption\nno_such_clip.mp4,a red square moving left\n")
    return ["--video_csv_paths", str(csv)]


def misfit_warm_start(recipe: str) -> Callable[[Work], list[str]]:
    """Weights of another architecture: every tensor named like the recipe's model's, one size larger."""
    def make(w: Work) -> list[str]:
        from pan.config import load_job_config
        from pan.preflight import Preflight
        ctx = Preflight(load_job_config(BASES[recipe](w), warn=lambda m: None), 1, 1)
        weights = {name: torch.zeros(*[n + 1 for n in shape]) for name, shape in ctx.model_shapes.items()}
        path = w.dir / "other.safetensors"
        save_file(weights, str(path))
        return ["--load_transformer_weights", "true", "--pretrained_transformer_path", str(path)]
    return make


# A model no test machine holds: 2 layers of width 8192 (~4B parameters, ~100 GiB with its optimizer
# states), traced on fake tensors only.
HUGE_PAN = ["--transformer_config_overrides.hidden_size", "8192",
            "--transformer_config_overrides.num_attention_heads", "512"]


def released_dit(w: Work, config_changes: dict | None = None, **changes) -> Path:
    """A model folder of its own: the tiny DiT with `changes` to its architecture (and its
    config.json's keys then changed to `config_changes`, the weights kept), beside the shared
    release's text encoders."""
    from pyramid_tiny import ENCODER_FOLDERS, VARIANT, save_tiny_flux

    root = w.dir / "model"
    save_tiny_flux(root / VARIANT, **changes)
    if config_changes:
        config = root / VARIANT / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), **config_changes}))
    for folder in ENCODER_FOLDERS:
        (root / folder).symlink_to(w.pyramid.model / folder)
    return root


def dit_weights_of_another_depth(w: Work) -> list[str]:
    """config.json of 1 double-stream block, the weights of a DiT with 2."""
    return ["--model_path", str(released_dit(w, {"num_layers": 1}, num_layers=2))]


def dit_of_other_caption_width(w: Work) -> list[str]:
    """A DiT taking 32-wide caption features: the tiny T5 gives 24."""
    return ["--model_path", str(released_dit(w, joint_attention_dim=32))]


def dit_of_other_latent_channels(w: Work) -> list[str]:
    """A DiT of 4 latent channels (16 = 4 x a 2x2 patch): the identity VAE gives the clips' 3."""
    return ["--model_path", str(released_dit(w, in_channels=16))]


def ar_rows_without_latents(w: Work) -> list[str]:
    """Annotation rows (the synthetic clips' JSONL: `video` and `text`) with no `latent`, on the
    identity VAE: they would train on pixels."""
    return ["--video_csv_paths", "[]", "--annotation_paths", f"[{w.pyramid.clips_csv.with_suffix('.jsonl')}]"]


# A micro-batch no test machine holds, on the tiny DiT: 4 clips of the largest 384p-class bucket
# (896x512, 0.46 MP) through the identity VAE, 114,688 tokens a frame at the top stage, 5 frames
# (the AR recipe: units of 4 frames); the attention over such a pack is ~3 TiB (traced on fake
# tensors only).
HUGE_PYRAMID = ["--resolution_buckets", '["896x512"]', "--max_frames", "5", "--max_tokens_per_batch", "10000000000"]

# A micro-batch no test machine holds, on the tiny VAE: 400 of the synthetic clips at 512x512 (9
# frames each, one stacked batch of 943,718,400 pixels), ~1 TiB of activations (~580 GiB even fully
# checkpointed), traced on fake tensors only.
HUGE_VAE = ["--resolution_buckets", '["512x512"]', "--max_samples_per_batch", "400",
            "--max_tokens_per_batch", str(400 * 9 * 512 * 512)]


def wan_folder(w: Work, transformer: dict | None = None, without: tuple[str, ...] = (),
               weights: bool = True) -> list[str]:
    """A Wan folder of its own: the shared tiny folder's parts (linked), its transformer's config.json
    keys changed to `transformer` (the weights kept, or with `weights` false weights that are headers
    only, of the changed model), the parts in `without` left out."""
    root = w.dir / "wan"
    root.mkdir(parents=True)
    for part in w.wan.model.iterdir():
        if part.name not in without and not (transformer and part.name == "transformer"):
            (root / part.name).symlink_to(part)
    if transformer:
        (root / "transformer").mkdir()
        for f in (w.wan.model / "transformer").iterdir():
            if weights and f.name != "config.json":
                (root / "transformer" / f.name).symlink_to(f)
        config = json.loads((w.wan.model / "transformer/config.json").read_text())
        (root / "transformer/config.json").write_text(json.dumps({**config, **transformer}))
        if not weights:   # their headers only (a sparse file): the config check asks for the file
            from wan_tiny import write_weight_headers
            write_weight_headers(root)
    return ["--model_path", str(root)]


# A transformer no test machine holds, fully fine-tuned: 2 blocks of width 16384 (128 heads x 128), MLP
# 65536 (~10.7B parameters, ~173 GiB with their gradients and AdamW states) on the tiny folder's VAE and
# umT5, as config.json and weights that are headers only (the check reads only the headers), traced on
# fake tensors.
HUGE_WAN = dict(num_layers=2, num_attention_heads=128, attention_head_dim=128, ffn_dim=65536)


@dataclass
class Case:
    make: Callable[[Work], list[str]]
    # "row": the check's own row fails (pan check exits 1); "config": the config loader already
    # refuses what the check refuses (pan check exits 2 with a `config` row).
    expect: str = "row"


CASES: dict[tuple[str, str], Case] = {
    ("pan", "layout"): Case(args("--cp_size", "2")),
    ("pan", "batch"): Case(args("--max_tokens_per_batch", "10")),
    ("pan", "data"): Case(missing_clip_csv),
    # The config load builds the tokenizer too, so a misfit key is refused there.
    ("pan", "text encoder"): Case(args("--text_encoder_chat_template", "true"), expect="config"),
    ("pan", "vae"): Case(args("--transformer_config_overrides.out_channels", "4",
                              "--transformer_config_overrides.in_channels", "4")),
    ("pan", "warm start"): Case(misfit_warm_start("pan")),
    ("pan", "output dir"): Case(output_dir_is_a_file),
    ("pan", "resume"): Case(unreadable_checkpoint),
    ("pan", "memory"): Case(args(*HUGE_PAN)),
    ("causal_vae", "layout"): Case(args("--context_size", "2")),
    ("causal_vae", "context"): Case(args("--context_size", "2")),
    ("causal_vae", "lpips"): Case(args("--perceptual_weight", "1.0", "--lpips_ckpt", "/no/such/vgg_lpips.pth"),
                                  expect="config"),
    ("causal_vae", "warm start"): Case(args("--warm_start_checkpoint", "/no/such/checkpoint-10")),
    ("causal_vae", "clips"): Case(missing_clip_csv),
    ("causal_vae", "output dir"): Case(output_dir_is_a_file),
    ("causal_vae", "memory"): Case(args(*HUGE_VAE)),
    ("toy_gan", "layout"): Case(args("--cp_size", "2"), expect="config"),
    ("toy_gan", "toy data"): Case(args("--toy_samples", "1")),
    ("toy_gan", "output dir"): Case(output_dir_is_a_file),
    ("toy_gan", "resume"): Case(unreadable_checkpoint),
    # 2e9 samples a micro-batch: ~430 GiB of activations (the samples are made lazily).
    ("toy_gan", "memory"): Case(args("--toy_samples", "2000000000", "--toy_batch", "2000000000")),
    ("pyramid_flow", "layout"): Case(args("--cp_size", "2")),
    ("pyramid_flow", "stage batch"): Case(args("--max_samples_per_batch", "3")),
    # 16x16 clips are 384p-class (by area, on a log scale): not what the 768p variant was trained at.
    ("pyramid_flow", "variant resolution"): Case(args("--model_variant", "diffusion_transformer_768p")),
    # 20x16 (W x H): a 16x20 latent, 4x5 at the lowest stage, which 2x2 patches do not cut. (The
    # memory and step-time rows point to this row: they do not trace such clips.)
    ("pyramid_flow", "stage sizes"): Case(args("--resolution_buckets", '["20x16"]')),
    ("pyramid_flow_ar", "stage sizes"): Case(args("--resolution_buckets", '["20x16"]')),
    ("pyramid_flow", "model folder"): Case(dit_weights_of_another_depth),
    ("pyramid_flow", "warm start"): Case(misfit_warm_start("pyramid_flow")),
    ("pyramid_flow", "text encoders"): Case(dit_of_other_caption_width),
    ("pyramid_flow", "vae"): Case(dit_of_other_latent_channels),
    ("pyramid_flow", "data"): Case(missing_clip_csv),
    ("pyramid_flow", "output dir"): Case(output_dir_is_a_file),
    ("pyramid_flow", "resume"): Case(unreadable_checkpoint),
    ("pyramid_flow", "memory"): Case(args(*HUGE_PYRAMID)),
    ("pyramid_flow_ar", "layout"): Case(args("--cp_size", "2")),
    # The task refuses the same rule when it is built, which the layout row does first: this row
    # then fails as "the same problem as the `layout` row".
    ("pyramid_flow_ar", "sync group"): Case(args("--gradient_accumulation_steps", "1")),
    ("pyramid_flow_ar", "units"): Case(args("--max_tokens_per_batch", "50")),
    ("pyramid_flow_ar", "variant resolution"): Case(args("--model_variant", "diffusion_transformer_768p")),
    ("pyramid_flow_ar", "model folder"): Case(dit_weights_of_another_depth),
    ("pyramid_flow_ar", "warm start"): Case(misfit_warm_start("pyramid_flow_ar")),
    ("pyramid_flow_ar", "text encoders"): Case(dit_of_other_caption_width),
    ("pyramid_flow_ar", "vae"): Case(dit_of_other_latent_channels),
    ("pyramid_flow_ar", "data"): Case(missing_clip_csv),
    ("pyramid_flow_ar", "annotation rows"): Case(ar_rows_without_latents),
    ("pyramid_flow_ar", "output dir"): Case(output_dir_is_a_file),
    ("pyramid_flow_ar", "resume"): Case(unreadable_checkpoint),
    ("pyramid_flow_ar", "memory"): Case(args(*HUGE_PYRAMID, "--frame_per_unit", "4")),
    # 1 process: a cp group of 2 does not fit in it.
    ("wan", "layout"): Case(args("--cp_size", "2")),
    # config.json of 1 block, the weights of the tiny folder's 2 (their headers are read).
    ("wan", "wan folder"): Case(lambda w: wan_folder(w, transformer={"num_layers": 1})),
    # The clips' captions are encoded in training, with umT5: a folder without text_encoder/.
    ("wan", "text encoder"): Case(lambda w: wan_folder(w, without=("text_encoder",))),
    # A transformer predicting 6 latent channels, beside the VAE's 4: refused when the config loads.
    ("wan", "vae"): Case(lambda w: wan_folder(w, transformer={"in_channels": 6, "out_channels": 6}),
                         expect="config"),
    ("wan", "data"): Case(missing_clip_csv),
    ("wan", "output dir"): Case(output_dir_is_a_file),
    ("wan", "resume"): Case(unreadable_checkpoint),
    ("wan", "memory"): Case(lambda w: wan_folder(w, transformer=HUGE_WAN, weights=False)),
}

# Checks that can fail but have no case here yet, with the reason. They are still declared (a new
# check appears in neither list and fails the test); each is a case to add.
NO_CASE_YET: dict[tuple[str, str], str] = {}


def declared_checks() -> list[tuple[str, str]]:
    """(recipe, check) of every row `pan check` can print for a recipe's config, from the recipes'
    own declarations."""
    found = []
    for recipe in recipe_names():
        for fn in [*ENVIRONMENT_CHECKS, *recipe_checks(recipe)]:
            if (recipe, check_name(fn)) not in found:
                found.append((recipe, check_name(fn)))
    return found


def test_every_recipe_has_a_workflow_or_a_reason():
    from pan.recipe import all_workflows

    declared = {w.recipe for w in all_workflows().values()}
    missing = [r for r in recipe_names() if r not in WORKFLOWS and r not in NO_WORKFLOW]
    assert not missing, f"recipes with no workflow for `pan launch-command` in WORKFLOWS or NO_WORKFLOW: {missing}"
    assert all(all_workflows()[name].recipe == recipe for recipe, name in WORKFLOWS.items()), WORKFLOWS
    stale = [r for r in NO_WORKFLOW if r in declared]
    assert not stale, f"recipes in NO_WORKFLOW that now declare a workflow (add it to WORKFLOWS): {stale}"


def cannot_fail(recipe: str, check: str) -> str | None:
    return CANNOT_FAIL.get((recipe, check)) or CANNOT_FAIL.get(("*", check))


def test_every_check_has_a_case_or_a_reason():
    missing = [f"{recipe}: {check}" for recipe, check in declared_checks()
               if (recipe, check) not in CASES and (recipe, check) not in NO_CASE_YET
               and not cannot_fail(recipe, check)]
    assert not missing, ("checks that can fail without a case in CASES (or a reason in CANNOT_FAIL): "
                         + ", ".join(missing))
    stale = [key for key in [*CASES, *NO_CASE_YET] if key not in declared_checks()]
    assert not stale, f"cases of checks no recipe declares: {stale}"


@pytest.fixture(scope="module")
def clips_csv(tmp_path_factory) -> Path:
    from pan.data.synth import main as synth
    out = tmp_path_factory.mktemp("clips")
    assert synth(["--out", str(out), "--num-train", "4", "--num-heldout", "1", "--size", "32",
                  "--num-frames", "9"]) in (0, None)
    return out / "train.csv"


@pytest.fixture(scope="module")
def pyramid_release(tmp_path_factory) -> PyramidRelease:
    from pyramid_tiny import VARIANT, write_released

    from pan.data.synth import synth_dataset

    root = tmp_path_factory.mktemp("pyramid")
    clips = synth_dataset(root / "clips", num_train=4, num_heldout=1, size=16, num_frames=5)["train_csv"]
    return PyramidRelease(write_released(root / "model", (VARIANT, "diffusion_transformer_768p")), clips)


def write_wan_release(root: Path) -> WanRelease:
    """The tiny Wan 2.1 T2V folder and 2 clips of its geometry (5 frames of 32x32) under `root`."""
    from wan_tiny import clip_geometry, write_wan_folder

    from pan.data.synth import synth_dataset

    model = write_wan_folder(root / "model", "t2v")
    geometry = clip_geometry(model)
    clips = synth_dataset(root / "clips", num_train=2, num_heldout=0, size=geometry["size"],
                          num_frames=geometry["frames"])["train_csv"]
    return WanRelease(model, clips, geometry)


@pytest.fixture(scope="module")
def wan_release(tmp_path_factory) -> WanRelease:
    return write_wan_release(tmp_path_factory.mktemp("wan"))


def work_for(recipe: str, tmp_path: Path, clips_csv: Path, request) -> Work:
    """A case's Work, with the shared tiny release its recipe needs (built once per module)."""
    pyramid = request.getfixturevalue("pyramid_release") if recipe.startswith("pyramid_flow") else None
    wan = request.getfixturevalue("wan_release") if recipe == "wan" else None
    return Work(tmp_path, clips_csv, pyramid, wan)


def nothing_built(out: Path) -> None:
    if not out.is_dir():
        return
    made = {p.name for p in out.iterdir()}
    assert not made & {"config.yaml", LEASE_FILE, "metrics.jsonl"}, made
    assert not [p for p in made if p.startswith("checkpoint-") and p != "checkpoint-2"], made


def pan_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`pan <argv>` in this process: (exit code, stdout, stderr)."""
    from pan.cli import main
    from pan.logging import get_logger
    for handler in get_logger().handlers:  # pan's log goes to this test's captured stderr
        if type(handler) is logging.StreamHandler:
            handler.stream = sys.stderr
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def numbers_apart(text: str) -> str:
    return re.sub(r"\d[\d.,]*", "#", text)


def problems_of(report: dict, check: str, expect: str) -> list[str]:
    """The first line of each failed row of `check` (or of the config rows)."""
    name = "config" if expect == "config" else check
    return [r["detail"].splitlines()[0] for r in report["rows"] if r["check"] == name and r["status"] == "fail"]


@pytest.mark.parametrize("recipe,check", sorted(CASES), ids=[f"{r}-{c}" for r, c in sorted(CASES)])
def test_train_refuses_what_pan_check_fails(recipe, check, tmp_path, clips_csv, capsys, request):
    case = CASES[(recipe, check)]
    work = work_for(recipe, tmp_path, clips_csv, request)
    argv = BASES[recipe](work) + case.make(work)

    code, out, err = pan_cli(["check", *argv, "--json"], capsys)
    report = json.loads(out)
    assert code == (2 if case.expect == "config" else 1), out
    problems = problems_of(report, check, case.expect)
    assert problems, f"no failed `{check}` row:\n{out}"
    assert all("see the message" not in r["fix"] and r["fix"] for r in report["rows"] if r["status"] == "fail")

    code, out, err = pan_cli(["train", *argv, *IN_PROCESS], capsys)
    assert code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    for problem in problems:  # numbers apart: a measured value (free memory) may differ
        assert numbers_apart(problem)[:60] in numbers_apart(err), f"{problem!r} not said by train:\n{err[-3000:]}"
    nothing_built(work.out)
    if recipe in NO_WORKFLOW:
        return

    # `pan launch-command` for the same layout (one process), planning the memory `pan check` planned for.
    capacity = report.get("estimate", {}).get("capacity")
    memory = ["--device-memory", str(capacity / 2**30)] if capacity else []
    code, out, err = pan_cli(["launch-command", "--workflow", WORKFLOWS[recipe], "--nodes", "1", "--gpus-per-node",
                              "1", *memory, *argv], capsys)
    assert code == 2 and not out, out + err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    for problem in said_where(report, problems):
        said = capacity_apart(numbers_apart(problem))[:60]
        assert said in capacity_apart(numbers_apart(err)), f"{problem!r} not said by launch-command:\n{err}"


def capacity_apart(text: str) -> str:
    """The memory row names where its capacity comes from (this machine, or --device-memory)."""
    return re.sub(r"\((available host memory|--device-memory [^)]*)\)", "(capacity)", text)


def said_where(report: dict, problems: list[str]) -> list[str]:
    """The problems, a row's "the same problem as the `X` row above" replaced by X's own: launch-command
    refuses a layout before running the rows, in the words of the row that owns it."""
    out = []
    for problem in problems:
        owner = re.match(r"the same problem as the `(.+)` row above", problem)
        out += problems_of(report, owner.group(1), "row") if owner else [problem]
    return out


def test_the_table_says_one_problem_a_line(tmp_path, clips_csv, capsys):
    """Several problems of a config are rows of their own, each with its fix (not one cell)."""
    argv = pan_base(Work(tmp_path, clips_csv)) + ["--resolution_buckets", '["30x30"]', "--frames_mod", "4",
                                                   "--frames_remainder", "4"]
    code, out, _ = pan_cli(["check", *argv], capsys)
    assert code == 2, out
    config_rows = [line for line in out.splitlines() if line.startswith("config ")]
    assert len(config_rows) >= 2, out
    assert "see the message" not in out and "problems:" not in out, out


# ---- through the commands a user types, as subprocesses ------------------------------------------

def pan_command() -> list[str]:
    script = Path(sys.executable).parent / "pan"
    return [str(script)] if script.exists() else [sys.executable, "-m", "pan.cli"]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    return subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("extra,says", [
    # issue 29, broken 2: a bucket the patch does not divide was built, leased and written first
    (["--resolution_buckets", '["30x30"]'], "`resolution_buckets` (command line): 30x30 (nearest valid: 28x28 or 32x32)"),
    (["--max_tokens_per_batch", "10"], "batch: even the shortest clip exceeds max_tokens_per_batch 10"),
], ids=["bucket-not-divisible-by-patch", "failed-row"])
def test_train_py_refuses_before_building(extra, says, tmp_path, clips_csv):
    out = tmp_path / "run"
    argv = ["--config", "config/tiny_cpu.yaml", "--video_csv_paths", str(clips_csv), "--output_dir", str(out), *extra]
    check = run([*pan_command(), "check", *argv])
    assert check.returncode in (1, 2) and says.split(": ", 1)[-1][:40] in check.stdout, check.stdout
    train = run([sys.executable, "train.py", *argv])
    assert train.returncode == 2, train.stderr[-3000:]
    assert says in train.stderr and "Traceback" not in train.stderr, train.stderr[-3000:]
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_output_dir_that_is_a_file_is_named(tmp_path, clips_csv):
    out = tmp_path / "run"
    out.write_text("a file\n")
    train = run([sys.executable, "train.py", "--config", "config/tiny_cpu.yaml", "--video_csv_paths",
                 str(clips_csv), "--output_dir", str(out)])
    assert train.returncode == 2, train.stderr[-3000:]
    assert "`output_dir`" in train.stderr and "is a file" in train.stderr and "choose a folder" in train.stderr
    assert "Errno" not in train.stderr and "Traceback" not in train.stderr, train.stderr[-3000:]


def test_every_rank_of_a_launch_refuses_with_rank_0_saying_why(tmp_path, clips_csv):
    """Two ranks (as torchrun starts them): rank 0 runs the rows, both exit 2, one refusal printed."""
    from launch_utils import launch

    cfg = yaml.safe_load((ROOT / "config/tiny_cpu.yaml").read_text())
    out = tmp_path / "run"
    out.write_text("a file\n")
    cfg["data"]["video_csv_paths"] = [str(clips_csv)]
    cfg["output"]["output_dir"] = str(out)
    config = tmp_path / "two_ranks.yaml"
    config.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "launch.log"
    procs = launch(config, log, world_size=2)
    codes = [p.wait(timeout=240) for p in procs]
    text = log.read_text()
    assert codes == [2, 2], text[-3000:]
    assert text.count("pan: cannot start: `pan check` fails for this launch") == 1, text[-3000:]
    assert "(1 x 2 processes)" in text and "is a file" in text and "Traceback" not in text, text[-3000:]
