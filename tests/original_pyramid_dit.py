"""Load a released Pyramid-Flow miniFLUX folder with the ORIGINAL implementation, in its own process.

    python tests/original_pyramid_dit.py ORIGINAL DEPS MODEL_PATH VARIANT OUT [CASE.safetensors ...]

ORIGINAL is the extract of the original's source (`import_stubs.py`, `src/`), DEPS the folder with
its own dependencies (einops, timm, accelerate: `make test` installs them into the venv's
`original-deps`). Never imported by the tests: the original's import stubs (torchvision, IPython,
tensorboardX) must not touch a test process's modules, so tests/test_lora_export.py runs this.

It writes OUT (safetensors):
- `state.<key>`: the state dict of the DiT its runner `PyramidDiTForVideoGeneration` builds from
  `MODEL_PATH/VARIANT` (the released-folder loader: `build_pyramid_dit`, fp32, no text encoders or
  VAE);
- `<case>.out.col<c>`: for each fixture CASE (the reference's flux_dit/case_*.safetensors), the
  original's forward on its inputs, called as the fixture was made (train mode, no grad), with the
  folder loaded as those fixtures were: `PyramidFluxTransformer.from_pretrained(folder, fp32, ...)`
  keeping the config's RoPE axes (the runner forces [16, 24, 24], which fits only 64-dim heads:
  quirk F2 of the reference README).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    original, deps, model_path, variant, out, *cases = argv
    for path in (str(Path(original) / "src"), original, deps):
        sys.path.insert(0, path)
    import import_stubs

    import_stubs.install()
    import torch
    from pyramid_dit import PyramidDiTForVideoGeneration
    from pyramid_dit.flux_modules import PyramidFluxTransformer
    from safetensors.torch import load_file, save_file

    runner = PyramidDiTForVideoGeneration(
        model_path, model_dtype="fp32", model_name="pyramid_flux", model_variant=variant,
        use_mixed_training=False, use_flash_attn=False, load_text_encoder=False, load_vae=False)
    tensors = {f"state.{k}": v.detach().clone() for k, v in runner.dit.state_dict().items()}

    model = PyramidFluxTransformer.from_pretrained(
        os.path.join(model_path, variant), torch_dtype=torch.float32, use_flash_attn=False,
        use_temporal_causal=True, interp_condition_pos=True).train()
    for case in map(Path, cases):
        t = load_file(str(case))
        columns = sorted({int(k.split(".col")[1].split(".")[0]) for k in t if k.startswith("in.sample.")})
        sample = [[t[k] for k in sorted((k for k in t if k.startswith(f"in.sample.col{c}.")),
                                        key=lambda k: int(k.rsplit("clip", 1)[1]))]
                  for c in columns]
        with torch.no_grad():
            outs = model(sample=sample, encoder_hidden_states=t["in.encoder_hidden_states"],
                         encoder_attention_mask=t["in.encoder_attention_mask"],
                         pooled_projections=t["in.pooled_projections"], timestep_ratio=t["in.timestep_ratio"])
        name = case.name.removesuffix(".safetensors")
        tensors |= {f"{name}.out.col{c}": o.contiguous() for c, o in zip(columns, outs)}
    save_file(tensors, out)


if __name__ == "__main__":
    main(sys.argv[1:])
