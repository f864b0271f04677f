"""The trace's counter (pan/estimate/trace.py, `StepTrace`) takes shortcuts for speed: a fake tensor's
device queries (most of a fake step's dispatches) are answered without the dispatcher, each
operation's kind is looked up once, and arguments and results are walked without pytree. A fake
step traced with them counts exactly what the plain rules count (every query dispatched, every
leaf found by pytree): the same live bytes, peak, work and operations."""

import collections
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import pan.estimate.trace as trace_module
from pan.estimate.trace import ATTENTION, ATTENTION_BACKWARD, StepTrace, _kind_of, _tensors, fake_copy, fake_mode
from pan.parallel.precision import compute_precision


def pytree_tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class PlainTrace(StepTrace):
    """The counter without its shortcuts."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1.0 if args[0].is_floating_point() else 1
        out = func(*args, **kwargs)
        kind = _kind_of(func)
        self._count(func, args, kwargs, out, kind)
        for t in pytree_tensors(out):
            self._track(t, "attention" if kind in (ATTENTION, ATTENTION_BACKWARD) else "activations")
        return out


class Block(nn.Module):
    def __init__(self, width: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.conv = nn.Conv1d(width, width, 3, padding=1)

    def forward(self, x):                                   # [B, L, width]
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        x = x + self.out(attended)
        values, _ = torch.max(x, dim=-1, keepdim=True)      # a structseq result
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2) * values.sigmoid()
        return torch.cat(torch.split(x, [8, 24], dim=-1)[::-1], dim=-1)


def traced(counter: type[StepTrace], dtype: str) -> StepTrace:
    with torch.device("meta"):
        model = nn.Sequential(Block(), Block())
    trace = counter(grad_scale=0.5)
    with fake_mode():
        twin = fake_copy(model)
        trace.already_live([*twin.parameters(), *twin.buffers()])
        for p in twin.parameters():
            p.register_post_accumulate_grad_hook(lambda p: trace.as_gradient(p.grad))
        x = torch.empty(2, 16, 32, requires_grad=True)
        with trace, compute_precision(dtype, "cpu"):  # as trace_step
            loss = twin(x).float().square().mean()
            loss.backward()
            loss.item()
    return trace


def test_the_shortcuts_count_what_the_plain_rules_count(monkeypatch):
    for dtype in ("fp32", "bf16"):
        fast = traced(StepTrace, dtype)
        with monkeypatch.context() as m:
            m.setattr(trace_module, "_tensors", pytree_tensors)
            plain = traced(PlainTrace, dtype)
        assert dataclasses.asdict(fast.work) == dataclasses.asdict(plain.work), dtype
        assert (fast.peak, fast.at_peak, fast.bytes) == (plain.peak, plain.at_peak, plain.bytes), dtype
        assert fast.work.matmul_flops and fast.work.conv_flops and fast.work.attention_flops
        assert fast.peak > 0


def test_the_walk_finds_the_tensors_pytree_finds():
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    Pair = collections.namedtuple("Pair", "first second")
    trees = [a, (a, [b, None, 2.0], {"x": c, "y": "s"}), [torch.Size([2, 3]), torch.float32, (b,)],
             ((a, b), {"k": [c, (a,)]}), Pair(a, [b, c]), torch.max(torch.ones(2, 3), dim=1),
             collections.OrderedDict(z=c, y=a), (), {"only": 1}]
    for tree in trees:
        assert [id(t) for t in _tensors(tree)] == [id(t) for t in pytree_tensors(tree)], tree
