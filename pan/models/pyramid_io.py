"""Read and write the released Pyramid-Flow DiT folders, as they are.

A released DiT (`diffusion_transformer_384p`, `..._768p`, `..._image`) is a diffusers
`save_pretrained` folder: `config.json` (the constructor's keys plus `_class_name` and
`_diffusers_version`) and `diffusion_pytorch_model.safetensors` (or shards listed in
`diffusion_pytorch_model.safetensors.index.json`). pan's Pyramid models use the checkpoint's key
names, so loading and exporting are the identity on the state dict: no conversion step.

    model = load_pretrained("…/diffusion_transformer_384p", PyramidFluxTransformer)
    save_pretrained(model, "out/diffusion_transformer_384p")

Every config value is read and honoured, or refused with a message naming the key (the original's
loader silently overrides some of them: quirk F2). Weights load strictly: missing, unexpected or
mis-shaped tensors are all listed in one error.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from pan.config.core import ConfigError, ConfigErrors
from pan.config.loader import build_dataclass, unknown_key_message
from pan.models.state_dict import ShapeDiff

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
# diffusers' stand-in when it is not installed (the version the released folders were written with
# is only informative: diffusers reads any)
FALLBACK_DIFFUSERS_VERSION = "0.30.3"


def load_config(folder: str | Path, cls: type[nn.Module]):
    """config.json of a released folder -> `cls.config_class`, every key checked.

    Keys starting with `_` are diffusers metadata (`_class_name` must name `cls`'s released class);
    keys missing from the file take the defaults (as diffusers does). Unknown keys, wrong types,
    out-of-range and unsupported values raise ConfigError (several at once as ConfigErrors), with
    the file as the error's location.
    """
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a released DiT folder holds {CONFIG_NAME} and "
                                f"{WEIGHTS_NAME}.")
    raw = json.loads(path.read_text())
    try:
        return _config_from_dict(raw, cls)
    except ConfigErrors as e:
        for err in e.errors:
            err.location = str(path)
        e.location = str(path)
        raise
    except ConfigError as e:
        e.location = str(path)
        raise


def _config_from_dict(raw: dict, cls: type[nn.Module]):
    name = raw.get("_class_name", cls.RELEASED_CLASS_NAME)
    if name != cls.RELEASED_CLASS_NAME:
        raise ConfigError("_class_name", f"the folder holds a {name}, not a {cls.RELEASED_CLASS_NAME}: load it "
                                         f"with the pan model of that class.")
    config_cls = cls.config_class
    known = [f.name for f in dataclasses.fields(config_cls)]
    values = {k: v for k, v in raw.items() if not k.startswith("_")}
    unknown = [k for k in values if k not in known]
    if unknown:
        raise ConfigErrors([ConfigError(k, unknown_key_message(k, known, cls.RELEASED_CLASS_NAME)
                                        .replace(" See docs/config.md for every key.",
                                                 f" Known keys: {', '.join(sorted(known))}."))
                            for k in unknown])
    config = build_dataclass(config_cls, values)
    config.check()
    return config


def config_dict(model: nn.Module) -> dict:
    """The config.json content of `model`: its config's keys and the diffusers metadata."""
    try:
        import diffusers
        version = diffusers.__version__
    except ImportError:
        version = FALLBACK_DIFFUSERS_VERSION
    return {"_class_name": model.RELEASED_CLASS_NAME, "_diffusers_version": version,
            **dataclasses.asdict(model.config)}


def weight_files(folder: str | Path) -> list[Path]:
    """The folder's safetensors file, or the shard files its index lists (whether they exist or not);
    FileNotFoundError when it holds neither, ValueError (or KeyError, TypeError) for an unreadable index."""
    folder = Path(folder)
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    if (folder / WEIGHTS_INDEX_NAME).is_file():
        shards = json.loads((folder / WEIGHTS_INDEX_NAME).read_text())["weight_map"].values()
        return [folder / shard for shard in sorted(set(shards))]
    raise FileNotFoundError(f"{folder} holds neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME} (pan reads "
                            "safetensors only; convert a .bin checkpoint with diffusers first).")


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors file (or of the shards its index lists)."""
    state = {}
    for path in weight_files(folder):
        state.update(load_file(str(path)))
    return state


def check_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Raise ValueError listing every missing, unexpected and mis-shaped tensor, if any."""
    diff = ShapeDiff.of_tensors(state, model)
    shapes = sorted(f"{k}: file {a}, model {b}" for k, a, b in diff.mismatched)
    problems = [f"{label} ({len(items)}): {', '.join(items)}"
                for label, items in (("missing", sorted(diff.missing)), ("unexpected", sorted(diff.unexpected)),
                                     ("shape mismatch", shapes)) if items]
    if problems:
        raise ValueError(f"the weights do not fit {type(model).__name__} built from config.json: "
                         + "; ".join(problems))


def load_pretrained(folder: str | Path, cls: type[nn.Module], device: str | torch.device = "cpu") -> nn.Module:
    """The model of a released folder, its tensors exactly as stored (dtype included) on `device`.

    Built on the meta device, then every parameter and buffer is taken from the file (strictly).
    """
    config = load_config(folder, cls)
    state = read_weights(folder)
    with torch.device("meta"):
        model = cls(config)
    check_state_dict(model, state)
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=True, assign=True)
    return model


def save_pretrained(model: nn.Module, folder: str | Path) -> None:
    """Write `model` as a released folder: config.json (sorted keys, as diffusers writes it) and the
    state dict as safetensors. Each file is written beside and then renamed into place.

    `model` holds whole tensors in one process (gather an FSDP-sharded model first).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in model.state_dict().items():
        if type(tensor) is not torch.Tensor:
            raise ValueError(f"{name} is a {type(tensor).__name__}: gather the full state dict (e.g. with "
                             "`pan export`) before writing a released folder.")
        state[name] = tensor.detach().to("cpu").contiguous()
    _write_atomic(folder / CONFIG_NAME,
                  lambda p: p.write_text(json.dumps(config_dict(model), indent=2, sort_keys=True) + "\n"))
    _write_atomic(folder / WEIGHTS_NAME, lambda p: save_file(state, str(p), metadata={"format": "pt"}))


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)
