"""What the run's model can take (`SampleFit`), checked by the reader on every sample it reads.

A row that reads but holds what the model cannot take (a latent with the wrong channel count or
dtype, sizes that do not cut into the model's units, a decoded clip the VAE cannot encode, text
features of the wrong width) would stop the step that holds it, and every resume into that step:
such a row is a bad sample like a file that cannot be decoded, skipped when it is read with reason
`unfit`. A latent or text features holding NaN or Inf is one too (`not_finite`), rather than a whole
step skipped for a non-finite loss. The recipe's task says what its model takes (its `sample_fit()`:
channels, the unit latent sizes must be multiples of, the VAE's factors, text widths); the data
engine knows no model. The checks cost a shape comparison and one pass over each latent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from pan.data.batch import Sample
from pan.data.decode import SkipSample


@dataclass(frozen=True)
class SampleFit:
    """What a sample must be for the run's model. A field left at its default checks nothing."""
    channels: int | None = None             # C of a latent ([C, T, H, W], precomputed)
    unit: tuple[int, int, int] = (1, 1, 1)  # a latent's T, H and W: positive multiples of these
    unit_from: str = "the model's patches"  # what the unit comes from (said in a skip's detail)
    max_side: int | None = None             # the largest latent H or W (a position table's reach)
    temporal_factor: int = 1                # the VAE: a clip of T frames has 1 + (T - 1) / f latent frames
    spatial_factor: int = 1                 # the VAE: pixels per latent cell along H and W
    text_width: int | None = None           # D of pan's precomputed caption features `text` [L, D]
    caption_width: int | None = None        # D of an annotation row's `text_fea` prompt_embed [L, D]
    pooled_width: int | None = None         # P of its pooled_prompt_embed [P]
    raw_latents: bool = True                # whether annotation rows' (unnormalised) latents are taken
    model: str = "the model"                # how a skip's detail names the model
    # A recipe's own per-sample tensors that its precomputed rows must carry (Sample.extras), name ->
    # shape: each dim a size, None (any), or "C", "T", "H" or "W" (the latent's own).
    extras: Mapping[str, tuple[int | str | None, ...]] = field(default_factory=dict)

    def check(self, sample: Sample) -> None:
        """Raise SkipSample (`unfit` or `not_finite`) when the model cannot take `sample`."""
        if sample.raw_latent is not None:
            if not self.raw_latents:
                raise SkipSample("unfit", f"it holds a Pyramid-Flow latent (unnormalised, of that model's VAE); "
                                          f"{self.model} takes decoded frames or pan's precomputed latents")
            self._latent(sample.raw_latent)
        elif sample.latent is not None:
            self._latent(sample.latent)
            self._extras(sample)
        elif sample.frames is not None:
            self._clip(*sample.grid)
        if sample.text is not None:
            self._features("text", sample.text, 2, self.text_width, "caption features")
        if sample.text_features is not None:
            f = sample.text_features
            self._features("text_fea prompt_embed", f["prompt_embed"], 2, self.caption_width, "caption features")
            self._features("text_fea pooled_prompt_embed", f["pooled_prompt_embed"], 1, self.pooled_width,
                           "pooled text feature")

    def _latent(self, latent: torch.Tensor) -> None:
        if latent.dim() != 4 or not latent.is_floating_point():
            raise SkipSample("unfit", f"its latent is {_described(latent)}; {self.model} takes one float "
                                      "tensor [C, T, H, W]")
        c = latent.shape[0]
        if self.channels is not None and c != self.channels:
            raise SkipSample("unfit", f"its latent has {c} channels, {self.model} takes {self.channels} "
                                      "(a latent of another VAE?)")
        self._latent_size(*latent.shape[1:], "its latent")
        _finite("latent", latent)

    def _extras(self, sample: Sample) -> None:
        """A precomputed row holds the recipe's extra tensors, each of its declared shape."""
        held, sizes = sample.extras or {}, dict(zip("CTHW", sample.latent.shape))
        for name, shape in self.extras.items():
            if name not in held:
                raise SkipSample("unfit", f"it holds no `{name}`, which {self.model} takes: write it with "
                                          "`pan data precompute` and this run's config")
            want = [sizes.get(d, d) for d in shape]
            got = held[name]
            if got.dim() != len(want) or any(w is not None and w != g for w, g in zip(want, got.shape)):
                raise SkipSample("unfit", f"its {name} is {_described(got)}, {self.model} takes "
                                          f"{['any' if w is None else w for w in want]}")
            _finite(name, got)

    def _clip(self, t: int, h: int, w: int) -> None:
        """A decoded clip: the VAE must encode it, and its latent fit the model."""
        tf, sf = self.temporal_factor, self.spatial_factor
        problems = []
        if t < 1 or (t - 1) % tf:
            problems.append(f"its frame count must be 1 + a multiple of {tf}")
        if h < sf or w < sf or h % sf or w % sf:
            problems.append(f"its height and width must be multiples of {sf}")
        if problems:
            raise SkipSample("unfit", f"it decodes to {t} frame(s) of {w}x{h} (W x H), which the VAE cannot "
                                      f"encode: {'; '.join(problems)}")
        self._latent_size(1 + (t - 1) // tf, h // sf, w // sf, f"it decodes to {t} frame(s) of {w}x{h}, whose latent")

    def _latent_size(self, t: int, h: int, w: int, what: str) -> None:
        ut, uh, uw = self.unit
        if t < ut or h < uh or w < uw or t % ut or h % uh or w % uw:
            raise SkipSample("unfit", f"{what} is {t} x {h} x {w} (T x H x W), not made of whole {ut} x {uh} x "
                                      f"{uw} units that {self.unit_from} need")
        if self.max_side is not None and max(h, w) > self.max_side:
            raise SkipSample("unfit", f"{what} is {t} x {h} x {w} (T x H x W): {self.model} takes at most "
                                      f"{self.max_side} latent cells along H and W")

    def _features(self, name: str, t: torch.Tensor, dims: int, width: int | None, what: str) -> None:
        if t.dim() != dims or not t.is_floating_point():
            raise SkipSample("unfit", f"its {name} is {_described(t)}, not a float tensor of {dims} dims")
        if width is not None and t.shape[-1] != width:
            raise SkipSample("unfit", f"its {name} is {t.shape[-1]} wide, {self.model} takes {what} "
                                      f"{width} wide (features of another text encoder?)")
        _finite(name, t)


def _finite(name: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        nan = int(torch.isnan(t).sum())
        raise SkipSample("not_finite", f"its {name} {_described(t)} holds {nan} NaN and "
                                       f"{int((~torch.isfinite(t)).sum()) - nan} infinite values "
                                       f"of {math.prod(t.shape)}")


def _described(t: torch.Tensor) -> str:
    return f"a {str(t.dtype).removeprefix('torch.')} tensor {list(t.shape)}"
