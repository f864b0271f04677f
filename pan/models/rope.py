"""3-D rotary position embedding over the post-patch (t, h, w) grid of video tokens.

The head dim is split into per-axis chunks (`axes_dim`, e.g. 16 + 56 + 56 = 128); chunk a rotates
interleaved pairs (2k, 2k+1) by angle pos_a * theta^(-2k / dim_a). The frame axis position is scaled
(Pan: 16/24) before the angles are taken.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_frequencies(positions: Tensor, axes_dim: list[int] | tuple[int, ...], theta: float,
                     frame_scale: float) -> Tensor:
    """[N, 3] (t, h, w) positions (integer, or float for clips interpolated onto a reference grid)
    -> [N, head_dim / 2] complex64 rotations e^(i * angle)."""
    # A copy even for float64 positions: scaling in place would rescale the pack's own positions
    # on every call.
    pos = positions.to(torch.float64, copy=True)
    pos[:, 0] *= frame_scale
    angles = []
    for axis, dim in enumerate(axes_dim):
        inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim)
        angles.append(pos[:, axis, None] * inv_freq)  # [N, dim / 2]
    angle = torch.cat(angles, dim=1)
    # Angles in float64 so large positions keep their precision; rotations are used in fp32
    # (in float64 for float64 inputs, as in gradient checks).
    return torch.polar(torch.ones_like(angle), angle).to(torch.complex64)


def apply_rope(x: Tensor, freqs: Tensor) -> Tensor:
    """Rotate interleaved pairs of x [N, heads, head_dim] by freqs [N, head_dim / 2] (complex)."""
    real = x.to(torch.promote_types(x.dtype, torch.float32))        # bf16/fp16 rotate in fp32
    if torch.compiler.is_compiling():
        # Inductor generates no code for complex operators (it would fall back to eager kernels
        # between fused ones): the same rotation in real arithmetic, which it fuses.
        a, b = real.unflatten(-1, (-1, 2)).unbind(-1)                   # [N, H, d/2] each
        cos_sin = torch.view_as_real(freqs)[:, None].to(real.dtype)    # [N, 1, d/2, 2]
        cos, sin = cos_sin.unbind(-1)
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).type_as(x)
    pairs = torch.view_as_complex(real.reshape(*x.shape[:-1], -1, 2))  # [N, H, d/2]
    rotated = pairs * freqs.to(pairs.dtype)[:, None, :]
    return torch.view_as_real(rotated).flatten(-2).type_as(x)
