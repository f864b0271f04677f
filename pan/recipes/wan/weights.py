"""Read and write diffusers' Wan `transformer/` folders (and A14B's `transformer_2/`), as they are.

A folder is what `WanTransformer3DModel.save_pretrained` writes: `config.json` (the constructor's keys
plus diffusers' stamps) and `diffusion_pytorch_model.safetensors`, or shards listed in
`diffusion_pytorch_model.safetensors.index.json`. `WanTransformer`'s parameter names are the
folder's keys, so loading and writing are the identity on the state dict:

    model = load_transformer("Wan2.1-T2V-14B-Diffusers/transformer")
    save_transformer(model, "out/transformer")          # WanTransformer3DModel.from_pretrained reads it

config.json is read strictly: every key of `WanConfig` is checked, a key it does not know is refused
(only diffusers' stamps `_class_name`, which must name WanTransformer3DModel, `_diffusers_version` and
`_name_or_path`, which diffusers adds when it re-saves a loaded model, are not config). The weights
load strictly: every missing, unknown and mis-shaped tensor is named in one error. The one exception
is diffusers' own: `blocks.<i>.attn2.norm_added_q.weight`, which I2V folders written by diffusers
before its Wan attention rewrite hold and no forward reads, is dropped, as `from_pretrained` drops it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from pan.config.core import ConfigError, ConfigErrors
from pan.config.loader import build_dataclass, unknown_key_message
from pan.models.pyramid_io import CONFIG_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME, read_weights
from pan.models.state_dict import ShapeDiff
from pan.recipes.wan.model import WanConfig, WanTransformer

CLASS_NAME = "WanTransformer3DModel"
STAMPS = ("_class_name", "_diffusers_version", "_name_or_path")
# Unused tensors that diffusers' loader drops (its `_keys_to_ignore_on_load_unexpected`)
IGNORED_KEYS = re.compile(r"blocks\.\d+\.attn2\.norm_added_q\.weight")
# diffusers' default shard size (`save_pretrained(max_shard_size="10GB")`)
MAX_SHARD_BYTES = 10 * 10**9
# the diffusers version written into config.json when diffusers is not installed (it reads any)
FALLBACK_DIFFUSERS_VERSION = "0.35.0"


def load_config(folder: str | Path) -> WanConfig:
    """config.json of a folder -> WanConfig, every key checked (ConfigError naming the file and key)."""
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a Wan transformer folder holds {CONFIG_NAME} and its "
                                f"safetensors weights.")
    try:
        return config_from_dict(json.loads(path.read_text()))
    except ConfigError as e:
        for err in e.problems():
            err.location = str(path)
        e.location = str(path)
        raise


def config_from_dict(raw: dict) -> WanConfig:
    name = raw.get("_class_name", CLASS_NAME)
    if name != CLASS_NAME:
        raise ConfigError("_class_name", f"the folder holds a {name}, not a {CLASS_NAME}.")
    known = [f.name for f in dataclasses.fields(WanConfig)]
    unknown = [k for k in raw if k not in known and k not in STAMPS]
    if unknown:
        raise ConfigErrors([ConfigError(k, unknown_key_message(k, known, CLASS_NAME).replace(
            " See docs/config.md for every key.", f" Known keys: {', '.join(sorted(known))}.")) for k in unknown])
    config = build_dataclass(WanConfig, {k: v for k, v in raw.items() if k not in STAMPS})
    config.check()
    return config


def config_json(config: WanConfig) -> dict:
    """config.json's content for `config`: its keys and diffusers' stamps."""
    try:
        import diffusers
        version = diffusers.__version__
    except ImportError:
        version = FALLBACK_DIFFUSERS_VERSION
    return {"_class_name": CLASS_NAME, "_diffusers_version": version, **dataclasses.asdict(config)}


def read_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder (single file or shards), less those diffusers' loader ignores."""
    return {k: v for k, v in read_weights(folder).items() if not IGNORED_KEYS.fullmatch(k)}


def check_weights(model: WanTransformer, state: dict[str, torch.Tensor], where: str | Path) -> None:
    """Raise ValueError naming every missing, unknown and mis-shaped tensor of `state`, if any."""
    problems = ShapeDiff.of_tensors(state, model).named()
    if problems:
        raise ValueError(f"{where}: the weights do not fit the WanTransformer its config.json describes: "
                         f"{problems}")


def load_transformer(folder: str | Path, device: str | torch.device = "cpu",
                     dtype: torch.dtype | None = None) -> WanTransformer:
    """The model of a folder, its tensors as stored (or cast to `dtype`) on `device`. Built on the
    meta device, then every parameter is taken from the file, strictly."""
    config = load_config(folder)
    state = read_state_dict(folder)
    with torch.device("meta"):
        model = WanTransformer(config)
    check_weights(model, state, folder)
    state = {k: v.to(device=device, dtype=dtype or v.dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model


def save_transformer(model: WanTransformer, folder: str | Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write `model` as a diffusers folder: config.json and its state dict as safetensors, in shards of
    at most `max_shard_bytes` (and their index) when it is larger, as diffusers does. Each file is
    written beside and renamed into place; weights of the other layout left by an earlier write are
    removed (diffusers would read those). `model` holds whole tensors (gather an FSDP model first)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in model.state_dict().items():
        if type(tensor) is not torch.Tensor:
            raise ValueError(f"{name} is a {type(tensor).__name__}: gather the full state dict before writing "
                             "a folder.")
        state[name] = tensor.detach().to("cpu").contiguous()
    shards = _shards(state, max_shard_bytes)
    for old in [folder / WEIGHTS_NAME, folder / WEIGHTS_INDEX_NAME, *folder.glob("diffusion_pytorch_model-*")]:
        old.unlink(missing_ok=True)
    _write_atomic(folder / CONFIG_NAME,
                  lambda p: p.write_text(json.dumps(config_json(model.config), indent=2, sort_keys=True) + "\n"))
    if len(shards) == 1:
        _write_atomic(folder / WEIGHTS_NAME, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
        return
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_atomic(folder / file, lambda p: save_file({n: state[n] for n in names}, str(p),
                                                         metadata={"format": "pt"}))
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": sum(_nbytes(t) for t in state.values())}, "weight_map": weight_map}
    _write_atomic(folder / WEIGHTS_INDEX_NAME, lambda p: p.write_text(json.dumps(index, indent=2) + "\n"))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Tensor names in state order, cut into runs of at most `max_bytes` (a larger tensor alone)."""
    shards, size = [[]], 0
    for name, tensor in state.items():
        if shards[-1] and size + _nbytes(tensor) > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += _nbytes(tensor)
    return shards


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)
