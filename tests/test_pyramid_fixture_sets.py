"""The fixture tests on a second fixture set: made here by the original Pyramid-Flow code
(tests/fixturegen/make_pyramid_fixtures.py, preset `second`) at other tiny sizes and another seed, in
the public set's layout, and a representative subset of the fixture tests run against it
(`PAN_PYRAMID_FIXTURES`, tests/pyramid_reference.py), so that the suite itself checks that they read
every size from the set: 3 heads (no Ulysses cp 2), other widths and layer counts, 8 latent
channels, 12 samples of 5 caption tokens, 2 and 6 latent frames, a sync group of 3, a VAE of other
widths, groups and layers, clips of 17 frames (tests/fixturegen/README.md has the table).

The generator needs the original's own dependencies (`<venv>/original-deps`) and numpy 1
(`<venv>/fixturegen-deps`), which `make test` installs. Every fixture test runs on any set with
`PAN_PYRAMID_FIXTURES=<dir> pytest ...`; `make fixtures-second` writes one and runs them all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from pyramid_reference import PUBLIC

TESTS = Path(__file__).resolve().parent
GENERATOR = TESTS / "fixturegen" / "make_pyramid_fixtures.py"
# the generator runs the original code, which lives beside the public set
needs_original = pytest.mark.skipif(not (PUBLIC / "original").is_dir(),
                                    reason="the original Pyramid-Flow code (../shared/reference) is not here")
# A representative subset (the whole of these files runs on a set in ~10 minutes here; this in ~1):
# loading and refusals, forward / loss / gradients, positions and masks, causality, FSDP2 + Ulysses on
# the cp size the heads allow, the scheduler tables and both noisings, the VAE's encode / decode and
# loss gradients, the text encoders, the AR recipe's noising and forward, the recipe on the fixture
# checkpoint and VAE.
SUBSET = [
    "test_pyramid_dit.py::test_weights_load_strictly_and_every_problem_is_listed",
    "test_pyramid_dit.py::test_unsupported_config_values_are_refused_with_the_key",
    "test_pyramid_dit.py::test_released_folder_loads_bit_identically",
    "test_pyramid_dit.py::test_forward_loss_and_gradients_match_the_original",
    "test_pyramid_dit.py::test_pack_positions_and_embedded_tokens_are_the_originals",
    "test_pyramid_dit.py::test_padded_caption_rows_are_never_attended_and_the_rule_is_the_originals_mask",
    "test_pyramid_dit.py::test_later_frames_never_change_earlier_frames",
    "test_pyramid_dit.py::test_fsdp2_and_ulysses_reproduce_the_fixture_outputs_and_gradients",
    "test_pyramid_flow_schedule.py::test_every_scheduler_table_equals_the_original",
    "test_pyramid_flow_schedule.py::test_float64_tables_differ_from_the_numpy2_float32_ones_by_one_ulp",
    "test_pyramid_flow_schedule.py::test_full_sequence_noising_equals_the_original_given_its_draws",
    "test_pyramid_flow_schedule.py::test_temporal_pyramid_noising_equals_the_original_given_its_draws",
    "test_causal_vae.py::test_released_folder_loads_bit_identically",
    "test_causal_vae.py::test_encode_decode_matches_fixture",
    "test_causal_vae.py::test_loss_gradients_match_fixture",
    "test_pyramid_text.py::test_tiny_encoders_fit_the_fixture_dits",
    "test_pyramid_flow_ar.py::test_fixture_noising_history_and_forward_through_the_recipe",
    "test_pyramid_flow_ar.py::test_causal_and_interpolation_switches_change_the_layouts_and_the_output",
    "test_pyramid_flow_recipe.py::test_the_fixture_checkpoint_trains_through_the_fixture_vae_and_exports_as_given",
]


def generator_environment() -> tuple[Path, Path]:
    """(the original's dependencies, numpy 1): the venv's folders, as `make test` installs them."""
    deps = Path(os.environ.get("PAN_ORIGINAL_DEPS") or Path(sys.prefix) / "original-deps")
    numpy1 = Path(os.environ.get("PAN_FIXTUREGEN_DEPS") or Path(sys.prefix) / "fixturegen-deps")
    missing = [str(deps / n) for n in ("einops", "timm", "accelerate") if not (deps / n).is_dir()]
    missing += [str(numpy1 / "numpy")] if not (numpy1 / "numpy").is_dir() else []
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: the generator runs the original Pyramid-Flow code, which needs "
                    "its own dependencies and numpy 1; `make test` installs them (make fixturegen-deps; "
                    "PAN_ORIGINAL_DEPS / PAN_FIXTUREGEN_DEPS name other folders)")
    return deps, numpy1


@pytest.fixture(scope="module")
def second_set(tmp_path_factory) -> Path:
    deps, numpy1 = generator_environment()
    out = tmp_path_factory.mktemp("pyramid_fixtures") / "second"
    done = subprocess.run([sys.executable, str(GENERATOR), "--preset", "second", "--quick", "--out", str(out),
                           "--deps", str(deps), "--numpy1", str(numpy1)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return out


@needs_original
def test_the_second_set_has_the_public_layout_at_other_sizes(second_set):
    """Every file of the public set but the original's code, each tensor file with its sidecar; the
    scheduler tables (independent of sizes and seed) equal the public ones; the sizes differ."""
    public = {p.relative_to(PUBLIC) for p in PUBLIC.rglob("*")
              if p.is_file() and p.relative_to(PUBLIC).parts[0] != "original"}
    made = {p.relative_to(second_set) for p in second_set.rglob("*") if p.is_file()}
    assert public <= made, sorted(map(str, public - made))
    for path in second_set.rglob("*.safetensors"):
        sidecar = path.with_suffix(".json")
        if sidecar.is_file():   # (the released folders' weights have config.json instead)
            described = json.loads(sidecar.read_text())["tensors"]
            tensors = load_file(str(path))
            assert described.keys() == tensors.keys(), path
            assert all(list(t.shape) == described[k]["shape"] for k, t in tensors.items()), path
    tables = "scheduler/scheduler_tables.json"
    assert json.loads((second_set / tables).read_text()) == json.loads((PUBLIC / tables).read_text())
    manifest = json.loads((second_set / "MANIFEST.json").read_text())
    public_manifest = json.loads((PUBLIC / "MANIFEST.json").read_text())
    assert manifest["seed"] != public_manifest["seed"]
    for model in ("flux", "mmdit"):
        ours, theirs = manifest["config"][model], public_manifest["config"][model]
        for key in ("num_attention_heads", "attention_head_dim", "in_channels", "joint_attention_dim",
                    "pooled_projection_dim"):
            assert ours[key] != theirs[key], (model, key)
    for key in ("B", "text_len", "latent_hw", "T_full", "T_ar", "video_sync_group"):
        assert manifest["config"]["data"][key] != public_manifest["config"]["data"][key], key
    assert manifest["config"]["vae"]["block_out_channels"] != public_manifest["config"]["vae"]["block_out_channels"]


@needs_original
def test_the_fixture_tests_pass_on_the_second_set(second_set):
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-x",
                           *[str(TESTS / test) for test in SUBSET]],
                          cwd=TESTS.parent, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PAN_PYRAMID_FIXTURES": str(second_set), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
