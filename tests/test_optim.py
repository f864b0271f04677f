"""Muon, the Muon/AdamW split, learning-rate schedules, clipping, EMA and the optimiser keys."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_utils import run_distributed
from pan.config.core import ConfigError
from pan.optim import (EMA, Muon, OptimConfig, build_optimizer, build_scheduler, lr_at,
                       newton_schulz)
from pan.parallel.fsdp import clip_grad_norm

# --- Muon ------------------------------------------------------------------------------------------


def reference_muon_steps(w0, grads, lr, wd, momentum):
    """Muon written out plainly, in fp64: EMA momentum, Nesterov, 5 quintic NS steps, RMS-matched lr."""
    w, buf = w0.double().clone(), torch.zeros_like(w0, dtype=torch.float64)
    for g in grads:
        g = g.double()
        buf = momentum * buf + (1 - momentum) * g
        u = (1 - momentum) * g + momentum * buf
        x = u.T if u.shape[0] > u.shape[1] else u
        x = x / x.norm()
        for _ in range(5):
            a = x @ x.T
            x = 3.4445 * x - 4.7750 * a @ x + 2.0315 * a @ a @ x
        o = x.T if u.shape[0] > u.shape[1] else x
        w = w * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(w.shape)) * o
    return w


def run_muon(opt_cls, w0, grads, **kwargs):
    p = nn.Parameter(w0.clone())
    opt = opt_cls([p], **kwargs)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("shape", [(48, 32), (32, 48), (40, 40)])
def test_muon_matches_the_reference(shape):
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(shape, generator=g)
    grads = [torch.randn(shape, generator=g) for _ in range(4)]
    ours = run_muon(Muon, w0, grads, lr=0.02, weight_decay=0.1, momentum=0.9)
    ref = reference_muon_steps(w0, grads, lr=0.02, wd=0.1, momentum=0.9)
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=2e-5)
    assert (ours - w0).abs().max() > 0.01  # the steps are not negligible


def test_fused_matrix_steps_like_separate_matrices():
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(48, 32, generator=g)
    grads = [torch.randn(48, 32, generator=g) for _ in range(3)]
    fused = nn.Parameter(w0.clone())
    opt = Muon([{"params": [fused], "row_splits": (16, 32)}], lr=0.02, weight_decay=0.1)
    for grad in grads:
        fused.grad = grad.clone()
        opt.step()
    top = run_muon(Muon, w0[:16], [grad[:16] for grad in grads], lr=0.02, weight_decay=0.1)
    bottom = run_muon(Muon, w0[16:], [grad[16:] for grad in grads], lr=0.02, weight_decay=0.1)
    torch.testing.assert_close(fused.detach(), torch.cat([top, bottom]), rtol=0, atol=1e-6)
    whole = run_muon(Muon, w0, grads, lr=0.02, weight_decay=0.1)
    assert (whole - fused).abs().max() > 1e-3  # orthogonalising the stack is a different step


def test_muon_matches_torch_muon_within_bf16_tolerance():
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(64, 32, generator=g)
    grads = [torch.randn(64, 32, generator=g) for _ in range(3)]
    ours = run_muon(Muon, w0, grads, lr=0.02, weight_decay=0.1)
    theirs = run_muon(torch.optim.Muon, w0, grads, lr=0.02, weight_decay=0.1,
                      adjust_lr_fn="match_rms_adamw")
    rel = ((ours - theirs).norm() / (theirs - w0).norm()).item()
    assert rel < 3e-2  # torch's iteration is bf16 (~1e-2 off), ours fp32 on CPU


def test_newton_schulz_dtype_and_orthogonality():
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    fp32, bf16 = newton_schulz(g), newton_schulz(g, dtype=torch.bfloat16)
    assert fp32.dtype == bf16.dtype == torch.float32
    exact = newton_schulz(g.double(), dtype=torch.float64)
    assert (fp32.double() - exact).abs().max() < 1e-5 < (bf16.double() - exact).abs().max()
    s = torch.linalg.svdvals(exact)
    assert 0.5 < s.min() and s.max() < 1.5  # singular values pushed towards 1 (not exactly: quintic)


def test_muon_rejects_non_matrices():
    with pytest.raises(ValueError, match="2-D"):
        Muon([nn.Parameter(torch.zeros(4))])


# --- the split -------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.to_q, self.kv, self.to_out = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, h):
        k, v = self.kv(h).chunk(2, dim=-1)
        return self.to_out(self.to_q(h) * k.sigmoid() + v)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm1 = nn.Module()
        self.norm1.modulation = nn.Linear(d, 6 * d)
        self.attn = Attention(d)
        self.mlp_norm = nn.LayerNorm(d)

    def forward(self, h):
        h = h + self.attn(self.mlp_norm(h))
        return h + self.norm1.modulation(h)[:, : h.shape[1]]


class PlainStandIn(nn.Module):
    """Names like the Pan transformer's, and no declaration of its hidden matrices."""

    def __init__(self, d=8, layers=2):
        super().__init__()
        self.patch_embed = nn.Linear(12, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.proj_out = nn.Linear(d, 12)
        self.context_type = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        h = self.patch_embed(x)
        for block in self.blocks:
            h = block(h)
        return self.proj_out(h + self.context_type)


class StandIn(PlainStandIn):
    """Declares its hidden matrices (attention weights) as the real model does, k/v fused in one."""

    def hidden_matrices(self):
        d = self.context_type.shape[0]
        return {f"blocks.{i}.attn.{name}.weight": rows for i in range(len(self.blocks))
                for name, rows in (("to_q", (d,)), ("kv", (d, d)), ("to_out", (d,)))}


class NamesStandIn(PlainStandIn):
    """Declares its hidden matrices as a plain set of names."""

    def muon_param_names(self):
        return {f"blocks.{i}.attn.{n}.weight" for i in range(len(self.blocks)) for n in ("to_q", "kv")}


def groups_by_param(opts):
    """{parameter name: (optimizer name, weight decay)} from a built OptimizerSet."""
    return {id(p): (name, group["weight_decay"]) for name, opt in opts.by_name.items()
            for group in opt.param_groups for p in group["params"]}


def test_split_puts_each_kind_where_it_belongs():
    model = StandIn()
    opts, report = build_optimizer(model, OptimConfig(weight_decay=0.05))
    where = groups_by_param(opts)
    named = dict(model.named_parameters())
    expect = {
        "blocks.0.attn.to_q.weight": ("muon", 0.05), "blocks.1.attn.to_out.weight": ("muon", 0.05),
        "blocks.0.attn.kv.weight": ("muon", 0.05), "blocks.0.attn.to_q.bias": ("adamw", 0.0),
        "blocks.0.norm1.modulation.weight": ("adamw", 0.05), "blocks.0.norm1.modulation.bias": ("adamw", 0.0),
        "blocks.1.mlp_norm.weight": ("adamw", 0.0), "patch_embed.weight": ("adamw", 0.05),
        "proj_out.weight": ("adamw", 0.05), "context_type": ("adamw", 0.0),
    }
    for name, placed in expect.items():
        assert where[id(named[name])] == placed, name
    assert len(where) == len(named)  # every parameter in exactly one group
    assert isinstance(opts.by_name["muon"], Muon) and isinstance(opts.by_name["adamw"], torch.optim.AdamW)
    assert all(isinstance(o, torch.optim.Optimizer) for o in opts.optimizers)
    assert "hidden matrices" in report
    assert "muon                   6             512" in report  # 2 x (q, kv, out): 4 8x8 blocks each
    fused = [g for g in opts.by_name["muon"].param_groups if g["row_splits"] is not None]
    assert [g["row_splits"] for g in fused] == [(8, 8)]
    assert [p.shape for p in fused[0]["params"]] == [(16, 8), (16, 8)]


def test_split_from_a_set_of_names():
    model = NamesStandIn()
    where = groups_by_param(build_optimizer(model, OptimConfig())[0])
    named = dict(model.named_parameters())
    assert where[id(named["blocks.1.attn.kv.weight"])][0] == "muon"
    assert where[id(named["blocks.1.attn.to_out.weight"])][0] == "adamw"


def test_split_without_model_names_falls_back_to_2d_and_use_muon_false_is_adamw_only():
    model = PlainStandIn()
    where = groups_by_param(build_optimizer(model, OptimConfig())[0])
    named = dict(model.named_parameters())
    assert where[id(named["patch_embed.weight"])][0] == "muon"
    assert where[id(named["blocks.0.attn.to_q.bias"])][0] == "adamw"
    opts, report = build_optimizer(StandIn(), OptimConfig(use_muon=False))
    assert list(opts.by_name) == ["adamw"] and "use_muon: false" in report


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's import
def test_split_sees_through_checkpoint_and_compile_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = StandIn()
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    model.blocks[1] = torch.compile(model.blocks[1])  # wraps only; nothing compiles here
    named = dict(model.named_parameters())
    assert "blocks.0._checkpoint_wrapped_module.attn.to_q.weight" in named
    where = groups_by_param(build_optimizer(model, OptimConfig())[0])
    assert where[id(named["blocks.0._checkpoint_wrapped_module.attn.to_q.weight"])][0] == "muon"
    assert where[id(named["blocks.1._orig_mod.attn.to_out.weight"])][0] == "muon"
    assert where[id(named["blocks.1._orig_mod.norm1.modulation.weight"])][0] == "adamw"


def test_split_rejects_bad_model_names():
    model = PlainStandIn()
    model.hidden_matrices = lambda: {"blocks.9.attn.to_q.weight": (8,)}
    with pytest.raises(ValueError, match="does not have"):
        build_optimizer(model, OptimConfig())
    model.hidden_matrices = lambda: {"blocks.0.attn.to_q.bias": (8,)}
    with pytest.raises(ValueError, match="non-2-D"):
        build_optimizer(model, OptimConfig())
    model.hidden_matrices = lambda: {"blocks.0.attn.kv.weight": (8, 4)}
    with pytest.raises(ValueError, match="row_splits"):
        build_optimizer(model, OptimConfig())


def train_steps(model, opts, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        (model(torch.randn(5, 12, generator=g)) ** 2).mean().backward()
        opts.step()
        opts.zero_grad()


def test_optimizer_state_round_trip_continues_identically():
    torch.manual_seed(0)
    a = StandIn()
    opts_a, _ = build_optimizer(a, OptimConfig(learning_rate=1e-2))
    train_steps(a, opts_a, 3, seed=0)
    b = StandIn()
    b.load_state_dict(a.state_dict())
    opts_b, _ = build_optimizer(b, OptimConfig(learning_rate=1e-2))
    opts_b.load_state_dict(copy.deepcopy(opts_a.state_dict()))  # as if read from disk: no sharing
    train_steps(a, opts_a, 2, seed=1)
    train_steps(b, opts_b, 2, seed=1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    with pytest.raises(ValueError, match="use_muon"):
        build_optimizer(StandIn(), OptimConfig(use_muon=False))[0].load_state_dict(opts_a.state_dict())


def test_adamw_implementation_runs_the_chosen_update_and_resumes_across_implementations():
    """`adamw_implementation` reaches torch's AdamW: foreach steps bitwise as the for-loop does,
    fused within float rounding; a checkpoint of one implementation resumes on another."""
    runs = {}
    for impl in ("for-loop", "foreach", "fused", "auto"):
        torch.manual_seed(0)
        model = StandIn()
        opts, _ = build_optimizer(model, OptimConfig(learning_rate=1e-2, use_muon=False, adamw_implementation=impl))
        adamw = opts.by_name["adamw"].defaults
        assert (adamw["foreach"], adamw["fused"]) == {"for-loop": (False, False), "foreach": (True, False),
                                                      "fused": (False, True), "auto": (None, None)}[impl]
        train_steps(model, opts, 5, seed=0)
        runs[impl] = (model, opts)
    params = {impl: list(model.parameters()) for impl, (model, _) in runs.items()}
    assert all(torch.equal(a, b) for a, b in zip(params["for-loop"], params["foreach"]))
    assert all(torch.equal(a, b) for a, b in zip(params["for-loop"], params["auto"]))   # CPU: the for-loop
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(params["for-loop"], params["fused"]))

    fused_model, fused_opts = runs["fused"]
    resumed = StandIn()
    resumed.load_state_dict(fused_model.state_dict())
    opts, _ = build_optimizer(resumed, OptimConfig(learning_rate=1e-2, use_muon=False, adamw_implementation="for-loop"))
    opts.load_state_dict(copy.deepcopy(fused_opts.state_dict()))
    train_steps(fused_model, fused_opts, 2, seed=1)
    train_steps(resumed, opts, 2, seed=1)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(fused_model.parameters(), resumed.parameters()))


# --- schedules -------------------------------------------------------------------------------------


def test_schedule_key_points():
    peak = 1e-3
    warm = OptimConfig(learning_rate=peak, warmup_steps=10)
    assert lr_at(0, warm, 100) == pytest.approx(peak / 10)
    assert lr_at(4, warm, 100) == pytest.approx(peak / 2)
    assert lr_at(9, warm, 100) == pytest.approx(peak)
    assert lr_at(99, warm, 100) == pytest.approx(peak)

    cos = OptimConfig(learning_rate=peak, warmup_steps=10, lr_scheduler_type="cosine",
                      lr_decay_floor_ratio=0.1)
    assert lr_at(10, cos, 110) == pytest.approx(peak)
    assert lr_at(60, cos, 110) == pytest.approx(0.55 * peak)  # half way: mean of peak and floor
    assert lr_at(110, cos, 110) == pytest.approx(0.1 * peak)
    assert lr_at(500, cos, 110) == pytest.approx(0.1 * peak)

    lin = OptimConfig(learning_rate=peak, warmup_steps=0, lr_scheduler_type="linear", lr_decay_steps=40)
    assert lr_at(0, lin, 1000) == pytest.approx(peak)
    assert lr_at(10, lin, 1000) == pytest.approx(0.75 * peak)
    assert lr_at(40, lin, 1000) == pytest.approx(0.0)  # decay over lr_decay_steps, not max_steps
    assert lr_at(900, lin, 1000) == 0.0

    lrs = [lr_at(s, cos, 110) for s in range(120)]
    assert all(x <= y for x, y in zip(lrs[:10], lrs[1:11]))  # warmup rises
    assert all(x >= y for x, y in zip(lrs[10:], lrs[11:]))  # decay falls


def test_schedulers_drive_both_optimizers_and_resume():
    cfg = OptimConfig(learning_rate=1e-2, warmup_steps=3, lr_scheduler_type="cosine",
                      lr_decay_floor_ratio=0.2)
    model = StandIn()
    opts, _ = build_optimizer(model, cfg)
    sched = build_scheduler(opts, cfg, max_steps=10)
    for step in range(6):
        expected = lr_at(step, cfg, 10)
        assert sched.get_last_lr()[0] == pytest.approx(expected)
        assert all(g["lr"] == pytest.approx(expected) for o in opts.optimizers for g in o.param_groups)
        opts.step()
        sched.step()
    state = sched.state_dict()
    fresh_opts, _ = build_optimizer(StandIn(), cfg)
    fresh = build_scheduler(fresh_opts, cfg, max_steps=10)
    fresh_opts.load_state_dict(opts.state_dict())
    fresh.load_state_dict(state)
    assert fresh.get_last_lr()[0] == pytest.approx(lr_at(6, cfg, 10))
    fresh_opts.step()
    fresh.step()
    assert fresh.get_last_lr()[0] == pytest.approx(lr_at(7, cfg, 10))


def test_clip_grad_norm():
    model = StandIn()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    norm = math.sqrt(sum(p.numel() for p in model.parameters()))
    assert clip_grad_norm(model, 0.0) == pytest.approx(norm)  # 0 = measure only
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())
    assert clip_grad_norm(model, 2.0) == pytest.approx(norm)
    clipped = math.sqrt(sum(p.grad.square().sum().item() for p in model.parameters()))
    assert clipped == pytest.approx(2.0, rel=1e-4)


