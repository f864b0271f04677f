"""`pan export CKPT --format wan_diffusers --out DIR`: a Wan run's checkpoint as diffusers transformer folders;
`--format wan_lora`: a LoRA run's adapters as diffusers' `pipe.load_lora_weights` reads them.

Every trained expert of the checkpoint is written as the run's Wan folder names it (`DIR/transformer`,
and `DIR/transformer_2` for A14B's low-noise expert): config.json (the folder's architecture) and the
weights as trained (fp32; a LoRA checkpoint with --merge: its base with the adapters merged in), which
`WanTransformer3DModel.from_pretrained` loads. Copy them over a copy of the Wan folder (or point
WanPipeline's `transformer=` at them) to sample with diffusers.

A LoRA run's adapters (`export_lora`) go to `DIR/<expert>/pytorch_lora_weights.safetensors`, diffusers'
own LoRA layout for a Wan pipeline: keys `transformer.<module>.lora_A.weight` / `.lora_B.weight`, the
modules named as diffusers names them (pan's are the same names). diffusers gives adapters without
metadata alpha = rank (scale 1), so the run's scale alpha / rank is multiplied into each B: the
adapters then add scale * B @ A, what they add in pan. Load them with

    pipe.load_lora_weights("DIR/transformer")                                  # the (high-noise) expert
    pipe.load_lora_weights("DIR/transformer_2", load_into_transformer_2=True)  # A14B's low-noise expert
"""

from __future__ import annotations

from pathlib import Path

import torch

from pan.checkpoint import layout
from pan.export import adapter_format
from pan.lora.adapters import adapter_pairs
from pan.lora.files import read_adapters, scale_of
from pan.lora.runs import part_weights, run_job
from pan.recipes.wan.model import WanTransformer
from pan.recipes.wan.weights import check_weights, load_config, save_transformer


def export_diffusers(checkpoint_dir: Path, out: Path, *, ema: bool = False) -> Path:
    """Diffusers transformer folders (DIR/transformer, DIR/transformer_2) of every trained expert, which
    WanTransformer3DModel.from_pretrained loads. Returns `out`."""
    checkpoint_dir, out = Path(checkpoint_dir), Path(out)
    problem = layout.verify_checkpoint(checkpoint_dir)
    if problem is not None:
        raise ValueError(f"{checkpoint_dir} is not a readable checkpoint: {problem}")
    folder = run_job(checkpoint_dir).model.folder()
    for part in layout.saved_parts(checkpoint_dir):
        state = part_weights(checkpoint_dir, part, ema)
        with torch.device("meta"):
            model = WanTransformer(load_config(folder.expert_dir(part)))
        check_weights(model, state, checkpoint_dir / part)
        model.load_state_dict(state, strict=True, assign=True)
        save_transformer(model, out / part)
    return out


DIFFUSERS_LORA_WEIGHTS = "pytorch_lora_weights.safetensors"   # diffusers' LORA_WEIGHT_NAME_SAFE
DIFFUSERS_LORA_PREFIX = "transformer"                          # WanLoraLoaderMixin.transformer_name


@adapter_format   # `pan export --format wan_lora` takes a LoRA checkpoint without --merge
def export_lora(checkpoint_dir: Path, out: Path, *, ema: bool = False) -> Path:
    """A LoRA run's adapters, not merged, in diffusers' LoRA layout (DIR/transformer[_2]/
    pytorch_lora_weights.safetensors), which WanPipeline's load_lora_weights loads. Returns `out`."""
    from safetensors.torch import save_file

    checkpoint_dir, out = Path(checkpoint_dir), Path(out)
    problem = layout.verify_checkpoint(checkpoint_dir)
    if problem is not None:
        raise ValueError(f"{checkpoint_dir} is not a readable checkpoint: {problem}")
    parts = layout.saved_parts(checkpoint_dir)
    references = {part: layout.lora_reference(checkpoint_dir, part)[1] for part in parts}
    if not any(references.values()):
        raise ValueError(f"{checkpoint_dir} holds no LoRA adapters: --format wan_lora is for a LoRA run's "
                         "checkpoint (export whole weights with --format wan_diffusers)")
    for part, reference in references.items():
        if reference is None:
            continue
        if reference.get("init") == "pissa":
            raise ValueError("the adapters were trained with lora_init: pissa, on the base minus its top singular "
                             "directions, so adapters over the released base would be wrong: use --merge with "
                             "--format wan_diffusers (the whole merged model)")
        scale = scale_of(reference)
        state = {}
        for module, (a, b) in adapter_pairs(read_adapters(checkpoint_dir, part, ema)).items():
            name = f"{DIFFUSERS_LORA_PREFIX}.{module}"
            state[f"{name}.lora_A.weight"] = a.float().contiguous()
            state[f"{name}.lora_B.weight"] = (scale * b.float()).contiguous()
        folder = out / part
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / (DIFFUSERS_LORA_WEIGHTS + ".tmp")
        save_file(state, str(tmp), metadata={"format": "pt", "source": str(checkpoint_dir), "part": part,
                                             "ema": str(ema), "scale_in_lora_B": str(scale)})
        tmp.replace(folder / DIFFUSERS_LORA_WEIGHTS)
    return out
