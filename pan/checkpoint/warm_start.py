"""Warm start: a run's parts start from a plain state dict or from another run's checkpoint.

The recipe names the source (`Task.warm_start_source()`: Pan's `pretrained_transformer_path`, the
causal VAE's `warm_start_checkpoint`) and which parts it loads into (`PartSpec.warm_start`). Two kinds
of source:
- a plain state dict (`.pt`, `.safetensors`, or a directory holding `model_state.pt`): read whole on
  every rank and copied into the unsharded model before FSDP wrapping (`before_sharding`);
- a checkpoint written by this trainer (`checkpoint-N/`, or one part's DCP folder such as its
  `transformer/`): read through DCP after FSDP wrapping (`after_sharding`), each rank reading only
  its own shards, so it works for any world size, whatever wrote it. Each part reads its own folder
  of the checkpoint (`transformer/`, `vae/`, `discriminator/`); a part the checkpoint lacks keeps its
  init, and the log says so.

Either way only tensors whose name and shape match are copied; the report lists what was loaded,
what had another shape and what the model has that the source lacks. Optimizer, LR schedule, step
and data cursors are not touched: they start fresh. The warm start is used only while output_dir
has no checkpoint of its own (`plan_warm_start`), so a restarted SFT job resumes itself.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import torch
from safetensors import safe_open
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from pan.checkpoint import layout, reader
from pan.config.core import ConfigError, knob, require
from pan.logging import get_logger
from pan.models.state_dict import ShapeDiff
from pan.parallel.names import unwrapped_name

PLAIN_STATE_FILE = "model_state.pt"
# Prefixes that wrappers add to parameter names (torch.compile, DDP); a plain state dict saved
# from such a wrapper still matches the bare model.


@dataclass(kw_only=True)
class WarmStartConfig:
    SECTION: ClassVar[str] = "model"
    TRAINING_ONLY: ClassVar[bool] = True  # not checked where a trained model is only used (pan sample)

    pretrained_transformer_path: str | None = knob(
        None, "weights to start from while output_dir has no checkpoint: a .pt/.safetensors state "
              "dict, a directory holding model_state.pt, or a checkpoint-N/ (or its transformer/) "
              "directory of another run (a released Pyramid-Flow DiT's weights are then not loaded: "
              "model_path gives only its config.json)")
    load_transformer_weights: bool = knob(
        False, "load pretrained_transformer_path (true) or start from random init (false)")

    @property
    def source(self) -> str | None:
        """What the run warm-starts from (None: init)."""
        return self.pretrained_transformer_path if self.load_transformer_weights else None

    def check(self, job) -> None:
        require(not (self.pretrained_transformer_path and not self.load_transformer_weights),
                "pretrained_transformer_path",
                f"is set ({self.pretrained_transformer_path}) but load_transformer_weights is false, "
                "so it would be silently ignored. For a from-scratch run set "
                "pretrained_transformer_path: null; to warm start set load_transformer_weights: true.")
        require(not (self.load_transformer_weights and not self.pretrained_transformer_path),
                "load_transformer_weights",
                "is true but pretrained_transformer_path is not set: name the weights to load, or set "
                "load_transformer_weights: false.")
        if self.load_transformer_weights:
            resolve_source(self.pretrained_transformer_path)


SourceKind = Literal["state_dict", "checkpoint"]


def _holds_parts(path: Path) -> bool:
    """A checkpoint-N/ folder with at least one part's weights."""
    return (path / layout.META).is_file() and any(
        (path / layout.part_dirs(part)[0] / layout.DCP_METADATA).is_file() for part in layout.saved_parts(path))


def unreadable_state_file(path: Path) -> str | None:
    """Why a state-dict file cannot be read, from its header alone (None when it can): a
    .safetensors whose header safetensors cannot parse, or a .pt/.pth/.bin that is not the zip
    archive torch.save writes (the only kind the warm start maps tensor by tensor)."""
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as e:  # noqa: BLE001 - safetensors' own error types for a file that is not one
            return f"is not a readable .safetensors file ({e})"
        return None
    if not zipfile.is_zipfile(path):
        return "is not a file torch.save wrote (not the zip archive it writes; empty or cut short?)"
    return None


def _readable_state_file(path: str, p: Path) -> Path:
    """`p` when its header reads; else a ConfigError naming the key, what the file is, and the fix."""
    why = unreadable_state_file(p)
    if why is None:
        return p
    raise ConfigError("pretrained_transformer_path", f"{path} {why}: the warm start cannot read its tensors.",
                      fix="point pretrained_transformer_path at an intact copy of the weights (copy it again, "
                          "or write it again with `pan export <output_dir> --out model.safetensors`), or set "
                          "load_transformer_weights: false to start from init.")


def resolve_source(path: str) -> tuple[SourceKind, Path]:
    """What kind of warm-start source `path` is, and the file or DCP folder to read; a state-dict
    file must be readable (its header: nothing else is read here).

    Raises ConfigError (key pretrained_transformer_path) when it is neither kind, or unreadable.
    """
    p = Path(path)
    if p.is_file() and p.suffix in (".pt", ".pth", ".bin", ".safetensors"):
        return "state_dict", _readable_state_file(path, p)
    if p.is_dir():
        if (p / PLAIN_STATE_FILE).is_file():
            return "state_dict", _readable_state_file(path, p / PLAIN_STATE_FILE)
        if (p / layout.DCP_METADATA).is_file() or _holds_parts(p):
            return "checkpoint", p
    what = "does not exist" if not p.exists() else "is neither kind of source"
    raise ConfigError("pretrained_transformer_path",
                      f"{path} {what}. Give a .pt or .safetensors state dict, a directory holding "
                      f"{PLAIN_STATE_FILE}, or a checkpoint-N/ directory (or its {layout.TRANSFORMER}/ "
                      f"folder) written by pan; run `pan inspect <output_dir>` to list a run's "
                      f"checkpoints.")


