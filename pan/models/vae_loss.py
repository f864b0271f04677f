"""The causal video VAE's training objective (Pyramid-Flow's LPIPSWithDiscriminator, per frame).

Generator (VAE) step, with N = B * T frames:
    rec_n  = mean over (C, H, W) of (x - x_hat)**2 (or |x - x_hat|, `pixel_loss: l1`)   per frame n
    p_n    = LPIPS(x_n, x_hat_n)                                                        per frame n
    nll    = sum_n [(pixel_weight * rec_n + perceptual_weight * p_n) / exp(logvar) + logvar] / N
    kl     = mean over (b, c) of 0.5 * sum_{t,h,w} (mu**2 + sigma**2 - 1 - log sigma**2)
    g      = -mean(D(x_hat))                                   (once step >= disc_start)
    w_d    = clamp(|dnll/dW| / (|dg/dW| + 1e-4), 0, 1e4) * disc_weight   (W: the decoder's last layer)
    loss   = nll + kl_weight * kl + w_d * g
Discriminator step (inputs detached):
    d_loss = 0.5 * (mean(relu(1 - D(x))) + mean(relu(1 + D(x_hat))))   (once step >= disc_start)

`logvar` is a learnable scalar (the original never optimises it, quirk V3: its optimizer holds only
the VAE's parameters; pan's recipe optimises it with the VAE). The perceptual term is deterministic
(no LPIPS dropout, quirk V1). The generator term does not leave gradients on the discriminator
(its parameters are frozen while it scores x_hat for the VAE).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pan.config.core import knob
from pan.models.causal_vae import DiagonalGaussian
from pan.models.lpips import LPIPS
from pan.models.vae_discriminator import NLayerDiscriminator


@dataclass(kw_only=True)
class VAELossConfig:
    SECTION: ClassVar[str] = "loss"

    pixel_loss: Literal["mse", "l1"] = knob("mse", "per-frame pixel reconstruction loss")
    pixelloss_weight: float = knob(1.0, "weight of the pixel loss (Pyramid-Flow's script: 10)", ge=0)
    perceptual_weight: float = knob(1.0, "weight of the per-frame LPIPS loss (0 = no LPIPS)", ge=0)
    kl_weight: float = knob(1e-6, "weight of the KL term", ge=0)
    logvar_init: float = knob(0.0, "initial value of the learnable log-variance dividing the NLL")
    disc_weight: float = knob(0.5, "scale of the adaptive GAN weight", ge=0)
    disc_start: int = knob(0, "first step with the GAN terms (step >= disc_start)", ge=0)


# ----------------------------------------------------------------------------------------------
# Terms
# ----------------------------------------------------------------------------------------------

def frames_of(video: Tensor) -> Tensor:
    """[B, C, T, H, W] -> [(B T), C, H, W], frames of clip b at rows b*T .. b*T + T - 1."""
    b, c, t, h, w = video.shape
    return video.transpose(1, 2).reshape(b * t, c, h, w)


def pixel_loss_per_frame(x: Tensor, x_hat: Tensor, kind: str = "mse") -> Tensor:
    """Mean over (C, H, W) of the squared (`mse`) or absolute (`l1`) error: [N] for frames [N, C, H, W]."""
    err = (x - x_hat) ** 2 if kind == "mse" else (x - x_hat).abs()
    return err.mean(dim=(1, 2, 3))


def kl_loss(posterior: DiagonalGaussian) -> Tensor:
    """KL to N(0, 1), summed over (t, h, w), averaged over batch and channels (as the original)."""
    return posterior.kl().mean()


def adaptive_gan_weight(nll: Tensor, g_loss: Tensor, last_layer: Tensor, disc_weight: float) -> Tensor:
    """Balance the GAN gradient against the NLL gradient at `last_layer` (Esser et al., 2021):
    clamp(|dnll/dW| / (|dg/dW| + 1e-4), 0, 1e4) * disc_weight, detached."""
    nll_grad = torch.autograd.grad(nll, last_layer, retain_graph=True)[0]
    g_grad = torch.autograd.grad(g_loss, last_layer, retain_graph=True)[0]
    weight = torch.norm(nll_grad) / (torch.norm(g_grad) + 1e-4)
    return torch.clamp(weight, 0.0, 1e4).detach() * disc_weight


def hinge_d_loss(logits_real: Tensor, logits_fake: Tensor) -> Tensor:
    return 0.5 * (torch.mean(F.relu(1.0 - logits_real)) + torch.mean(F.relu(1.0 + logits_fake)))


@contextmanager
def frozen(module: nn.Module):
    """Parameters of `module` need no gradient inside the block (gradients still reach its input)."""
    flags = [(p, p.requires_grad) for p in module.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


# ----------------------------------------------------------------------------------------------
# The objective
# ----------------------------------------------------------------------------------------------

class VAELoss(nn.Module):
    """Owns the learnable `logvar`, the frozen LPIPS and the (trained) discriminator.

    `generator_loss` -> (loss for the VAE and logvar, metrics); `discriminator_loss` -> (loss for
    the discriminator, metrics). Metrics are detached scalar tensors.
    """

    def __init__(self, cfg: VAELossConfig, lpips: LPIPS | None = None,
                 discriminator: NLayerDiscriminator | None = None):
        super().__init__()
        if cfg.perceptual_weight > 0 and lpips is None:
            raise ValueError("perceptual_weight > 0 needs the LPIPS network; pass one or set it to 0.")
        self.cfg = cfg
        self.logvar = nn.Parameter(torch.tensor(float(cfg.logvar_init)))
        self.perceptual = lpips
        self.discriminator = discriminator

    def gan_active(self, step: int) -> bool:
        return self.discriminator is not None and step >= self.cfg.disc_start

    def _score(self, video: Tensor) -> Tensor:
        """Discriminator logits of a clip batch [B, C, T, H, W]: per frame (2-D) or per clip (3-D)."""
        return self.discriminator(frames_of(video) if self.discriminator.dims == 2 else video)

    def generator_loss(self, x: Tensor, x_hat: Tensor, posterior: DiagonalGaussian, step: int,
                       last_layer: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """x, x_hat [B, C, T, H, W]; `last_layer` (the decoder's output weight) is needed once the
        GAN term is on. Returns (loss, metrics)."""
        cfg = self.cfg
        frames, frames_hat = frames_of(x), frames_of(x_hat)                  # [N, C, H, W]
        rec = pixel_loss_per_frame(frames, frames_hat, cfg.pixel_loss)       # [N]
        nll_frames = cfg.pixelloss_weight * rec
        if cfg.perceptual_weight > 0:
            perceptual = self.perceptual(frames, frames_hat).flatten()      # [N]
            nll_frames = nll_frames + cfg.perceptual_weight * perceptual
        else:
            perceptual = torch.zeros_like(rec)
        nll_frames = nll_frames / torch.exp(self.logvar) + self.logvar
        nll = nll_frames.sum() / nll_frames.shape[0]
        kl = kl_loss(posterior)
        loss = nll + cfg.kl_weight * kl
        zero = nll.new_zeros(())
        g_loss, d_weight = zero, zero
        if self.gan_active(step):
            if last_layer is None:
                raise ValueError("the GAN term needs `last_layer` (the decoder's last weight).")
            with frozen(self.discriminator):
                g_loss = -torch.mean(self._score(x_hat))
            if g_loss.requires_grad:  # without a graph (validation) the weight is 0, as in the original
                d_weight = adaptive_gan_weight(nll, g_loss, last_layer, cfg.disc_weight)
            loss = loss + d_weight * g_loss
        metrics = {"loss/total": loss, "loss/nll": nll, "loss/rec": rec.mean(),
                   "loss/perceptual": perceptual.mean(), "loss/kl": kl, "loss/gan": g_loss,
                   "loss/logvar": self.logvar, "disc/weight": d_weight,
                   "disc/factor": nll.new_tensor(float(self.gan_active(step)))}
        return loss, {k: v.detach() for k, v in metrics.items()}

    def discriminator_loss(self, x: Tensor, x_hat: Tensor, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        """Hinge loss of the discriminator on real x and reconstructed x_hat (both detached).

        Before `disc_start` it is 0; do not step the discriminator's optimizer then (`gan_active`),
        or its weight decay alone would move the weights."""
        if self.discriminator is None:
            raise ValueError("this VAE loss has no discriminator.")
        logits_real = self._score(x.detach())
        logits_fake = self._score(x_hat.detach())
        factor = float(self.gan_active(step))
        d_loss = factor * hinge_d_loss(logits_real, logits_fake)
        metrics = {"disc/loss": d_loss, "disc/logits_real": logits_real.mean(),
                   "disc/logits_fake": logits_fake.mean()}
        return d_loss, {k: v.detach() for k, v in metrics.items()}
