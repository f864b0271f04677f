"""How a stored state dict fits a model's: which tensors match, which are missing, which the model
does not have, and which have another shape. Written once here and read by every loader: the strict
ones (the causal VAE, LPIPS and the released Pyramid-Flow DiT folders refuse any misfit, naming each
key) and the lenient ones (a warm start, `pan check`'s rows, which copy or report what fits).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn


@dataclass(frozen=True)
class ShapeDiff:
    """How a stored state dict (name -> shape) fits a model's: what loading, `pan check`'s warm
    start, resume and model-folder rows all compare. Lists keep the model's order."""
    matching: list[str]                               # same name, same shape
    differ: list[tuple[str, tuple | None, tuple]]     # name, stored shape (None: missing), model shape
    unexpected: list[str]                             # stored, not in the model

    @classmethod
    def of(cls, stored: dict[str, tuple], model: dict[str, tuple]) -> ShapeDiff:
        have = {n: tuple(s) for n, s in stored.items()}
        want = {n: tuple(s) for n, s in model.items()}
        return cls(matching=[n for n, s in want.items() if have.get(n) == s],
                   differ=[(n, have.get(n), s) for n, s in want.items() if have.get(n) != s],
                   unexpected=[n for n in have if n not in want])

    @classmethod
    def of_tensors(cls, state: dict[str, Tensor], model: nn.Module) -> ShapeDiff:
        """The tensors of `state` against `model.state_dict()` (a meta-device model will do)."""
        return cls.of({k: v.shape for k, v in state.items()}, {k: v.shape for k, v in model.state_dict().items()})

    @property
    def mismatched(self) -> list[tuple[str, tuple, tuple]]:
        return [(n, a, b) for n, a, b in self.differ if a is not None]

    @property
    def missing(self) -> list[str]:
        return [n for n, a, _ in self.differ if a is None]

    def lines(self, missing: str = "not in the source") -> list[str]:
        """`name stored vs model shape` for each tensor that does not fit, in the model's order."""
        return [f"{n} {a} vs model {b}" if a is not None else f"{n} {missing}" for n, a, b in self.differ]

    def named(self) -> str:
        """`missing keys [...]; unknown keys [...]; wrong shapes ['k: (stored) (expected (model))']`,
        each list sorted, empty ones left out: "" when the state dict fits."""
        shapes = sorted(f"{n}: {a} (expected {b})" for n, a, b in self.mismatched)
        return "; ".join(f"{text} {names}" for text, names in (("missing keys", sorted(self.missing)),
                                                               ("unknown keys", sorted(self.unexpected)),
                                                               ("wrong shapes", shapes)) if names)