# --- EMA -------------------------------------------------------------------------------------------


def test_ema_update_swap_and_state():
    model = nn.Linear(3, 2)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ema = EMA(model, decay=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    for n, p in model.named_parameters():
        torch.testing.assert_close(ema.shadow[n], start[n] + 0.1)
    with ema.swapped_in():
        torch.testing.assert_close(model.weight, start["weight"] + 0.1)
    torch.testing.assert_close(model.weight, start["weight"] + 1.0)

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    other = EMA(nn.Sequential(checkpoint_wrapper(nn.Linear(3, 2))), decay=0.9)
    assert set(other.state_dict()) == {"0.weight", "0.bias"}  # wrapper names are not in the keys
    other = EMA(nn.Linear(3, 2), decay=0.9)
    other.load_state_dict(ema.state_dict())
    torch.testing.assert_close(other.shadow["bias"], start["bias"] + 0.1)
    with pytest.raises(ValueError, match="missing"):
        other.load_state_dict({"weight": ema.shadow["weight"]})


# --- keys ------------------------------------------------------------------------------------------


def job_for(cfg: OptimConfig, explicit: set[str], max_steps: int = 1000):
    return SimpleNamespace(optim=cfg, trainer=SimpleNamespace(max_steps=max_steps), explicit_keys=explicit)


@pytest.mark.parametrize("kwargs, key", [
    (dict(lr_decay_steps=100), "lr_decay_steps"),
    (dict(lr_decay_floor_ratio=0.1), "lr_decay_floor_ratio"),
    (dict(use_muon=False, muon_momentum=0.9), "muon_momentum"),
])
def test_bad_optim_keys_are_rejected(kwargs, key):
    cfg = OptimConfig(**kwargs)
    with pytest.raises(ConfigError) as err:
        cfg.check(job_for(cfg, set(kwargs)))
    assert err.value.key == key


def test_warmup_longer_than_the_run_warns_but_is_accepted(caplog):
    """`--max_steps 2` on a production config is a legitimate smoke test: warned, not refused."""
    import logging

    from pan.logging import get_logger

    cfg = OptimConfig(warmup_steps=2000)
    logger = get_logger()  # pan's logger does not propagate: listen to it directly
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="pan"):
            cfg.check(job_for(cfg, {"warmup_steps"}))
    finally:
        logger.removeHandler(caplog.handler)
    assert "warmup_steps is 2000 but the run has only max_steps 1000" in caplog.text


