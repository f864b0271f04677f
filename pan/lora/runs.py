"""A LoRA part's base, as the trainer builds it and as export and sampling rebuild it.

A LoRA checkpoint holds the adapters only; its meta.json records each LoRA part's reference
(`pan.lora.adapters.add_adapters`: rank, alpha, targets, base source and fingerprint). The trainer loads the
base on every launch (`base_with_adapters`); `pan export --merge` and `pan sample` rebuild it from the
run's config.yaml beside its checkpoints with that same function, check its fingerprint against the
recorded one (adapters only mean something on the base they were trained on), then load the adapters
(`lora_model`) or merge them (`merged_weights`: W + scale * B @ A).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from pan.checkpoint import layout
from pan.lora.files import read_adapters, scale_of
from pan.checkpoint.layout import checkpoint_folder, is_lora_checkpoint, lora_reference
from pan.checkpoint.consolidate import consolidated_weights, part_source
from pan.checkpoint.warm_start import plan_warm_start
from pan.config import ConfigError, load_job_config
from pan.logging import get_logger
from pan.lora.adapters import LORA_KEY, add_adapters, base_names, merged_state, reference_differences
from pan.parallel.dims import ParallelDims
from pan.parallel.fsdp import FULL_INIT_MAX_PARAMS, materialize_and_init
from pan.parallel.world import ONE_PROCESS, planned_task


def base_with_adapters(model, spec, cfg, base) -> dict:
    """A LoRA part before sharding: its frozen base loaded (from the warm-start source `base`, else
    its pretrained weights, else its init from the seed), on every launch, resumes included (a
    checkpoint holds the adapters only); then the adapters injected. Returns the LoRA reference."""
    log = get_logger()
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError("lora_rank", f"LoRA loads the base of {spec.name} whole before sharding, which "
                          f"pan does for models of up to {FULL_INIT_MAX_PARAMS / 1e9:g}B parameters; this "
                          "one is larger. Train it fully (lora_rank: 0).")
    if base is not None and spec.warm_start:
        base.before_sharding(model)
        base.after_sharding(model, spec.name)  # a checkpoint source: DCP reads into the whole model
        source = str(base.path)
    elif spec.pretrained is not None:
        model.load_state_dict(spec.pretrained(), strict=True)
        source = spec.pretrained_from or "pretrained"
    else:
        source = f"init (seed {cfg.seed})"
    reference = add_adapters(model, spec.lora, cfg.seed, cfg.dtype, source)
    log.info("%s: LoRA rank %d (alpha %g) on %d linears of the frozen base from %s (fingerprint %s)",
             spec.name, reference["rank"], reference["alpha"], len(reference["targets"]), source,
             reference["base_fingerprint"])
    return reference



def run_job(ckpt_dir: Path):
    """The job config of the run that wrote `ckpt_dir` (its output_dir's config.yaml)."""
    config = Path(ckpt_dir).parent / "config.yaml"
    if not config.is_file():
        raise ValueError(f"{config} not found: the base of a LoRA checkpoint is rebuilt from the run's "
                         "config.yaml beside its checkpoints.")
    try:
        return load_job_config(["--config", str(config)], warn=lambda msg: None, use_only=True)
    except ConfigError as e:
        raise ValueError(f"the run's {config} does not load here, and the base of its LoRA checkpoint is "
                         f"rebuilt from it (relative paths in it are read from the current directory: "
                         f"run this where the run was launched): {e}") from e


def run_dims(meta: dict | None):
    """The parallel layout a checkpoint's meta.json records (the run's task is planned as its rank 0
    planned it: e.g. Pyramid-Flow AR's video sync groups need the run's ranks); one process when
    it records none."""
    keys = ("world_size", "cp_size", "dp_replicate", "dp_shard")
    if not meta or any(k not in meta for k in keys):
        return ONE_PROCESS
    return ParallelDims(world_size=meta["world_size"], local_world_size=meta["world_size"], cp=meta["cp_size"],
                        dp_replicate=meta["dp_replicate"], dp_shard=meta["dp_shard"])


def rebuild_base(job, part: str, meta: dict | None = None) -> tuple[nn.Module, dict]:
    """The part's model on the CPU as the trainer builds a LoRA part (pan.trainer.build_part before
    sharding): its init from the run's seed, its base loaded (warm-start source, else pretrained
    weights), adapters injected (freshly initialised). `meta`: the checkpoint's meta.json (the
    run's layout). Returns the model and the rebuilt reference."""
    task = planned_task(job, run_dims(meta))
    specs = {spec.name: spec for spec in task.part_specs()}
    spec = specs.get(part)
    if spec is None or spec.lora is None:
        raise ValueError(f"the run's config.yaml trains no LoRA adapters on {part} (parts: {list(specs)})")
    cfg = job.trainer
    model = materialize_and_init(spec.build(), torch.device("cpu"), cfg.seed, None)
    base = plan_warm_start(task.warm_start_source(), None)
    reference = base_with_adapters(model, spec, cfg, base)
    return model, reference


def lora_model(ckpt_dir: Path, part: str | None = None, ema: bool = False) -> tuple[nn.Module, dict]:
    """A LoRA checkpoint's part as pan's model: its base rebuilt (and checked against the recorded
    fingerprint) with the checkpoint's adapters (or their EMA) loaded. Returns (model, reference)."""
    ckpt_dir, own_part, own_ema = checkpoint_folder(ckpt_dir)
    ema = ema or bool(own_ema)
    part, reference = lora_reference(ckpt_dir, part or own_part)
    if reference is None:
        raise ValueError(f"{ckpt_dir} holds no LoRA adapters of {part}: it is a full fine-tuning checkpoint")
    model, rebuilt = rebuild_base(run_job(ckpt_dir), part, layout.read_json(ckpt_dir / layout.META))
    differences = reference_differences(reference, rebuilt)
    if differences:
        raise ValueError(f"the base rebuilt from the run's config.yaml is not the one the adapters of "
                         f"{ckpt_dir} were trained on: {'; '.join(differences)}")
    adapters = read_adapters(ckpt_dir, part, ema)
    wanted = {k for k in model.state_dict() if LORA_KEY.search(k)}
    if set(adapters) != wanted:
        raise ValueError(f"{ckpt_dir}: its adapters ({len(adapters)} tensors) are not the {len(wanted)} "
                         "the rebuilt model has")
    model.load_state_dict(adapters, strict=False)
    return model, reference


def merged_weights(ckpt_dir: Path, part: str | None = None, ema: bool = False) -> dict[str, Tensor]:
    """A LoRA checkpoint's part merged: the base's state dict under the plain model's names, every
    adapted weight W + scale * B @ A (computed in fp32; the whole state in fp32: a bf16 base is
    upcast exactly)."""
    model, reference = lora_model(ckpt_dir, part, ema)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    adapters = {k: v for k, v in state.items() if LORA_KEY.search(k)}
    base = {k: v.float() if v.is_floating_point() else v for k, v in base_names(state).items()}
    return merged_state(base, adapters, scale_of(reference))


def part_weights(ckpt_dir: Path, part: str | None, ema: bool) -> dict[str, Tensor]:
    """A checkpoint part's whole weights under the model's names: as saved for a fully trained part,
    merged for a LoRA part (a recipe's export format writes a whole model)."""
    if is_lora_checkpoint(ckpt_dir, part):
        return merged_weights(ckpt_dir, part, ema)
    return consolidated_weights(part_source(Path(ckpt_dir), part, ema)[1])
