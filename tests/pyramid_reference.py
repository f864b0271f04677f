"""The Pyramid-Flow reference fixtures (made by running the original implementation on CPU).

They live in the project's shared folder beside the repository (`../shared/reference/pyramid_flow`,
see its README for how each call was made); tests that read them are skipped where it is absent.
"""

from __future__ import annotations

import json
import lzma
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "pyramid_flow"

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