def test_a_prefixed_part_has_its_own_keys_and_checks():
    """A second part's optimizer keys (a discriminator's) are its own, refused under its own names."""
    from pan.optim import prefixed_optim_config

    Disc = prefixed_optim_config("disc_", "discriminator", "the discriminator's optimizer",
                                 learning_rate=2e-4, adam_beta1=0.5)
    cfg = Disc(disc_adam_beta2=0.9, disc_use_muon=False)
    assert cfg.optim() == OptimConfig(learning_rate=2e-4, adam_beta1=0.5, adam_beta2=0.9, use_muon=False)
    bad = Disc(disc_use_muon=False, disc_muon_momentum=0.5)
    with pytest.raises(ConfigError) as err:
        bad.check(job_for(bad, {"disc_muon_momentum"}))
    assert err.value.key == "disc_muon_momentum"
    with pytest.raises(TypeError):
        prefixed_optim_config("d_", "x", "", not_a_key=1)


@pytest.mark.parametrize("kwargs", [
    dict(lr_scheduler_type="cosine", lr_decay_steps=100, lr_decay_floor_ratio=0.1),
    dict(lr_scheduler_type="constant", lr_decay_floor_ratio=0.0),  # explicit default
    dict(use_muon=True, muon_momentum=0.9),
    dict(warmup_steps=1000),
])
def test_good_optim_keys_are_accepted(kwargs):
    cfg = OptimConfig(**kwargs)
    cfg.check(job_for(cfg, set(kwargs)))


