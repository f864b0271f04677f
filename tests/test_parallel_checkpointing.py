"""Activation checkpointing recomputes what its docstring says, and keeps parameter names."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pan.models.packing import PackInfo
from pan.models.pan_dit import PanDiTConfig, PanVideoDiffusionTransformer
from pan.parallel.checkpointing import apply_activation_checkpointing


aten = torch.ops.aten
ARCH = PanDiTConfig(in_channels=4, out_channels=4, hidden_size=32, num_attention_heads=4, num_layers=2,
                    num_single_layers=1, num_refiner_layers=1, text_embed_dim=16, rope_axes_dim=[2, 2, 4],
                    timestep_freq_dim=32, mlp_ratio=2.0, text_mlp_ratio=2.0, refiner_mlp_ratio=2.0)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(checkpointing: str) -> tuple[Counter, list[str], torch.Tensor]:
    """Ops run during the backward pass, parameter names, and the input gradient."""
    torch.manual_seed(0)
    model = PanVideoDiffusionTransformer(ARCH, zero_init_modulation=False, attention_backend="sdpa")
    if checkpointing != "none":
        apply_activation_checkpointing(model.fsdp_blocks(), selective=checkpointing == "selective")
    pack = PackInfo.build([(1, 3, 4), (2, 2, 2)], [5, 3])
    x = torch.randn(pack.num_video_tokens, 16, requires_grad=True)
    out = model(x, torch.rand(2), torch.randn(8, 16), pack)
    counter = OpCounter()
    with counter:
        out.square().sum().backward()
    return counter.counts, [n for n, _ in model.named_parameters()], x.grad


def test_full_recomputes_matmuls_selective_only_elementwise_work():
    plain, names, grad = backward_ops("none")
    full, full_names, full_grad = backward_ops("full")
    selective, sel_names, sel_grad = backward_ops("selective")
    assert names == full_names == sel_names
    torch.testing.assert_close(full_grad, grad, rtol=0, atol=0)
    torch.testing.assert_close(sel_grad, grad, rtol=0, atol=0)
    matmuls = lambda c: c[aten.mm.default] + c[aten.addmm.default]  # noqa: E731
    attention = aten._scaled_dot_product_flash_attention_for_cpu.default
    norms = aten.native_layer_norm.default
    # Full: the forward of every block runs again inside the backward.
    assert matmuls(full) > matmuls(plain) and full[attention] > 0 and full[norms] > plain[norms]
    # Selective: no matmul and no attention again, but the element-wise work is recomputed.
    assert matmuls(selective) == matmuls(plain) and selective[attention] == plain[attention] == 0
    assert selective[norms] > plain[norms]
