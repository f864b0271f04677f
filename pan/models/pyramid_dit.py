"""What both released Pyramid-Flow DiTs (`pan.models.pyramid_flux`, `pan.models.pyramid_mmdit`) share
outside their blocks (which are in `pan.models.pyramid_blocks`): the config keys the original sets from
its command line, the rules a pack's layouts must follow, the joint-order views of a pack, the
original's init, the Muon matrices, and `PyramidDiT`, the frame around the blocks (conditioning,
output layer, FSDP and checkpointing units, FLOPs outside the blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pan.config.core import knob
from pan.models.layers import Samples, to_joint
from pan.models.packing import PackInfo, SampleLayout
from pan.models.pyramid_blocks import TIMESTEP_FEATURES, FinalNorm, Modulation

ROPE_THETA = 10000.0          # hard-coded in the original (not a config key)


# ------------------------------------------------------------------------------------------------
# Config rules shared by both released models
# ------------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class PyramidRuntimeKeys:
    """Keys of the released config.json that the original sets from its training command line
    (ignoring the file, quirk F2). pan reads them from the file and honours each one."""
    use_flash_attn: bool = knob(False, "attention backend the blocks start with: true = 'auto' (pan's "
                                       "fastest exact kernels, by measurement; the block-causal mask is never dropped, "
                                       "unlike the original's flash path), false = 'sdpa' (one masked "
                                       "SDPA call per sequence, the original's other path)")
    use_temporal_causal: bool = knob(True, "block-causal attention over latent frames (captions are frame "
                                           "0); forward refuses packs built with another rule")
    interp_condition_pos: bool = knob(True, "history clips take positions interpolated onto the last "
                                            "clip's grid (Clip.ref_hw); forward refuses packs that differ")
    use_gradient_checkpointing: bool = knob(False, "checkpoint the blocks `checkpointed_blocks()` names")
    gradient_checkpointing_ratio: float = knob(0.6, "fraction of each block list (first blocks first) "
                                                    "that `checkpointed_blocks()` names", ge=0, le=1)


def check_layouts(pack: PackInfo, use_temporal_causal: bool, interp_condition_pos: bool) -> None:
    """Refuse a pack whose attention rule or history positions are not the ones the config names.

    The rule and the positions travel with the pack (the data side builds them, see
    `pyramid_sample_layout`); the model's config says which ones it was trained with.
    """
    rule = "block_causal" if use_temporal_causal else "full"
    for i, layout in enumerate(pack.layouts):
        if layout.attention != rule:
            raise ValueError(f"sample {i} has the {layout.attention!r} attention rule but the model's "
                             f"use_temporal_causal={use_temporal_causal} needs {rule!r}; build the layouts "
                             "with the model's `sample_layout`.")
        last_hw = tuple(layout.clips[-1].grid[1:])
        for j, clip in enumerate(layout.clips):
            own_hw = tuple(clip.grid[1:])
            ref = None if clip.ref_hw is None or tuple(clip.ref_hw) == own_hw else tuple(clip.ref_hw)
            expected = last_hw if interp_condition_pos and own_hw != last_hw else None
            if ref != expected:
                raise ValueError(f"sample {i} clip {j} (grid {clip.grid}) is positioned on {ref or own_hw} "
                                 f"but interp_condition_pos={interp_condition_pos} needs {expected or own_hw}; "
                                 "build the layouts with the model's `sample_layout`.")


def pyramid_sample_layout(grids, text_len: int, use_temporal_causal: bool, interp_condition_pos: bool
                          ) -> SampleLayout:
    """One Pyramid-Flow sample: clips oldest first (post-patch grids), the last one trained.

    History clips (all but the last) are conditioning only; with interp_condition_pos they are
    positioned on the last clip's grid, as the original does.
    """
    grids = [tuple(int(n) for n in g) for g in grids]
    return SampleLayout.stacked(grids, text_len,
                                ref_hw=grids[-1][1:] if interp_condition_pos else None,
                                trained=tuple(i == len(grids) - 1 for i in range(len(grids))),
                                attention="block_causal" if use_temporal_causal else "full")


def first_blocks(blocks: nn.ModuleList, ratio: float) -> list[nn.Module]:
    """The first round(ratio * n) blocks of a list (the original picks `i <= int(n * ratio)` in
    flux and, inverted, `i >= int(n * ratio)` in MMDiT: quirk M5; pan uses one rule for both)."""
    return list(blocks)[:round(ratio * len(blocks))]


def joint_positions(pack: PackInfo) -> Tensor:
    """[L, 3] float64 (t, h, w) RoPE positions in joint order; caption rows are 0 (not rotated)."""
    video = pack.video_pos.to(torch.float64)
    return to_joint(video, video.new_zeros(pack.num_text_tokens, 3), pack)


def joint_samples(pack: PackInfo) -> Tensor:
    """[L] int64 sample of each joint row."""
    return to_joint(pack.video_sample, pack.text_sample, pack)


def joint_counts(pack: PackInfo) -> tuple[int, ...]:
    return tuple(v + t for v, t in zip(pack.video_counts, pack.text_counts))


def video_samples(pack: PackInfo, trained_only: bool = False) -> Samples:
    """The sample of each local video row, or of each trained one."""
    if trained_only:
        return Samples.of(lambda: pack.trained_counts, pack.video_sample.index_select(0, pack.video_trained_rows))
    return Samples.of(lambda: pack.video_counts, pack.video_sample)


def trained_rows(vid: Tensor, pack: PackInfo) -> Tensor:
    """The trained rows (stream order) of per-video-row values [Nv, ...]."""
    return vid if len(pack.video_trained_rows) == len(vid) else vid.index_select(0, pack.video_trained_rows)


# ------------------------------------------------------------------------------------------------
# The original's init, and the matrices Muon orthogonalises
# ------------------------------------------------------------------------------------------------

def pyramid_init(model: nn.Module, zeroed: list[nn.Linear]) -> None:
    """The original's init: xavier-uniform linears with zero bias, N(0, 0.02) conditioning and caption
    embedders, unit norms; `zeroed` (AdaLN modulation and the output layer) start at 0."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)
    embed = model.time_text_embed
    for linear in (embed.timestep_embedder.linear_1, embed.timestep_embedder.linear_2,
                   embed.text_embedder.linear_1, embed.text_embedder.linear_2, model.context_embedder):
        nn.init.normal_(linear.weight, std=0.02)
    for linear in zeroed:
        nn.init.zeros_(linear.weight)
        nn.init.zeros_(linear.bias)


