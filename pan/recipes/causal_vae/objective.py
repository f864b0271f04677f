"""The causal_vae recipe's objective: the VAE's loss (reconstruction, LPIPS, KL and the adaptive
GAN term) and the discriminator's hinge loss, per sample, under VAE context parallel."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from pan.models.causal_vae import DiagonalGaussian
from pan.models.lpips import LPIPS
from pan.models.vae_discriminator import NLayerDiscriminator
from pan.models.vae_loss import VAELossConfig, frames_of, frozen, pixel_loss_per_frame
from pan.parallel.vae_context import ContextGroup

if TYPE_CHECKING:
    from pan.recipes.causal_vae.data import ClipBatch
    from pan.recipes.causal_vae.model import TrainedCausalVAE


class Objective:
    """What the VAE's loss needs besides the VAE: its keys, the frozen LPIPS, the discriminator's
    current weights (a plain copy: it scores the reconstructions without being trained by them), the
    context group. A plain class for the same reason as ClipBatch."""

    def __init__(self, cfg: VAELossConfig, lpips: LPIPS | None, discriminator: NLayerDiscriminator | None,
                 context: ContextGroup | None = None):
        self.cfg, self.lpips, self.context = cfg, lpips, context
        self.discriminator = discriminator   # None: no GAN term this step
        self.stats: list[dict] = []          # per micro-batch: this rank's summed metrics

    def generator_loss(self, vae: TrainedCausalVAE, batch: ClipBatch) -> Tensor:
        """Sum over this rank's samples of the per-sample loss (its share of each under context
        parallel); the trainer divides by the global sample count."""
        cfg = self.cfg
        logvar = vae.logvar.sum()   # [1] -> scalar
        sums = dict.fromkeys(("nll", "kl", "rec", "perceptual", "gan"), 0.0)
        nll_sum = kl_sum = g_sum = None
        batch.outputs = []
        for group, x in zip(batch.groups(), batch.stacked()):
            noise = torch.stack([batch.noises[i] for i in group]).to(x)
            total_frames = batch.full_frames[group[0]]
            posterior = DiagonalGaussian(vae.encode_moments(x, self.context))
            x_hat = vae.decode_latent(posterior.sample(noise=noise), self.context)
            terms = self.sample_terms(x, _at_least_fp32(x_hat), posterior, logvar, total_frames)
            batch.outputs.append((x, x_hat.detach(), total_frames))
            nll_sum = _add(nll_sum, terms["nll"].sum())
            kl_sum = _add(kl_sum, terms["kl"].sum())
            if "gan" in terms:
                g_sum = _add(g_sum, terms["gan"].sum())
            for key in sums:
                if key in terms:
                    sums[key] += float(terms[key].detach().sum())
        loss = nll_sum + cfg.kl_weight * kl_sum
        d_weight = 0.0
        if g_sum is not None:
            d_weight = self.adaptive_weight(nll_sum, g_sum, vae.last_layer, batch.count)
            loss = loss + d_weight * g_sum
        sums.update(weight=d_weight * batch.count, logvar=float(logvar.detach()) * batch.count,
                    factor=float(g_sum is not None) * batch.count)
        self.stats.append(sums)
        return loss

    def sample_terms(self, x: Tensor, x_hat: Tensor, posterior: DiagonalGaussian, logvar: Tensor,
                     total_frames: int) -> dict[str, Tensor]:
        """Per-sample terms [b] of a group of same-shape clips (this rank's frames of them)."""
        cfg = self.cfg
        b = x.shape[0]
        frames, frames_hat = frames_of(_at_least_fp32(x)), frames_of(x_hat)      # [b t, 3, H, W]
        rec = pixel_loss_per_frame(frames, frames_hat, cfg.pixel_loss).view(b, -1)  # [b, t]
        weighted = cfg.pixelloss_weight * rec
        out = {"rec": rec.sum(1) / total_frames}
        if cfg.perceptual_weight > 0:
            perceptual = self.lpips(frames, frames_hat).view(b, -1)
            weighted = weighted + cfg.perceptual_weight * perceptual
            out["perceptual"] = perceptual.sum(1) / total_frames
        nll = weighted / torch.exp(logvar) + logvar                              # [b, t]
        out["nll"] = nll.sum(1) / total_frames
        out["kl"] = posterior.kl().mean(dim=1)                                   # [b]
        if self.discriminator is not None:
            with frozen(self.discriminator):
                out["gan"] = -self.logit_means(self.discriminator, x_hat, total_frames)
        return out

    @staticmethod
    def logit_means(disc: nn.Module, clips: Tensor, total_frames: int) -> Tensor:
        """Per-sample mean of the discriminator's logits [b]: over frames (2-D, this rank's share of
        the clip's frames) or over the clip (3-D)."""
        b = clips.shape[0]
        if getattr(disc, "dims", 2) == 3:
            return disc(clips).flatten(1).mean(1)
        logits = disc(frames_of(clips))                                          # [b t, 1, h, w]
        return logits.flatten(1).mean(1).view(b, -1).sum(1) / total_frames

    def adaptive_weight(self, nll_sum: Tensor, g_sum: Tensor, last_layer: Tensor, count: float) -> float:
        """clamp(|d nll/dW| / (|d g/dW| + 1e-4), 0, 1e4) * disc_weight for the micro-batch's mean nll
        and g over every rank's samples (gradients summed over all ranks), W the decoder's last
        layer. Without a graph (evaluation) it is 0, as in the original."""
        if not torch.is_grad_enabled() or not g_sum.requires_grad:
            return 0.0
        nll_grad = torch.autograd.grad(nll_sum, last_layer, retain_graph=True)[0]
        g_grad = torch.autograd.grad(g_sum, last_layer, retain_graph=True)[0]
        packed = torch.cat([nll_grad.flatten().float(), g_grad.flatten().float(),
                            nll_grad.new_tensor([count], dtype=torch.float32)])
        if dist.is_initialized():
            dist.all_reduce(packed)
        n = nll_grad.numel()
        total = packed[-1]
        weight = packed[:n].norm() / total / (packed[n:2 * n].norm() / total + 1e-4)
        return float(torch.clamp(weight, 0.0, 1e4)) * self.cfg.disc_weight

    def discriminator_loss(self, disc: nn.Module, batch: ClipBatch) -> Tensor:
        """Sum over this rank's samples of the hinge loss on x and the detached x_hat."""
        total, real_sum, fake_sum = None, 0.0, 0.0
        for x, x_hat, total_frames in batch.outputs:
            real = self.logit_hinge(disc, _at_least_fp32(x), total_frames, real=True)
            fake = self.logit_hinge(disc, _at_least_fp32(x_hat), total_frames, real=False)
            total = _add(total, 0.5 * (real[0] + fake[0]).sum())
            real_sum += float(real[1].sum())
            fake_sum += float(fake[1].sum())
        self.stats.append({"disc_real": real_sum, "disc_fake": fake_sum})
        return total

    @staticmethod
    def logit_hinge(disc: nn.Module, clips: Tensor, total_frames: int, real: bool) -> tuple[Tensor, Tensor]:
        """(per-sample mean hinge term, per-sample mean logit), both [b]."""
        b = clips.shape[0]
        if getattr(disc, "dims", 2) == 3:
            logits = disc(clips).flatten(1)
            per = lambda v: v.mean(1)  # noqa: E731
        else:
            logits = disc(frames_of(clips)).flatten(1)                           # [b t, n]
            per = lambda v: v.mean(1).view(b, -1).sum(1) / total_frames  # noqa: E731
        hinge = F.relu(1.0 - logits) if real else F.relu(1.0 + logits)
        return per(hinge), per(logits.detach())


def _at_least_fp32(x: Tensor) -> Tensor:
    """Loss terms in fp32 (bf16 activations are cast up; float64 tests stay float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _add(total: Tensor | None, value: Tensor) -> Tensor:
    return value if total is None else total + value