# --- FSDP2: a sharded Muon step equals the unsharded one -----------------------------------------


def _fsdp_sharded_vs_unsharded_errors(adamw_implementation: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cfg = OptimConfig(learning_rate=1e-2, weight_decay=0.1, ema_decay=0.5, max_grad_norm=0.5,
                      adamw_implementation=adamw_implementation)
    torch.manual_seed(0)
    reference = StandIn(d=8)
    sharded = StandIn(d=8)
    sharded.load_state_dict(reference.state_dict())
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in sharded.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)

    outcomes = []
    for model in (reference, sharded):
        opts, _ = build_optimizer(model, cfg)
        ema = EMA(model, cfg.ema_decay)
        norms = []
        g = torch.Generator().manual_seed(0)  # same data on both ranks: averaged grads unchanged
        for _ in range(3):
            (model(torch.randn(5, 12, generator=g)) ** 2).mean().backward()
            norms.append(clip_grad_norm(model, cfg.max_grad_norm))
            opts.step()
            opts.zero_grad()
            ema.update()
        full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
        weights = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
        shadows = {n: full(t).clone() for n, t in ema.state_dict().items()}
        outcomes.append((weights, shadows, norms))
    (ref_w, ref_e, ref_n), (sh_w, sh_e, sh_n) = outcomes
    assert any(type(p).__name__ == "DTensor" for p in sharded.parameters())
    return {"norm": max(abs(a - b) for a, b in zip(ref_n, sh_n)),
              "weights": max((ref_w[n] - sh_w[n]).abs().max().item() for n in ref_w),
              "ema": max((ref_e[n] - sh_e[n]).abs().max().item() for n in ref_e),
              "moved": min((ref_w[n] - initial[n]).abs().max().item() for n in ref_w)}


@pytest.mark.parametrize("adamw_implementation", ["auto", "fused"])
def test_fsdp2_sharded_muon_adamw_clip_and_ema_equal_unsharded(adamw_implementation):
    errors = run_distributed(_fsdp_sharded_vs_unsharded_errors, world_size=2, args=(adamw_implementation,))[0]
    assert errors["norm"] < 1e-5
    assert errors["weights"] < 1e-5
    assert errors["ema"] < 1e-5
    assert errors["moved"] > 1e-3  # every parameter took real steps
