"""Ulysses context parallel for the Wan transformer: cp 2 equals one process, on real gloo groups.

Each layout builds a tiny WanTransformer, parallelises it as the trainer does (`parallelize_model`:
activation checkpointing, Ulysses on every self-attention, FSDP2 over the cp ranks), shares a whole
micro-batch from cp rank 0 with the recipe's own `share_batch` (video rows strided, caption and image
rows whole on every rank) and runs the recipe's loss and its backward, normalised by the global count
as the trainer does. Its output rows (gathered by `pack.video_index`), loss and full gradients are
compared with one process running the whole batch on the same init.

Cases: T2V (per-sample timesteps), TI2V-style per-token timesteps (the first frame of each clip at 0),
I2V (image rows through the added k/v, whole on every rank), and T2V with full and selective
activation checkpointing under cp. Sample lengths are not multiples of 2, so the shares are uneven.
And through the trainer: train.py launched on 2 ranks with cp_size 2 trains, step by step, the samples
one process trains, with its loss (a tiny T2V folder).

Tolerance, from measured noise rather than fitted: the one-process run in fp32 against the same code in
float64 (`noise`), per case; the cp 2 run (fp32: the same sums in another order) must differ from
float64 by at most NOISE_FACTOR times that. Measured on these cases: fp32 noise 2.8e-7 .. 9.5e-7
(outputs), 1e-8 .. 6e-8 (loss), 1.2e-7 .. 7.2e-6 (gradients); cp 2 within 1.6x of it everywhere (a
self-attention run on each rank's rows alone instead of Ulysses' whole sequences is 1e6x off). "Relative"
is max |a - b| / max |b| over a tensor.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from pan.models.packing import PackInfo
from pan.parallel.context_parallel import ContextParallel
from pan.parallel.dims import ParallelConfig, ParallelDims
from pan.parallel.fsdp import materialize_and_init, parallelize_model
from pan.parallel.mesh import build_mesh, cp_group, cp_rank
from pan.parallel.world import init_world
from pan.recipes.wan.context_parallel import share_batch
from pan.recipes.wan.model import WanConfig, WanTransformer
from pan.recipes.wan.task import ModelInputs, WanBatch, loss_sum
from pan.trainer import TrainerConfig

T2V = dict(patch_size=[1, 2, 2], num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4,
           text_dim=12, freq_dim=16, ffn_dim=48, num_layers=2, cross_attn_norm=True, rope_max_seq_len=64)
CASES = {
    "t2v": dict(config=T2V),
    "per-token-timesteps": dict(config=T2V, per_token=True),
    "i2v": dict(config={**T2V, "in_channels": 2 * 4 + 4, "image_dim": 10, "added_kv_proj_dim": 32}, image_rows=5),
    "t2v-full-ac": dict(config=T2V, checkpointing="full"),
    "t2v-selective-ac": dict(config=T2V, checkpointing="selective"),
}
# Patch grids (t, h, w) and caption rows of the three samples: 18, 10, 9 video rows.
GRIDS, TEXT_LENS = [(2, 3, 3), (1, 2, 5), (3, 1, 3)], [5, 3, 6]
NOISE_FACTOR = 4.0
SEED = 7


def make_inputs(case: dict, dtype: torch.dtype = torch.float32) -> ModelInputs:
    """The whole micro-batch of a case (seeded: the same on every process)."""
    c = WanConfig(**case["config"])
    g = torch.Generator().manual_seed(100)
    pack = PackInfo.build(GRIDS, TEXT_LENS)
    nv, p = pack.num_video_tokens, c.patch_volume
    timesteps = torch.rand(len(GRIDS), generator=g) * 1000
    if case.get("per_token"):   # each clip's first frame at 0, the rest at its sample's t
        first = [torch.arange(t * h * w) < h * w for t, h, w in GRIDS]
        timesteps = torch.cat([torch.where(f, 0.0, float(v)) for f, v in zip(first, timesteps)])
    rows = case.get("image_rows")
    draw = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731 - fp32 draws, then cast
    image = None if rows is None else draw(len(GRIDS), rows, c.image_dim)
    return ModelInputs(x=draw(nv, c.in_channels * p), target=draw(nv, c.output_channels * p),
                       weight=(torch.rand(nv, generator=g) > 0.2).to(dtype), timesteps=timesteps.to(dtype),
                       text=draw(sum(TEXT_LENS), c.text_dim), pack=pack, sample_ids=["a", "b", "c"], samples=3,
                       tokens=nv, packing=1.0, bad_samples=0, sigmas=torch.rand(3, generator=g).to(dtype),
                       image=image)


def moved(model: WanTransformer) -> WanTransformer:
    """Every parameter moved by seeded noise: Wan's init zeroes the output layer and the biases, which
    would leave outputs and most gradients trivially equal."""
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run_layout(case: dict, cp_size: int, world_size: int, dtype: torch.dtype = torch.float32) -> dict:
    """One forward and backward of the case's batch on a layout of `world_size` processes."""
    checkpointing = case.get("checkpointing", "none")
    pcfg = ParallelConfig(cp_size=cp_size, enable_gradient_checkpointing=checkpointing != "none",
                          use_dedicated_gradient_checkpointing=checkpointing == "selective")
    tcfg = TrainerConfig(dtype="fp32", seed=SEED)
    dims = ParallelDims.from_config(pcfg, world_size, world_size)
    world = init_world()
    mesh = build_mesh(dims, world)
    with torch.device("meta"):
        model = WanTransformer(WanConfig(**case["config"]), attention_backend="sdpa")
    model = moved(materialize_and_init(model, world.device, SEED, mesh)).to(dtype)
    model = parallelize_model(model, mesh, dims, pcfg, tcfg)
    cp = None if mesh is None else ContextParallel(cp_rank(mesh), dims.cp, cp_group(mesh))
    whole = make_inputs(case, dtype)
    batch = WanBatch(parts={"transformer": whole}, sample_ids=whole.sample_ids, samples=3, tokens=whole.tokens,
                     packing=1.0, bad_samples=0, counted={"transformer": 3})
    shared = share_batch(cp, batch if cp is None or cp.rank == 0 else None)
    mine = shared.parts["transformer"]
    count = torch.tensor(float(mine.weight.sum()) * mine.target.shape[1], dtype=torch.float64)
    if mesh is not None:
        dist.all_reduce(count)
    out = model(mine.x, mine.timesteps, mine.text, mine.pack, image=mine.image)
    loss = loss_sum(model, mine)
    (loss / count.item()).backward()
    total = loss.detach().double()
    if mesh is not None:
        dist.all_reduce(total)
    return {"rows": mine.pack.video_index, "out": out.detach().double(), "loss": (total / count).item(),
            "grads": {n: full(p.grad).double() for n, p in model.named_parameters()},
            "counters": (shared.samples, shared.tokens, shared.counted["transformer"])}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _worker(cases: dict) -> dict:
    world = dist.get_world_size()
    out = {}
    for name, case in cases.items():
        ref32 = run_layout(case, 1, 1)
        ref64 = run_layout(case, 1, 1, torch.float64)
        cp = run_layout(case, world, world)
        out[name] = {"ref32": ref32, "ref64": ref64, "cp": cp}
    return out


