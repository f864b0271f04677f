"""The causal_vae recipe's trained parts: the VAE with the loss's log-variance, the discriminator,
their weights (released folder, whole parameters of a sharded part) and the VAE's FLOPs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from pan.models.causal_vae import CausalVideoVAE, DiagonalGaussian
from pan.models.causal_vae_config import CausalVAEConfig
from pan.models.vae_discriminator import NLayerDiscriminator
from pan.parallel.names import unwrapped_name
from pan.parallel.vae_context import ContextGroup, ContextWindows

if TYPE_CHECKING:
    from pan.recipes.causal_vae.data import ClipBatch


class TrainedCausalVAE(CausalVideoVAE):
    """The `vae` part: the causal video VAE plus the loss's learnable log-variance `logvar`.

    `logvar` has shape [1] (FSDP2 shards no scalars); every other name is the released layout's,
    so a checkpoint's `vae/` is the released state dict plus `logvar`. Its forward computes the
    training objective of one micro-batch (`objective` given) or reconstructs clips (not given):
    everything runs inside the forward, so a sharded model has its weights gathered, and the
    adaptive GAN weight differentiates the gathered decoder output weight.
    """

    def __init__(self, config: CausalVAEConfig, *, logvar_init: float = 0.0, freeze_encoder: bool = False):
        super().__init__(config)
        self.logvar = nn.Parameter(torch.full((1,), float(logvar_init)))
        self.logvar_init = float(logvar_init)
        if freeze_encoder:
            self.encoder.requires_grad_(False)
            self.quant_conv.requires_grad_(False)
        self.frozen_encoder = freeze_encoder

    @torch.no_grad()
    def init_weights(self) -> None:
        """The original's random init, logvar at logvar_init (released or stage-1 weights come
        through the part's `pretrained` state dict instead)."""
        super().init_weights()
        if hasattr(self, "logvar"):  # (CausalVideoVAE.__init__ calls this before logvar exists)
            self.logvar.fill_(self.logvar_init)

    def fsdp_blocks(self) -> list[nn.Module]:
        """Down, mid and up blocks; the convs around them, the decoder's last layer among them (its
        weight is what the adaptive GAN weight differentiates), stay in the root unit."""
        return [*self.encoder.down_blocks, self.encoder.mid_block, self.decoder.mid_block,
                *self.decoder.up_blocks]

    def hidden_matrices(self) -> dict[str, tuple[int, ...]]:
        return {}  # convolutions: no Muon

    def encode_moments(self, x: Tensor, group: ContextGroup | None) -> Tensor:
        """[b, 3, t, H, W] (this rank's frames) -> moments [b, 2C, t', h, w]."""
        windows = None if group is None else ContextWindows(group, x.device)
        if self.frozen_encoder:
            with torch.no_grad():
                return self.quant_conv(self.encoder(x, windows))
        return self.quant_conv(self.encoder(x, windows))

    def decode_latent(self, z: Tensor, group: ContextGroup | None) -> Tensor:
        windows = None if group is None else ContextWindows(group, z.device)
        return self.decoder(self.post_quant_conv(z), windows)

    def forward(self, batch: ClipBatch, objective=None):
        """With `objective` (the step's Objective, objective.py), the micro-batch's loss; without,
        the reconstructions (posterior mean) of its clips, one tensor per shape group."""
        if objective is None:
            return [self.decode_latent(DiagonalGaussian(self.encode_moments(x, None)).mode(), None)
                    for x in batch.stacked()]
        return objective.generator_loss(self, batch)


class TrainedDiscriminator(NLayerDiscriminator):
    """The `discriminator` part: the original's PatchGAN (keys `main.{i}.*`, as discriminator.pth)."""

    def fsdp_blocks(self) -> list[nn.Module]:
        return []

    def hidden_matrices(self) -> dict[str, tuple[int, ...]]:
        return {}


def _load_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path))


def full_weights(module: nn.Module) -> dict[str, Tensor]:
    """The whole parameters of a (possibly sharded) module, detached (collective when sharded)."""
    from torch.distributed.tensor import DTensor

    return {unwrapped_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for n, p in module.named_parameters()}


def vae_forward_flops(cfg: CausalVAEConfig, frames: int, height: int, width: int) -> float:
    """FLOPs of one encode + decode of a [1, 3, frames, H, W] clip (counted on the meta device)."""
    from torch.utils.flop_counter import FlopCounterMode
    with torch.device("meta"):
        model = CausalVideoVAE(cfg)
        x = torch.empty(1, cfg.encoder_in_channels, frames, height, width)
    with FlopCounterMode(display=False) as counter:
        with torch.no_grad():
            model.decoder(model.post_quant_conv(model.quant_conv(model.encoder(x))[:, :cfg.latent_channels]))
    return float(counter.get_total_flops())
