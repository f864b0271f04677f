"""`pan check` reads rows as training reads them (issue 52, item 3).

Every recipe's data check reads a sample of rows with the reader its training uses, the task's
`SampleFit` included (pan/data/fit.py): a row the model cannot take is `unfit` in the check as it is
in training. For every recipe (the built-in ones and the plugin tests/plugins/pan_toy_gan, from
`pan.recipe.recipe_names()`), a run whose every row is unfit for its model (each recipe its own kind)
fails its data row naming the problem and `pan check` exits non-zero; a recipe whose check cannot
see rows says why below (and the reason is checked to still hold). For the Pan and Wan recipes,
train.py's entry refuses such a run before it builds the model: no config.yaml, lease or metrics.jsonl.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import pan.preflight.command as check_command
from pan.config import load_job_config
from pan.recipe import get_recipe, recipe_names, resolve
from test_data_sources import image_bytes
from test_refusal_parity import (  # the fixtures too: the same tiny clips and release
    BASES,
    IN_PROCESS,
    Work,
    clips_csv,
    nothing_built,
    pan_cli,
    pyramid_release,
    wan_release,
)

ROOT = Path(__file__).resolve().parents[1]


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- each recipe's run of unfit rows: (extra arguments, what the data row must say) ---------------

def pan_latents_of_another_vae(w: Work) -> tuple[list[str], str, str]:
    """pan's precomputed rows (latent_path CSV) whose latents have 8 channels: tiny_cpu.yaml's
    transformer takes 3."""
    root = w.dir / "latents"
    root.mkdir(parents=True)
    rows = []
    for i in range(4):
        save_file({"latent": randn(8, 5, 8, 8, seed=i), "text": randn(6, 384, seed=100 + i)},
                  str(root / f"clip{i}.safetensors"))
        rows.append([f"clip{i}.safetensors", f"a clip of another VAE {i}"])
    with open(root / "latents.csv", "w", newline="") as f:
        csv.writer(f).writerows([["latent_path", "caption"], *rows])
    return ["--video_csv_paths", str(root / "latents.csv")], "data", "its latent has 8 channels, the DiT takes 3"


def pyramid_rows(w: Work, shape: tuple[int, ...]) -> list[str]:
    """Annotation rows of precomputed latents of `shape` (captions encoded online)."""
    root = w.dir / "rows"
    root.mkdir(parents=True)
    rows = []
    for i in range(4):
        torch.save(randn(*shape, seed=i), root / f"latent{i}.pt")
        rows.append({"latent": f"latent{i}.pt", "text": f"clip {i}"})
    return ["--video_csv_paths", "[]", "--annotation_paths", f"[{write_jsonl(root / 'rows.jsonl', rows)}]"]


def pyramid_latents_of_another_vae(w: Work) -> tuple[list[str], str, str]:
    """Latents of 4 channels: the tiny DiT (identity VAE) takes 3."""
    return pyramid_rows(w, (4, 5, 16, 16)), "data", "its latent has 4 channels"


def ar_latents_without_whole_units(w: Work) -> tuple[list[str], str, str]:
    """30 x 30 latents: the pyramid's 3 stages of 2x2 patches need multiples of 8."""
    return pyramid_rows(w, (3, 2, 30, 30)), "data", "not made of whole"


def vae_clips_it_cannot_encode(w: Work) -> tuple[list[str], str, str]:
    """Images that decode to 40 x 30 (a bucket set after the config's checks, as a hostile config
    would), which the VAE's 4x spatial factor cannot encode (a valid config's buckets always fit)."""
    (w.dir / "wide.jpg").write_bytes(image_bytes(80, 60, 1))
    rows = write_jsonl(w.dir / "images.jsonl", [{"image": str(w.dir / "wide.jpg")}] * 3)
    return (["--video_csv_paths", "[]", "--annotation_paths", f"[{rows}]"], "clips",
            "height and width must be multiples of 4")


