"""pan's fast paths give the plain formulation's results: `RMSNorm` (one autograd function instead of
torch's composite on CPU), `linear_of_cat` (one GEMM per part instead of a concatenation), and the
per-sample `modulate` / `gated_residual` (one output written sample by sample)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from pan.models import layers
from pan.models.layers import Samples, gated_residual, linear_of_cat, modulate
from pan.models.norm import RMSNorm


def _norm_pair(dim: int, seed: int = 0) -> tuple[nn.RMSNorm, RMSNorm]:
    torch.manual_seed(seed)
    ref = nn.RMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_(1.0, 0.1)
    fast = RMSNorm(dim, eps=1e-6)
    fast.load_state_dict(ref.state_dict())
    return ref, fast


def _forward_backward(module: nn.Module, x: Tensor, grad: Tensor) -> list[Tensor]:
    x = x.detach().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = module(x)
    y.backward(grad)
    return [y.detach(), x.grad, module.weight.grad]


@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_matches_torch_within_its_own_fp32_noise(strided):
    """The fast path's output, input gradient and weight gradient are as close to the fp64 truth as
    torch's own fp32 RMSNorm is (within 4x its error), for contiguous inputs and for q/k views of
    a fused projection (strided, as Pan's single-stream blocks pass them)."""
    ref, fast = _norm_pair(64)
    base = torch.randn(300, 3, 4, 64, dtype=torch.float64)
    x64 = base[:, 1] if strided else base[:, 0].contiguous()
    grad64 = torch.randn(x64.shape, dtype=torch.float64)
    truth = _forward_backward(ref.double(), x64, grad64)
    ref.float()
    torch_fp32 = _forward_backward(ref, x64.float(), grad64.float())
    pan_fp32 = _forward_backward(fast, x64.float(), grad64.float())
    for name, t, p, q in zip(("output", "input grad", "weight grad"), truth, torch_fp32, pan_fp32):
        torch_err = (p.double() - t).abs().max().item()
        pan_err = (q.double() - t).abs().max().item()
        assert pan_err <= 4 * max(torch_err, 1e-7 * t.abs().max().item()), (name, pan_err, torch_err)


def test_rms_norm_gradcheck_fp64():
    _, fast = _norm_pair(16)
    fast.double()
    x = torch.randn(5, 2, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: fast(x), (x, fast.weight))


def test_rms_norm_bf16_takes_torch_path():
    ref, fast = _norm_pair(32)
    x = torch.randn(10, 32).bfloat16()
    assert torch.equal(fast.bfloat16()(x), ref.bfloat16()(x))


def _linear_pair(seed: int = 0) -> tuple[nn.Linear, Tensor, Tensor]:
    torch.manual_seed(seed)
    return nn.Linear(8 + 24, 6), torch.randn(50, 8), torch.randn(50, 24)


def _grads(fn, linear: nn.Module, a: Tensor, b: Tensor) -> list[Tensor]:
    a, b = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    linear.zero_grad(set_to_none=True)
    out = fn(linear, a, b)
    out.backward(torch.ones_like(out))
    return [out.detach(), a.grad, b.grad] + [p.grad for p in linear.parameters()]


@pytest.mark.parametrize("bias", [True, False])
def test_linear_of_cat_equals_linear_of_concatenation(bias):
    linear, a, b = _linear_pair()
    if not bias:
        linear = nn.Linear(32, 6, bias=False)
    linear.double()
    direct = _grads(lambda m, a, b: m(torch.cat([a, b], dim=-1)), linear, a, b)
    split = _grads(linear_of_cat, linear, a, b)
    for d, s in zip(direct, split):
        torch.testing.assert_close(s, d, rtol=1e-12, atol=1e-12)


def test_linear_of_cat_calls_a_wrapped_linear_on_the_concatenation():
    """A peft LoRA layer (any module other than a plain nn.Linear) is called, so its adapters act."""
    calls = []

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.base = nn.Linear(32, 6)

        def forward(self, x):
            calls.append(x.shape)
            return self.base(x) + 1.0

    wrapped, (_, a, b) = Wrapped(), _linear_pair()
    out = linear_of_cat(wrapped, a, b)
    assert calls == [torch.Size([50, 32])]
    torch.testing.assert_close(out, wrapped.base(torch.cat([a, b], -1)) + 1.0)


@pytest.mark.parametrize("path", ["gather", "loop"])
@pytest.mark.parametrize("op", ["modulate", "gated_residual"])
def test_per_sample_ops_equal_the_expanded_rows(op, path, monkeypatch):
    """modulate / gated_residual with per-sample rows (small samples: one gather; large ones: one
    output written sample by sample) give the values and gradients of the same op on the rows
    expanded to every token (a sample of no local rows included, as on a context-parallel rank)."""
    monkeypatch.setattr(layers, "GATHER_ELEMENTS_PER_SAMPLE", 10**9 if path == "gather" else 0)
    counts = (3, 0, 5, 2)
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    samples = Samples(counts, index)
    torch.manual_seed(0)
    x, y = torch.randn(10, 6, dtype=torch.float64), torch.randn(10, 6, dtype=torch.float64)
    a, b = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)

    def run(per_sample: bool) -> list[Tensor]:
        leaves = [t.clone().requires_grad_() for t in (x, y, a, b)]
        lx, ly, la, lb = leaves
        if op == "modulate":
            out = (modulate(lx, la, lb, samples) if per_sample
                   else torch.addcmul(la[index], lx, lb[index]))
        else:
            out = (gated_residual(lx, la, ly, samples) if per_sample
                   else torch.addcmul(lx, la[index], ly))
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    for got, want in zip(run(True), run(False)):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", ["modulate", "gated_residual"])
def test_per_sample_ops_gather_and_loop_give_the_same_bits(op, monkeypatch):
    """The two ways of applying per-sample rows (chosen by size) compute the same fp32 values and
    gradients to the bit: the choice never changes a run's numbers."""
    counts = (37, 0, 52, 61, 18)
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    samples = Samples(counts, index)
    torch.manual_seed(0)
    x, y = torch.randn(sum(counts), 128), torch.randn(sum(counts), 128)
    a, b = torch.randn(len(counts), 128), torch.randn(len(counts), 128)

    def run(threshold: int) -> list[Tensor]:
        monkeypatch.setattr(layers, "GATHER_ELEMENTS_PER_SAMPLE", threshold)
        leaves = [t.clone().requires_grad_() for t in (x, y, a, b)]
        lx, ly, la, lb = leaves
        out = modulate(lx, la, lb, samples) if op == "modulate" else gated_residual(lx, la, ly, samples)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    for gathered, looped in zip(run(10**9), run(0)):
        assert (gathered is None and looped is None) or torch.equal(gathered, looped)
