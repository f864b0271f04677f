"""A LoRA checkpoint's adapters as files: read from the checkpoint, written in peft's layout, and
read back from a peft folder or another run (`pan sample --lora`).

A LoRA run's checkpoint holds the adapters only (`transformer/`, and `ema/` with an EMA: pan's names
`<module>.lora_A.default.weight`); its meta.json records, per LoRA part, the reference the trainer
returned (`pan.lora.adapters.add_adapters`: rank, alpha, targets, base source and fingerprint). The base they
merge into is rebuilt in pan/lora/runs.py.

    pan export CKPT --format peft --out folder       write_peft(): adapter_config.json + adapters
    pan sample --checkpoint BASE --lora PATH         apply_lora(): PATH a peft folder or a LoRA run
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from torch import Tensor

from pan.checkpoint import layout
from pan.checkpoint.layout import checkpoint_folder, lora_reference
from pan.checkpoint.consolidate import consolidated_weights, part_source
from pan.lora.adapters import LORA_KEY, adapter_pairs, from_peft_names, merged_state, peft_names, state_fingerprint

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def read_adapters(ckpt_dir: Path, part: str, ema: bool) -> dict[str, Tensor]:
    """The adapters (or their EMA) of a LoRA part of a checkpoint-N/, pan's names, fp32 as saved."""
    _, source = part_source(Path(ckpt_dir), part, ema)
    adapters = consolidated_weights(source)
    others = [k for k in adapters if not LORA_KEY.search(k)]
    if others:
        raise ValueError(f"{source} holds more than LoRA adapters (e.g. {others[0]}): not a LoRA checkpoint")
    return adapters


def scale_of(reference: dict) -> float:
    return reference["alpha"] / reference["rank"]


# ------------------------------------------------------------------------------------------------
# peft's layout
# ------------------------------------------------------------------------------------------------

def write_peft(ckpt_dir: Path, out_dir: Path, part: str | None = None, ema: bool = False) -> Path:
    """Write a LoRA checkpoint's adapters as `peft.PeftModel.from_pretrained` loads them onto the
    same model class with the base's weights: adapter_config.json (r, lora_alpha, the full module
    names as target_modules, lora_dropout, the base source as base_model_name_or_path) and
    adapter_model.safetensors (peft's names). Returns the folder."""
    from peft import LoraConfig as PeftLoraConfig
    from safetensors.torch import save_file

    ckpt_dir, own_part, own_ema = checkpoint_folder(ckpt_dir)
    ema = ema or bool(own_ema)
    part, reference = lora_reference(ckpt_dir, part or own_part)
    if reference is None:
        raise ValueError(f"{ckpt_dir} holds no LoRA adapters of {part}: --format peft is for a LoRA "
                         "run's checkpoint (export a full one as safetensors)")
    if reference.get("init") == "pissa":
        raise ValueError("the adapters were trained with lora_init: pissa, on the base minus its top "
                         "singular directions, so peft's adapters over the original base would be wrong: "
                         "use --merge (the whole merged model)")
    adapters = read_adapters(ckpt_dir, part, ema)
    config = PeftLoraConfig(r=reference["rank"], lora_alpha=reference["alpha"],
                            lora_dropout=reference["dropout"], target_modules=list(reference["targets"]),
                            bias="none", base_model_name_or_path=reference["base_source"])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    tmp = out_dir / (PEFT_WEIGHTS + ".tmp")
    save_file({k: v.contiguous() for k, v in peft_names(adapters).items()}, str(tmp),
              metadata={"format": "pt", "source": str(ckpt_dir), "part": part, "ema": str(ema),
                        "base_fingerprint": str(reference.get("base_fingerprint"))})
    tmp.replace(out_dir / PEFT_WEIGHTS)
    return out_dir


def read_peft(folder: Path) -> tuple[dict[str, Tensor], float, str | None]:
    """(adapters under pan's names, scale, the base fingerprint if pan wrote it) of a peft folder."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    config = json.loads((folder / PEFT_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder / PEFT_CONFIG} is a {config.get('peft_type')} adapter, not LoRA")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{folder / PEFT_CONFIG} has per-module ranks or alphas (rank_pattern / "
                         "alpha_pattern), which pan does not merge")
    rank, alpha = config["r"], config.get("lora_alpha", config["r"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = folder / PEFT_WEIGHTS
    with safe_open(str(weights), framework="pt") as f:
        fingerprint = (f.metadata() or {}).get("base_fingerprint")
    return from_peft_names(load_file(str(weights))), scale, fingerprint


def lora_source(path: Path, ema: bool) -> tuple[dict[str, Tensor], float, str | None]:
    """(adapters, scale, base fingerprint) of `--lora PATH`: a peft folder (`pan export --format
    peft`, or peft's own save_pretrained), or a LoRA run's checkpoint-N/ or output_dir (its latest
    complete checkpoint; `ema`: the adapters' EMA)."""
    path = Path(path)
    if (path / PEFT_CONFIG).is_file():
        return read_peft(path)
    if not (path / layout.META).is_file():
        done = layout.complete_checkpoints(path) if path.is_dir() else []
        if not done:
            raise ValueError(f"--lora {path} is neither a peft folder ({PEFT_CONFIG}) nor a LoRA run's "
                             "checkpoint")
        path = done[-1]
    ckpt_dir, own_part, own_ema = checkpoint_folder(path)
    part, reference = lora_reference(ckpt_dir, own_part)
    if reference is None:
        raise ValueError(f"--lora {path}: {ckpt_dir} holds no LoRA adapters (a full fine-tuning checkpoint)")
    return read_adapters(ckpt_dir, part, ema or bool(own_ema)), scale_of(reference), reference.get("base_fingerprint")


def apply_lora(weights: dict[str, Tensor], path: Path, ema: bool = False) -> dict[str, Tensor]:
    """`weights` (a base under the plain model's names) with the adapters of `--lora PATH` merged in
    (in fp32, each weight back in its dtype). Warns when the adapters say they were trained on
    another base."""
    adapters, scale, fingerprint = lora_source(path, ema)
    missing = sorted({f"{module}.weight" for module in adapter_pairs(adapters)} - set(weights))
    if missing:
        raise ValueError(f"--lora {path}: the base has no {missing[0]} (and {len(missing) - 1} more "
                         "adapted weights): adapters of another model")
    if fingerprint and fingerprint != "None" and state_fingerprint(weights) != fingerprint:
        print(f"pan sample: warning: the adapters of {path} were trained on another base (fingerprint "
              f"{fingerprint}, this base {state_fingerprint(weights)}); applying them anyway",
              file=sys.stderr)
    return merged_state(weights, adapters, scale)
