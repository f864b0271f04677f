"""`pan export CKPT --format wan_diffusers --out DIR`: a Wan run's checkpoint as diffusers transformer folders.

Every trained expert of the checkpoint is written as the run's Wan folder names it (`DIR/transformer`,
and `DIR/transformer_2` for A14B's low-noise expert): config.json (the folder's architecture) and the
weights as trained (fp32; a LoRA checkpoint with --merge: its base with the adapters merged in), which
`WanTransformer3DModel.from_pretrained` loads. Copy them over a copy of the Wan folder (or point
WanPipeline's `transformer=` at them) to sample with diffusers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pan.checkpoint import layout
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