def errors(result: dict, reference: dict, rows_by_rank: list[tuple[torch.Tensor, torch.Tensor]] | None) -> dict:
    """Relative differences of outputs, loss and each gradient of `result` from `reference`."""
    out = reference["out"]
    if rows_by_rank is not None:   # a cp run: each rank's rows where they belong
        gathered = torch.zeros_like(out)
        for rows, values in rows_by_rank:
            gathered[rows] = values
    else:
        gathered = result["out"]
    errs = {"out": relative(gathered, out), "loss": abs(result["loss"] - reference["loss"]) / abs(reference["loss"])}
    errs.update({f"grad {n}": relative(result["grads"][n], g) for n, g in reference["grads"].items()})
    return errs


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, world_size=2, args=(CASES,))


@pytest.mark.parametrize("name", list(CASES))
def test_cp2_equals_one_process(results, name):
    ranks = [r[name] for r in results]
    ref32, ref64 = ranks[0]["ref32"], ranks[0]["ref64"]
    noise = errors(ref32, ref64, None)
    cp = errors(ranks[0]["cp"], ref64, [(r["cp"]["rows"], r["cp"]["out"]) for r in ranks])
    # every gradient on every rank is the same full tensor (FSDP's sum over the cp ranks)
    for r in ranks[1:]:
        assert all(torch.equal(r["cp"]["grads"][n], g) for n, g in ranks[0]["cp"]["grads"].items())
    assert sorted(torch.cat([r["cp"]["rows"] for r in ranks]).tolist()) == list(range(ref64["out"].shape[0]))
    bad = {k: (cp[k], noise[k]) for k in cp if not cp[k] <= NOISE_FACTOR * max(noise[k], 1e-9)}
    assert not bad, f"{name}: cp 2 differs from float64 by more than {NOISE_FACTOR}x the fp32 noise: {bad}"
    # the counters stay on cp rank 0, so that sums over the ranks count each sample once
    assert [r["cp"]["counters"] for r in ranks] == [(3, 37, 3), (0, 0, 0)]


