"""The Pyramid-Flow reference fixtures (made by running the original implementation on CPU).

They live in the project's shared folder beside the repository (`../shared/reference/pyramid_flow`,
see its README for how each call was made); tests that read them are skipped where it is absent.

`PAN_PYRAMID_FIXTURES=<dir>` runs the same tests against another set in that layout, made by the
original code at other tiny sizes and another seed (`tests/fixturegen/make_pyramid_fixtures.py`
writes one): every size a test uses comes from the set's JSON files and configs. A folder named there
that does not exist is an error, not a skip. The original's code (`original/`) is not part of a set:
it is taken from the set if it has one, else from the shared folder.
"""

from __future__ import annotations

import json
import lzma
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

PUBLIC = Path(__file__).resolve().parents[2] / "shared" / "reference" / "pyramid_flow"
ENV = "PAN_PYRAMID_FIXTURES"
REFERENCE = Path(os.environ[ENV]).resolve() if os.environ.get(ENV) else PUBLIC
if os.environ.get(ENV) and not (REFERENCE / "flux_dit").is_dir():
    raise RuntimeError(f"{ENV}={os.environ[ENV]} is not a Pyramid-Flow fixture set (no flux_dit/ in it)")
ORIGINAL = REFERENCE / "original" if (REFERENCE / "original").is_dir() else PUBLIC / "original"

needs_reference = pytest.mark.skipif(not REFERENCE.is_dir(),
                                     reason="the Pyramid-Flow reference fixtures are not beside the repo")


def load_fixture(relative: str) -> tuple[dict, dict]:
    """(tensors, sidecar json) of `<relative>.safetensors` / `<relative>.json`."""
    base = REFERENCE / relative
    return load_file(str(base.with_suffix(".safetensors"))), json.loads(base.with_suffix(".json").read_text())


def read_json(relative: str) -> dict:
    return json.loads((REFERENCE / relative).read_text())


def decompressed(relative: str, out_dir: Path) -> Path:
    """A `.xz` fixture decompressed into `out_dir` (the shared folder is read-only)."""
    src = REFERENCE / relative
    dst = out_dir / src.name.removesuffix(".xz")
    with lzma.open(src) as f, open(dst, "wb") as out:
        shutil.copyfileobj(f, out)
    return dst


def dit_config(name: str) -> dict:
    """The fixture DiT's config.json (`flux_dit` or `mmdit_dit`)."""
    return read_json(f"{name}/diffusion_transformer_384p/config.json")


def vae_config() -> dict:
    """The fixture causal VAE's config.json."""
    return read_json("causal_vae/causal_video_vae/config.json")


def latent_channels() -> int:
    """Latent channels of the fixture set (the VAE's; the miniFLUX takes 4x as many: a 2x2 patch)."""
    return vae_config()["encoder_out_channels"]



# Gradients against the fp32 fixtures: pan's float64 gradients, within rtol 1e-4 and an atol of
# FP32_NOISE_FACTOR x the fp32 rounding of the same call measured here (`fp32_noise`: pan's fp32
# gradients of the same inputs against its float64 ones). The fixtures' fp32 kernels (another CPU)
# sum in other orders: the public set's VAE loss gradients lie up to 4.3x that measured noise from
# float64, a set made on this machine 1.0x; the factor allows an order of magnitude.
FP32_NOISE_FACTOR = 10


def fp32_noise(fp32: dict, fp64: dict) -> float:
    """The fp32 rounding of a set of gradients: max |fp32 - float64| over all of them (the largest
    gradients, which sum the most terms, carry it), at least one fp32 ulp of the largest gradient."""
    largest = max(g.abs().max().item() for g in fp64.values())
    return max(max((fp32[k].double() - g.double()).abs().max().item() for k, g in fp64.items()),
               largest * 2.0 ** -23)


def noise_tolerance(fp32: dict, fp64: dict) -> dict:
    """assert_close keywords for float64 gradients against a fixture's fp32 ones (see above)."""
    return {"atol": FP32_NOISE_FACTOR * fp32_noise(fp32, fp64), "rtol": 1e-4}


def cp_size_for(heads: int) -> int:
    """The smallest Ulysses context-parallel size above 1 that a head count allows (it must divide
    the heads): 2 for even counts, 3 for 3 or 9 heads, the count itself when it is prime; 1 (nothing
    to split) for one head."""
    return next((n for n in range(2, heads + 1) if heads % n == 0), 1)