def wan_latents_of_another_vae(w: Work) -> tuple[list[str], str, str]:
    """Wan's precomputed rows (latent_path CSV, as `pan data precompute` writes them) whose latents have
    6 channels (a Wan 2.2 VAE's z_dim, here): the tiny Wan 2.1 folder's transformer takes its VAE's 4."""
    root = w.dir / "latents"
    root.mkdir(parents=True)
    channels, frames, height, width = w.wan.geometry["latent"]
    text_dim = json.loads((w.wan.model / "transformer/config.json").read_text())["text_dim"]
    rows = []
    for i in range(4):
        save_file({"latent": randn(channels + 2, frames, height, width, seed=i),
                   "text": randn(6, text_dim, seed=100 + i)}, str(root / f"clip{i}.safetensors"))
        rows.append([f"clip{i}.safetensors", f"a clip of another VAE {i}"])
    with open(root / "latents.csv", "w", newline="") as f:
        csv.writer(f).writerows([["latent_path", "caption"], *rows])
    return (["--video_csv_paths", str(root / "latents.csv")], "data",
            f"its latent has {channels + 2} channels, the Wan transformer takes {channels}")


# The config as loaded, changed after the loader's checks (a key the loader refuses otherwise).
HOSTILE: dict[str, Callable] = {
    "causal_vae": lambda job: dataclasses.replace(job, data=dataclasses.replace(job.data,
                                                                                resolution_buckets=["40x30"])),
}

CASES = {"pan": pan_latents_of_another_vae, "pyramid_flow": pyramid_latents_of_another_vae,
         "pyramid_flow_ar": ar_latents_without_whole_units, "causal_vae": vae_clips_it_cannot_encode,
         "wan": wan_latents_of_another_vae}

# Recipes whose `pan check` reads no rows, and why; `still_true` says the reason still holds.
NO_ROWS: dict[str, tuple[str, Callable[[], bool]]] = {
    "toy_gan": ("its data is made from a seed in the task (real_sample(i)): there are no rows, and its task "
                "declares no sample_fit", lambda: not hasattr(resolve(get_recipe("toy_gan").task), "sample_fit")),
}


def test_every_recipe_has_an_unfit_case_or_a_reason():
    names = recipe_names()
    assert "toy_gan" in names, "the plugin tests/plugins/pan_toy_gan is not installed"
    missing = [n for n in names if n not in CASES and n not in NO_ROWS]
    assert not missing, f"recipes with no unfit-row case and no reason their check reads no rows: {missing}"
    stale = [n for n, (why, still_true) in NO_ROWS.items() if n in names and not still_true()]
    assert not stale, f"recipes whose reason for reading no rows no longer holds (add a case): {stale}"


@pytest.mark.parametrize("recipe", sorted(CASES))
def test_the_data_check_reads_rows_with_the_models_fit(recipe, tmp_path, clips_csv, capsys, request, monkeypatch):
    pyramid = request.getfixturevalue("pyramid_release") if recipe.startswith("pyramid_flow") else None
    wan = request.getfixturevalue("wan_release") if recipe == "wan" else None
    work = Work(tmp_path, clips_csv, pyramid, wan)
    extra, row, says = CASES[recipe](work)
    argv = BASES[recipe](work) + extra
    if recipe in HOSTILE:
        job = HOSTILE[recipe](load_job_config(argv, warn=lambda m: None))
        monkeypatch.setattr(check_command, "load_job_config", lambda *a, **k: job)

    code, out, _ = pan_cli(["check", *argv, "--json"], capsys)
    report = json.loads(out)
    data = [r for r in report["rows"] if r["check"] == row]
    assert data and all(r["status"] == "fail" for r in data), json.dumps(data, indent=1)
    assert any("unfit" in r["detail"] and says in r["detail"] for r in data), json.dumps(data, indent=1)
    assert all(r["fix"] for r in data)
    assert code == 1 and report["exit_code"] == 1

    if recipe in ("pan", "wan"):
        # train.py's entry runs what `pan check` fails before the lease, config.yaml or the model.
        code, _, err = pan_cli(["train", *argv, *IN_PROCESS], capsys)
        assert code == 2, err[-3000:]
        assert "Traceback" not in err and says in err, err[-3000:]
        assert "no usable sample" not in err
        nothing_built(work.out)
        assert not work.out.exists() or not any(work.out.iterdir()), sorted(p.name for p in work.out.iterdir())