def test_shared_rows_are_the_pack_shares():
    """How `share_batch` splits an expert's inputs: video rows strided, text, image and per-sample values
    whole, per-token timesteps with the video rows."""
    from pan.recipes.wan.context_parallel import split_of

    whole = make_inputs(CASES["i2v"])
    assert split_of(whole) == {"x": "video", "target": "video", "weight": "video", "timesteps": "whole",
                               "text": "whole", "sigmas": "whole", "image": "whole"}
    per_token = make_inputs(CASES["per-token-timesteps"])
    assert split_of(per_token)["timesteps"] == "video"


# ------------------------------------------------------------------------------------------------
# Through the trainer: train.py on 2 ranks with cp_size 2 against one process
# ------------------------------------------------------------------------------------------------

def write_config(path, folder, data, out, cp_size: int = 1):
    """A 6-step fp32 run on `folder`'s clips, 2 clips a micro-batch, on `cp_size` ranks of one cp group."""
    import yaml
    from wan_tiny import clip_geometry

    geometry = clip_geometry(folder)
    path.write_text(yaml.safe_dump({
        "recipe": "wan", "model": {"model_path": str(folder)},
        "data": {"video_csv_paths": [str(data)], "resolution_buckets": [f"{geometry['size']}x{geometry['size']}"],
                 "min_frames": geometry["frames"], "max_frames": geometry["frames"],
                 "max_tokens_per_batch": 2 * geometry["tokens"], "max_samples_per_batch": 2,
                 "packed_dataloader_num_workers": 0},
        "training": {"dtype": "fp32", "learning_rate": 1e-3, "max_steps": 6},
        "distributed": {"cp_size": cp_size},
        "output": {"output_dir": str(out), "save_interval": 6, "log_interval": 1, "progress_bar": False}}))
    return path


def test_train_py_cp2_trains_what_one_process_trains(tmp_path):
    """Real launches of train.py on a tiny T2V folder: 2 ranks of one cp group (cp rank 0 reads the data
    and shares each micro-batch, `WanTask.share`) train at every step the samples one process trains,
    with its loss within floating-point noise (launch_utils' default: the same sums in another order)."""
    from wan_tiny import clip_geometry, write_wan_folder

    from launch_utils import assert_continues_the_run, run_to_end
    from pan.config import load_job_config
    from pan.data.precompute import main as precompute_main
    from pan.data.synth import synth_dataset
    from pan.trainer import build_trainer

    folder = write_wan_folder(tmp_path / "model", "t2v")
    geometry = clip_geometry(folder)
    clips = synth_dataset(tmp_path / "clips", num_train=8, num_heldout=0, size=geometry["size"],
                          num_frames=geometry["frames"])["train_csv"]
    assert precompute_main(["--config", str(write_config(tmp_path / "pre.yaml", folder, clips, tmp_path / "unused")),
                            "--out", str(tmp_path / "pre")]) == 0
    data = tmp_path / "pre" / "train.csv"
    one, cp2 = tmp_path / "one", tmp_path / "cp2"
    trainer = build_trainer(load_job_config(["--config", str(write_config(tmp_path / "one.yaml", folder, data, one))],
                                            warn=lambda m: None))
    trainer.fit()
    trainer.close()
    run_to_end(write_config(tmp_path / "cp2.yaml", folder, data, cp2, cp_size=2), tmp_path / "cp2.log", timeout=300)
    assert "(dp_replicate 1 x dp_shard 1 x cp 2)" in (tmp_path / "cp2.log").read_text()   # one cp group
    assert_continues_the_run(one, cp2, first_step=1, last_step=6)