def hidden_linears(model: nn.Module, block_lists: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """Attention and feed-forward weights of the blocks (not the modulation linears), each one matrix."""
    modulation = {m.linear for m in model.modules() if isinstance(m, Modulation)}
    out = {}
    for prefix in block_lists:
        for name, module in getattr(model, prefix).named_modules(prefix=prefix):
            if isinstance(module, nn.Linear) and module not in modulation:
                out[f"{name}.weight"] = (module.out_features,)
    return out


# ------------------------------------------------------------------------------------------------
# The frame both released models share around their blocks
# ------------------------------------------------------------------------------------------------

class PyramidDiT(nn.Module):
    """What both released DiTs do alike outside their blocks. A subclass sets `config` (its released
    keys), `time_text_embed`, `context_embedder`, `norm_out` and `proj_out`, and names its block
    lists, in forward order, in `BLOCK_LISTS`."""
    BLOCK_LISTS: ClassVar[tuple[str, ...]]

    @property
    def num_attention_heads(self) -> int:
        return self.config.num_attention_heads

    def sample_layout(self, grids, text_len: int) -> SampleLayout:
        """The layout this model trains on: clips oldest first (post-patch grids), last one trained."""
        return pyramid_sample_layout(grids, text_len, self.config.use_temporal_causal,
                                     self.config.interp_condition_pos)

    def conditioning(self, timesteps: Tensor, pooled: Tensor, pack: PackInfo) -> Tensor:
        """SiLU(temb) [B, D] of each sample, once the pack is checked against the config's rules."""
        check_layouts(pack, self.config.use_temporal_causal, self.config.interp_condition_pos)
        return F.silu(self.time_text_embed(timesteps, pooled))

    def output(self, vid: Tensor, temb_act: Tensor, pack: PackInfo, trained_only: bool = False) -> Tensor:
        """The video rows [Nv, D] (`trained_only`: the trained ones [n, D], stream order) through the
        AdaLN-continuous norm and the output projection."""
        return self.proj_out(self.norm_out(vid, temb_act, video_samples(pack, trained_only)))

    @torch.no_grad()
    def init_weights(self) -> None:
        """The original's init (zeroed AdaLN modulation and output: every block starts as the identity
        and the first prediction is 0)."""
        zeroed = [m.linear for m in self.modules() if isinstance(m, (Modulation, FinalNorm))]
        pyramid_init(self, zeroed + [self.proj_out])

    def fsdp_blocks(self) -> list[nn.Module]:
        """Transformer blocks in forward order: the FSDP, activation-checkpointing and compile units."""
        return [block for name in self.BLOCK_LISTS for block in getattr(self, name)]

    def checkpointed_blocks(self) -> list[nn.Module]:
        """Blocks the config's use_gradient_checkpointing / gradient_checkpointing_ratio select: the
        first ones of each block list (the original takes the MMDiT's last ones: quirk M5)."""
        if not self.config.use_gradient_checkpointing:
            return []
        ratio = self.config.gradient_checkpointing_ratio
        return [block for name in self.BLOCK_LISTS for block in first_blocks(getattr(self, name), ratio)]

    def hidden_matrices(self) -> dict[str, tuple[int, ...]]:
        """Hidden 2-D matrices (for Muon) -> row splits: q/k/v/out projections and feed-forward weights
        of every block (each its own matrix). Embedders, modulation linears, the output layer, norms and
        biases go to AdamW. The last MMDiT block's add_q_proj is listed although its output is never
        used (its gradient is 0), as in the original."""
        return hidden_linears(self, self.BLOCK_LISTS)

    def edge_flops(self, pack: PackInfo) -> int:
        """Matmul FLOPs outside the blocks: the timestep and pooled-text MLPs, the embedders and the
        output layer (a token is patch_size^2 x in_channels values for both models)."""
        c, d = self.config, self.config.hidden_size
        nv, nt, b = sum(pack.video_lens), sum(pack.text_lens), pack.num_samples
        token = c.in_channels * c.patch_size ** 2
        flops = 2 * b * (TIMESTEP_FEATURES * d + d * d + c.pooled_projection_dim * d + d * d)   # temb
        flops += 2 * nt * c.joint_attention_dim * d + 2 * nv * token * d                       # embedders
        return flops + 2 * b * d * 2 * d + 2 * nv * d * token                                  # output