@dataclass
class WarmStartReport:
    source: Path
    kind: SourceKind
    loaded: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple, tuple]] = field(default_factory=list)  # name, source, model
    missing: list[str] = field(default_factory=list)     # in the model, not in the source
    unexpected: list[str] = field(default_factory=list)  # in the source, not in the model

    def summary(self) -> str:
        lines = [f"warm start from {self.source} ({self.kind}): {len(self.loaded)} tensors loaded, "
                 f"{len(self.mismatched)} shape-mismatched, {len(self.missing)} missing (kept at "
                 f"init), {len(self.unexpected)} unused"]
        lines += [f"  shape mismatch {n}: source {tuple(a)} vs model {tuple(b)}" for n, a, b in self.mismatched]
        lines += [f"  missing {n}" for n in self.missing]
        lines += [f"  unused {n}" for n in self.unexpected]
        return "\n".join(lines)


def read_plain_state_dict(path: Path) -> dict[str, Tensor]:
    """A flat name -> tensor mapping from a .safetensors or torch-saved file (names unwrapped)."""
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
    else:
        # mmap: a large file is paged in tensor by tensor as it is copied, not read whole first.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        keys = list(state)[:5] if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path} is not a flat state dict of tensors (top level: {keys}); save "
                         f"model.state_dict() itself, or export a checkpoint with `pan export`.")
    return {unwrapped_name(k): v for k, v in state.items()}


def _compare(report: WarmStartReport, source: dict[str, tuple], model: dict[str, tuple]) -> list[str]:
    """Fill the report from the two name -> shape maps; the names to load."""
    diff = ShapeDiff.of(source, model)
    report.loaded = sorted(diff.matching)
    report.mismatched = sorted(diff.mismatched)
    report.missing = sorted(diff.missing)
    report.unexpected = sorted(diff.unexpected)
    return report.loaded


@torch.no_grad()
def load_state_dict_weights(model: nn.Module, path: Path) -> WarmStartReport:
    """Copy the shape-compatible tensors of a plain state dict into an unsharded model."""
    if any(t.is_meta for t in model.state_dict().values()):
        raise ValueError("a plain state-dict warm start needs the model's tensors materialised "
                         "(it runs before FSDP wrapping); the model is on the meta device")
    source = read_plain_state_dict(path)
    target = model.state_dict()
    report = WarmStartReport(path, "state_dict")
    names = _compare(report, {k: v.shape for k, v in source.items()}, {k: v.shape for k, v in target.items()})
    model.load_state_dict({n: source[n] for n in names}, strict=False)
    return report


def part_folder(path: Path, part: str) -> Path | None:
    """The DCP folder of `part` in a checkpoint source: its own folder of a checkpoint-N/, or the
    source itself when it is one part's folder; None when the checkpoint has no such part."""
    own = path / layout.part_dirs(part)[0]
    if (own / layout.DCP_METADATA).is_file():
        return own
    return path if (path / layout.DCP_METADATA).is_file() else None


def load_checkpoint_weights(model: nn.Module, path: Path, part: str = layout.TRANSFORMER) -> WarmStartReport:
    """Load one part's weights from a pan checkpoint (a checkpoint-N/ folder, or the part's DCP
    folder) into a (possibly FSDP-sharded) model. Collective: every rank calls it. DCP reads each
    rank's shares from whatever layout wrote them."""
    dcp_dir = part_folder(path, part) or path
    stored = layout.dcp_tensor_shapes(dcp_dir)
    state = get_model_state_dict(model)
    report = WarmStartReport(dcp_dir, "checkpoint")
    names = _compare(report, {k: size for k, (size, _) in stored.items()},
                     {k: v.shape for k, v in state.items()})  # DTensor.shape is the global shape
    wanted = {n: state[n] for n in names}
    reader.load_dcp(wanted, dcp_dir)
    set_model_state_dict(model, wanted, options=StateDictOptions(strict=False))
    return report


@dataclass
class WarmStart:
    """The warm start one run does: call both hooks; each acts only for its kind of source."""
    kind: SourceKind
    path: Path
    report: WarmStartReport | None = None

    def before_sharding(self, model: nn.Module) -> None:
        if self.kind == "state_dict":
            self.report = load_state_dict_weights(model, self.path)
            get_logger().info("%s", self.report.summary())

    def after_sharding(self, model: nn.Module, part: str = layout.TRANSFORMER) -> None:
        if self.kind != "checkpoint":
            return
        folder = part_folder(self.path, part)
        if folder is None:
            get_logger().info("warm start: %s holds no %s; it starts from its init", self.path, part)
            return
        self.report = load_checkpoint_weights(model, folder)
        get_logger().info("%s: %s", part, self.report.summary())


def plan_warm_start(source: str | None, resume_step: int | None) -> WarmStart | None:
    """The warm start to do, or None: no source (`Task.warm_start_source()`), or the run resumes
    its own checkpoint (`resume_step` from `Checkpointer.latest_step()`)."""
    if source is None:
        return None
    if resume_step is not None:
        get_logger().info("output_dir has checkpoint-%d: resuming it, not warm starting from %s",
                          resume_step, source)
        return None
    kind, path = resolve_source(source)
    return WarmStart(kind, path)
