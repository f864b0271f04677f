"""`pan export --format pyramid_flow`: a checkpoint's DiT as a released Pyramid-Flow folder (the
recipe's `exports` hook)."""

from __future__ import annotations

from pathlib import Path

from pan.lora.runs import part_weights
from pan.config import ConfigError, load_job_config
from pan.models.pyramid_io import save_pretrained
from pan.recipes.pyramid_flow.model import build_dit


def export_released(ckpt_dir: Path, out_dir: Path, *, ema: bool = False) -> Path:
    """Write a checkpoint's DiT as a released Pyramid-Flow folder (config.json + safetensors, the
    released keys) that the original's loaders and `model_path` read; a LoRA run's DiT with its
    adapters merged in (`pan export --merge`). Returns the folder."""

    config = Path(ckpt_dir).parent / "config.yaml"
    if not config.is_file():
        raise ValueError(f"{config} not found: --format pyramid_flow reads the run's config.yaml beside "
                         "its checkpoints.")
    try:
        job = load_job_config(["--config", str(config)], warn=lambda msg: None, use_only=True)
    except ConfigError as e:
        raise ValueError(f"the run's {config} does not load here: {e}") from e
    if getattr(job.model, "model_name", None) not in ("pyramid_flux", "pyramid_mmdit"):
        raise ValueError(f"{config} is not a run of a released Pyramid-Flow DiT (recipe {job.recipe}"
                         f"{', model ' + job.model.model_name if hasattr(job.model, 'model_name') else ''}): "
                         "export it as safetensors.")
    if job.flow.prediction_type != "velocity":
        raise ValueError(f"{config} trains with prediction_type {job.flow.prediction_type}: its DiT outputs x0 at "
                         "each stage's resolution, which the original's pipeline would read as the velocity. "
                         "Sample it with `pan sample`, or export it as safetensors.")
    weights = part_weights(Path(ckpt_dir), "transformer", ema)
    model = build_dit(job)
    model.to_empty(device="cpu")
    model.load_state_dict(weights, strict=True)
    save_pretrained(model, out_dir)
    return Path(out_dir)
