"""LPIPS (Zhang et al., 2018) on VGG16 features: a frozen perceptual distance for VAE training.

The VGG16 feature stack is built here (no torchvision): the 30 `features` layers of VGG16
(configuration D) up to relu5_3, cut after relu1_2, relu2_2, relu3_3, relu4_3 and relu5_3 into
`net.slice1..5`, keeping torchvision's layer indices so the weights load by name. Each slice's
output is unit-normalised over channels; the squared difference of the two images' features is
weighted per channel (`lin0..4`, 1x1 convs without bias), averaged over space and summed over the
five slices.

The weights come from one `torch.save` state-dict file in the original's full format
(`scaling_layer.shift/scale`, `net.slice{1..5}.{idx}.weight/bias`, `lin{0..4}.model.1.weight`),
e.g. Pyramid-Flow's `vgg_lpips.pth`. A missing file, or one whose keys or shapes do not fit, is
refused with `LPIPSFileError` naming the keys.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from pan.models.state_dict import ShapeDiff

# VGG16 `features` up to relu5_3: conv widths, "M" = 2x2 max-pool. Slices end after these indices.
_VGG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512]
_SLICE_ENDS = (4, 9, 16, 23, 30)   # slice k holds layers [_SLICE_ENDS[k-1], _SLICE_ENDS[k])
CHANNELS = (64, 128, 256, 512, 512)


class LPIPSFileError(ValueError):
    """An LPIPS weight file that is missing, unreadable, or does not fit the network."""


class ScalingLayer(nn.Module):
    """Maps [-1, 1] pixels to the input statistics the VGG weights expect (buffers in the file)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("shift", torch.tensor([-0.030, -0.088, -0.188])[None, :, None, None])
        self.register_buffer("scale", torch.tensor([0.458, 0.448, 0.450])[None, :, None, None])

    def forward(self, x: Tensor) -> Tensor:
        return (x - self.shift) / self.scale


class VGG16Features(nn.Module):
    """VGG16's conv/ReLU/max-pool stack in five slices; returns the five slices' outputs."""

    def __init__(self):
        super().__init__()
        layers, c_in = [], 3
        for v in _VGG16:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [nn.Conv2d(c_in, v, kernel_size=3, padding=1), nn.ReLU()]
                c_in = v
        starts = (0,) + _SLICE_ENDS[:-1]
        for k, (start, end) in enumerate(zip(starts, _SLICE_ENDS), 1):
            block = nn.Sequential()
            for idx in range(start, end):
                block.add_module(str(idx), layers[idx])   # torchvision's index: `net.slice2.5.weight`
            self.add_module(f"slice{k}", block)

    def forward(self, x: Tensor) -> list[Tensor]:
        outs = []
        for k in range(1, 6):
            x = getattr(self, f"slice{k}")(x)
            outs.append(x)
        return outs


class LinearHead(nn.Module):
    """Per-channel weights of one slice's squared feature difference (a 1x1 conv, no bias).

    Index 0 of `model` was the original's Dropout(0.5). The original trainer calls `train()` on the
    whole wrapper, which switches that dropout on and makes its perceptual loss stochastic (quirk
    V1); pan's perceptual loss is deterministic, so index 0 is an identity (kept only so the
    weight's key stays `model.1.weight`)."""

    def __init__(self, channels: int):
        super().__init__()
        self.model = nn.Sequential(nn.Identity(), nn.Conv2d(channels, 1, kernel_size=1, bias=False))

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


class LPIPS(nn.Module):
    """Frozen LPIPS distance: forward(x, y) with images [N, 3, H, W] in [-1, 1] -> [N, 1, 1, 1]."""

    def __init__(self):
        super().__init__()
        self.scaling_layer = ScalingLayer()
        self.net = VGG16Features()
        for k, c in enumerate(CHANNELS):
            self.add_module(f"lin{k}", LinearHead(c))
        self.requires_grad_(False)
        self.eval()

    @classmethod
    def from_file(cls, path: str | Path) -> LPIPS:
        """Load the original's full-format state-dict file (e.g. `vgg_lpips.pth`)."""
        model = cls()
        state = read_state_dict(path)
        check_keys(model, state, path)
        model.load_state_dict(state, strict=True)
        return model

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        feats_x, feats_y = self.net(self.scaling_layer(x)), self.net(self.scaling_layer(y))
        total = 0
        for k, (fx, fy) in enumerate(zip(feats_x, feats_y)):
            diff = (unit_normalize(fx) - unit_normalize(fy)) ** 2            # [N, C_k, H_k, W_k]
            total = total + getattr(self, f"lin{k}")(diff).mean(dim=[2, 3], keepdim=True)
        return total                                                      # [N, 1, 1, 1]


def unit_normalize(x: Tensor, eps: float = 1e-10) -> Tensor:
    """x / (its L2 norm over channels + eps), per position."""
    return x / (torch.sqrt(torch.sum(x ** 2, dim=1, keepdim=True)) + eps)


def read_state_dict(path: str | Path, setting: str = "the LPIPS path", mmap: bool = False) -> dict[str, Tensor]:
    """The tensors of an LPIPS weight file (a bare state dict, or one under `state_dict`), or
    LPIPSFileError saying what is wrong with it; `setting` names what points at the file, in the
    message of a missing one. `mmap`: map the file instead of reading it (the tensors' headers are
    enough to check the keys and shapes)."""
    path = Path(path)
    if not path.is_file():
        raise LPIPSFileError(f"no LPIPS weights at {path}: point {setting} at the VGG16 LPIPS "
                             "state-dict file (e.g. Pyramid-Flow's vgg_lpips.pth).")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # truncated, corrupted, or not a torch file
        raise LPIPSFileError(f"cannot read the LPIPS weights {path} (truncated or not a torch.save "
                             f"state dict): {type(e).__name__}: {e}") from e
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise LPIPSFileError(f"{path} does not hold a state dict of tensors (got {type(state).__name__}).")
    return state


def check_keys(model: nn.Module, state: dict[str, Tensor], path: str | Path) -> None:
    """Raise LPIPSFileError naming the keys of `state` that are missing, unknown or of the wrong shape."""
    details = ShapeDiff.of_tensors(state, model).named()
    if details:
        raise LPIPSFileError(f"{path} does not fit the VGG16 LPIPS network ({len(model.state_dict())} keys: "
                             f"scaling_layer.*, net.slice1..5.*, lin0..4.model.1.weight): {details}.")

