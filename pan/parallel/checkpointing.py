"""Activation checkpointing per transformer block, full or selective, without renaming parameters.

Uses torch's composable `checkpoint` (forward hooks), not a wrapper module, so parameter names,
optimizer groups and DCP checkpoints are the same with and without it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.attention.varlen  # noqa: F401  (registers torch_attn::_varlen_attn, which SAVED_OPS names)
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten

# Results the selective policy keeps; everything else a block computes is recomputed. The policy
# sees the ops as they reach the dispatcher, so each attention path is listed by the op it
# dispatches (tests/test_gpu_paths.py records them on fake CUDA tensors).
SAVED_OPS = {
    # every Linear of a block: q/k/v projections, attention output projections, both MLP layers
    # (GELU MLP fc1/fc2, SwiGLU w13/w2), the AdaLN modulation linear, the single block's linear1/2
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    # attention kernels (output and the log-sum-exp the backward needs):
    # SDPA (backends sdpa and blockwise; each SDPBackend's op on CUDA, the flash one on CPU)
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._flash_attention_forward.default,
    # varlen (full rule: one call per pack; block-causal: one per frame group): torch's custom op,
    # which the dispatcher sees whole (its inner _flash_attention_forward never reaches the policy)
    torch.ops.torch_attn._varlen_attn.default,
    # flex: eager, the flex_attention higher-order op; compiled (CUDA), the compiled region when
    # inductor wraps it (`wrap_inductor_compiled_regions`; otherwise it is invisible to the policy
    # and runs again in the backward)
    torch.ops.higher_order.flex_attention,
    torch.ops.higher_order.inductor_compiled_code,
    # Ulysses all-to-alls: recomputing them would repeat the communication
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops._c10d_functional.wait_tensor.default,
}


def keep_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective policy: save the outputs of SAVED_OPS, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_context():
    """`context_fn` of the selective policy (`use_dedicated_gradient_checkpointing`).

    Kept per block: the outputs of every matmul (all Linear layers of the block: q/k/v and output
    projections of both streams, MLP layers, modulation linear), of the attention kernel (with its
    log-sum-exp), and of the context-parallel all-to-alls. Recomputed in the backward pass: the
    cheap element-wise and indexing work between them — LayerNorm / RMSNorm (including the q/k
    norms), modulation `x * (1 + scale) + shift`, RoPE, GELU / SiLU / SwiGLU product, gated
    residual adds, and the gathers between stream and joint order. This stores roughly what the
    block's matmuls produce instead of every intermediate, and costs no matmul or communication
    again (full checkpointing recomputes the whole forward of the block, all-to-alls included).
    """
    return create_selective_checkpoint_contexts(keep_matmuls_and_attention)


def apply_activation_checkpointing(blocks: Iterable[nn.Module], selective: bool) -> None:
    """Checkpoint each block: recompute it in the backward pass (all of it, or only element-wise work)."""
    context = selective_checkpoint_context if selective else None
    for block in blocks:
        checkpoint(block, context_fn=context)
