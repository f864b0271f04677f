"""The `pyramid_flow` recipe (full-sequence spatial-pyramid training) end to end on CPU: a tiny
released-layout miniFLUX folder with tiny T5 / CLIP text encoders trains on the demo's synthetic
videos, its loss falls, it survives SIGKILL on 2 processes bit-identically, exports back to the
released layout, and samples with `pan sample`; the fixture checkpoint folder trains through the
fixture causal VAE and exports as it was given; the same recipe trains pan's own transformer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from launch_utils import assert_continues_the_run, consumed, kill_after_step, launch, run_to_end
from pan.export import main_export
from pan.config import ConfigError
from pan.data.synth import synth_dataset
from pan.models.pyramid_flux import PyramidFluxTransformer
from pan.models.pyramid_io import load_pretrained, read_weights
from pan.trainer import build_trainer
from pyramid_reference import latent_channels, needs_reference
from pyramid_tiny import (FIXTURE_DIT, VAE_CLIP_DATA, VARIANT, batch_loss, causal_vae_keys, final_weights, load,
                          released_config)
from pyramid_tiny import fixture_model_path_fixture, released_fixture, vae_videos_fixture  # noqa: F401


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return synth_dataset(tmp_path_factory.mktemp("synth"), num_train=24, num_heldout=2, size=16,
                         num_frames=5)["train_csv"]


def write_config(path: Path, released: Path, videos: Path, output_dir: Path, **sections) -> Path:
    cfg = {"recipe": "pyramid_flow",
           "model": {"model_name": "pyramid_flux", "model_path": str(released), "vae_type": "identity",
                     **sections.pop("model", {})},
           "training": {"learning_rate": 2e-3, "max_steps": 6, "dtype": "fp32", "use_muon": False,
                        **sections.pop("training", {})},
           "data": {"video_csv_paths": [str(videos)], "resolution_buckets": ["16x16"], "min_frames": 5,
                    "max_frames": 5, "frames_mod": 1, "frames_remainder": 0, "max_tokens_per_batch": 400,
                    "max_samples_per_batch": 4, "packed_dataloader_num_workers": 0,
                    **sections.pop("data", {})},
           "output": {"output_dir": str(output_dir), "save_interval": 2, "log_interval": 1,
                      "progress_bar": False, **sections.pop("output", {})},
           **sections}
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_config_refusals_name_the_key(tmp_path, released, data):
    config = write_config(tmp_path / "p.yaml", released, data, tmp_path / "run")
    job = load(config)
    assert job.recipe == "pyramid_flow" and job.attention_heads() == 2
    for extra, key in ((["--model_variant", "diffusion_transformer_768p"], "model_variant"),
                       (["--model_name", "pyramid_mmdit"], "model_name: pyramid_flux"),  # a flux folder
                       (["--transformer_config_overrides.num_layers", "2"], "transformer_config_overrides"),
                       (["--attention_backend", "flash"], "attention_backend"),
                       (["--sample_steps", "[10, 10]"], "sample_steps"),
                       (["--cp_size", "4"], "cp_size"),
                       (["--prediction_sigma_min", "0.1"], "prediction_sigma_min")):  # velocity
        with pytest.raises(ConfigError) as err:
            load(config, *extra)
        assert key in str(err.value), (extra, str(err.value))


def test_trains_its_loss_falls_and_exports_the_released_layout(tmp_path, released, data):
    run = tmp_path / "run"
    config = write_config(tmp_path / "p.yaml", released, data, run,
                          training={"max_steps": 60, "learning_rate": 3e-3},
                          output={"save_interval": 60, "log_interval": 10})
    trainer = build_trainer(load(config))
    # It starts from the released weights, not from an init.
    start = read_weights(released / VARIANT)
    assert all(torch.equal(p.detach(), start[n]) for n, p in trainer.model.named_parameters())
    trainer.fit()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"], [round(r["loss"], 4) for r in rows]

    out = tmp_path / "export" / VARIANT
    assert main_export([str(run / "checkpoint-60"), "--format", "pyramid_flow", "--out", str(out)]) == 0
    exported = load_pretrained(out, PyramidFluxTransformer)
    for name, p in trainer.model.named_parameters():
        assert torch.equal(exported.state_dict()[name], p.detach()), name
    assert json.loads((out / "config.json").read_text()).keys() == \
        json.loads((released / VARIANT / "config.json").read_text()).keys()
    # The export is a model_path of its own: a new run starts from it.
    for folder in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"):
        (out.parent / folder).symlink_to(released / folder)
    again = build_trainer(load(config, "--model_path", str(out.parent), "--output_dir", str(tmp_path / "r2")))
    assert all(torch.equal(p.detach(), exported.state_dict()[n]) for n, p in again.model.named_parameters())


def test_compiled_blocks_train_as_the_eager_ones(tmp_path, released, data, monkeypatch):
    """`compile_transformer: true` (each block compiled; attention outside the graphs) trains the
    released miniFLUX with the eager run's losses and weights. The graphs run through AOT autograd
    without inductor's code generation (which costs a minute and a half here for 3 steps);
    benchmarks/pyramid_step.py runs the real thing and reports its agreement with the original."""
    compile_block, compiled = torch.nn.Module.compile, []
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self: compiled.append(self) or compile_block(self, backend="aot_eager"))
    torch._dynamo.reset()
    losses, weights = {}, {}
    for mode in ("eager", "compiled"):
        run = tmp_path / mode
        config = write_config(tmp_path / f"{mode}.yaml", released, data, run,
                              training={"max_steps": 3, "compile_transformer": mode == "compiled"},
                              output={"save_interval": 3})
        trainer = build_trainer(load(config))
        assert len(compiled) == (len(trainer.model.fsdp_blocks()) if mode == "compiled" else 0)
        trainer.fit()
        trainer.close()
        losses[mode] = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        weights[mode] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert len(losses["eager"]) == 3
    torch.testing.assert_close(losses["compiled"], losses["eager"], rtol=1e-5, atol=0)
    for name, value in weights["eager"].items():
        torch.testing.assert_close(weights["compiled"][name], value, rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


@needs_reference
def test_the_fixture_checkpoint_trains_through_the_fixture_vae_and_exports_as_given(tmp_path, fixture_model_path,
                                                                                     vae_videos):
    """The original's miniFLUX folder and causal VAE as a release: synthetic clips of 2 latent frames
    (the public set: 64x64 px, 9 frames -> 16 x 2 x 8 x 8 latents) are encoded online, trained on, and
    exported as that folder again."""
    run = tmp_path / "run"
    config = write_config(tmp_path / "fx.yaml", fixture_model_path, vae_videos, run,
                          model=causal_vae_keys(fixture_model_path), data=VAE_CLIP_DATA,
                          training={"max_steps": 8, "learning_rate": 3e-3}, output={"save_interval": 8})
    trainer = build_trainer(load(config))
    assert trainer.task.vae.latent_channels == latent_channels() == trainer.model.latent_channels
    held, _ = trainer.next_micro_batches()  # a batch whose loss is measured before and after training
    before = batch_loss(trainer, held)
    trainer.fit()
    # The fixture's random weights start far off (loss ~1.9 with its outputs); 8 steps at least halve it.
    assert batch_loss(trainer, held) < 0.5 * before

    out = tmp_path / "export" / VARIANT
    assert main_export([str(run / "checkpoint-8"), "--format", "pyramid_flow", "--out", str(out)]) == 0
    assert released_config(out) == released_config(FIXTURE_DIT)
    exported, given = load_pretrained(out, PyramidFluxTransformer).state_dict(), read_weights(FIXTURE_DIT)
    for name, p in trainer.model.named_parameters():
        assert torch.equal(exported[name], p.detach()), name      # the trained weights, bit for bit
        assert not torch.equal(exported[name], given[name]), name  # every tensor trained


def test_pan_sample_generates_from_a_pyramid_checkpoint(tmp_path, released, data):
    from pan.sampling import main as sample_main

    run = tmp_path / "run"
    build_trainer(load(write_config(tmp_path / "p.yaml", released, data, run,
                                    training={"max_steps": 2}))).fit()
    from pan.runtime.plot import draw, plot_run, read_records

    assert plot_run(run).is_file()  # pan plot of a Pyramid-Flow run: its loss on a log axis
    assert draw(read_records(run / "metrics.jsonl")).axes[0].get_yscale() == "log"
    out = tmp_path / "video.mp4"
    assert sample_main(["--checkpoint", str(run / "checkpoint-2"), "--prompt", "a red square moving left",
                        "--out", str(out), "--num-frames", "5", "--height", "16", "--width", "16",
                        "--steps", "2", "--guidance-scale", "3"]) == 0
    import av
    with av.open(str(out)) as f:
        frames = [fr for fr in f.decode(video=0)]
    assert len(frames) == 5 and frames[0].width == 16
    # --batch-size: prompts sampled together are the clips each gets alone (its seed's draws; up to
    # GEMV-against-GEMM rounding of the conditioning rows), and differ from each other.
    clips = {}
    for size in (1, 2):
        assert sample_main(["--checkpoint", str(run / "checkpoint-2"), "--prompt", "a red square moving left",
                            "--prompt", "a blue circle moving up", "--batch-size", str(size),
                            "--out", str(tmp_path / f"b{size}" / "v.mp4"), "--num-frames", "5", "--height", "16",
                            "--width", "16", "--steps", "2", "--guidance-scale", "3"]) == 0
        clips[size] = []
        for i in range(2):
            with av.open(str(tmp_path / f"b{size}" / f"v_{i:02d}.mp4")) as f:
                clips[size].append(torch.stack([torch.from_numpy(fr.to_ndarray(format="rgb24"))
                                                for fr in f.decode(video=0)]).float())
    assert all((a - b).abs().max() <= 2 for a, b in zip(clips[1], clips[2]))
    assert (clips[1][0] - clips[1][1]).abs().max() > 20

    # The placements Pan's sampler has: blocks offloaded (the same clip), bf16 (the DiT's forward
    # under autocast: a clip near the fp32 one), and sharded over the processes of a torchrun launch
    # (every process samples, rank 0 writes: the same clip as one process).
    common = ["--checkpoint", str(run / "checkpoint-2"), "--prompt", "a red square moving left",
              "--num-frames", "5", "--height", "16", "--width", "16", "--steps", "2", "--guidance-scale", "3"]
    placed = {}
    for name, extra in {"fp32": [], "offload": ["--offload"], "bf16": ["--dtype", "bf16"]}.items():
        assert sample_main([*common, "--out", str(tmp_path / name / "v.mp4"), *extra]) == 0
        placed[name] = decoded(tmp_path / name / "v.mp4")
    done = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "2",
                           "-m", "pan.cli", "sample", *common, "--out", str(tmp_path / "sharded" / "v.mp4")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.equal(placed["offload"], placed["fp32"])
    assert torch.equal(decoded(tmp_path / "sharded" / "v.mp4"), placed["fp32"])
    assert 0 < (placed["bf16"] - placed["fp32"]).abs().mean() < 8

    # Anywhere: with its training data gone, and from an export that carries its config (no --config).
    (tmp_path / "moved").mkdir()
    shutil.copytree(run, tmp_path / "moved" / "run")
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["data"]["video_csv_paths"] = [str(tmp_path / "gone.csv")]
    (tmp_path / "moved" / "run" / "config.yaml").write_text(yaml.safe_dump(config))
    moved = [*common[2:], "--checkpoint", str(tmp_path / "moved" / "run")]
    assert sample_main([*moved, "--out", str(tmp_path / "moved.mp4")]) == 0
    assert main_export([str(run), "--out", str(tmp_path / "dit.safetensors")]) == 0
    exported = [*common[2:], "--checkpoint", str(tmp_path / "dit.safetensors")]
    assert sample_main([*exported, "--out", str(tmp_path / "exported.mp4")]) == 0
    assert torch.equal(decoded(tmp_path / "moved.mp4"), placed["fp32"])
    assert torch.equal(decoded(tmp_path / "exported.mp4"), placed["fp32"])


def decoded(path: Path) -> torch.Tensor:
    import av
    with av.open(str(path)) as f:
        return torch.stack([torch.from_numpy(fr.to_ndarray(format="rgb24")) for fr in f.decode(video=0)]).float()


def test_x_prediction_trains_on_x0_samples_and_refuses_the_released_export(tmp_path, released, data, capsys):
    """prediction_type: sample: the DiT is trained on x0 at each stage's resolution (the loss differs from
    the velocity run's from the first step), `pan sample` reads its output as x0, and the
    export to the released layout, whose pipeline would read it as the velocity, is refused."""
    from pan.sampling import main as sample_main

    losses = {}
    for prediction in ("velocity", "sample"):
        run = tmp_path / prediction
        config = write_config(tmp_path / f"{prediction}.yaml", released, data, run,
                              training={"max_steps": 2}, diffusion={"prediction_type": prediction})
        build_trainer(load(config)).fit()
        losses[prediction] = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert losses["sample"][0] != pytest.approx(losses["velocity"][0], rel=1e-3), losses
    run = tmp_path / "sample"
    videos = {}
    for checkpoint_config, name in ((None, "x0"), ("velocity", "read as velocity")):
        if checkpoint_config:  # the same weights under a velocity config: another clip
            job = yaml.safe_load((run / "config.yaml").read_text())
            job["diffusion"].pop("prediction_type")
            (run / "config.yaml").write_text(yaml.safe_dump(job))
        out = tmp_path / f"{name}.mp4"
        assert sample_main(["--checkpoint", str(run / "checkpoint-2"), "--prompt", "a red square moving left",
                            "--out", str(out), "--num-frames", "5", "--height", "16", "--width", "16",
                            "--steps", "2", "--guidance-scale", "1"]) == 0
        videos[name] = out.read_bytes()
    assert videos["x0"] != videos["read as velocity"]
    job = yaml.safe_load((run / "config.yaml").read_text())
    job["diffusion"]["prediction_type"] = "sample"
    (run / "config.yaml").write_text(yaml.safe_dump(job))
    assert main_export([str(run / "checkpoint-2"), "--format", "pyramid_flow", "--out",
                        str(tmp_path / "export")]) == 2
    assert "prediction_type sample" in capsys.readouterr().err and not (tmp_path / "export").exists()


def test_the_same_recipe_trains_pans_transformer(tmp_path, released, data):
    overrides = {"in_channels": 3, "out_channels": 3, "patch_size": [1, 2, 2], "hidden_size": 32,
                 "num_attention_heads": 2, "num_layers": 1, "num_single_layers": 0,
                 "num_refiner_layers": 1, "mlp_ratio": 2.0, "text_mlp_ratio": 2.0, "refiner_mlp_ratio": 2.0,
                 "text_embed_dim": 24, "rope_axes_dim": [4, 6, 6]}
    run = tmp_path / "run"
    job = load(write_config(tmp_path / "p.yaml", released, data, run,
                            model={"model_name": "pan", "transformer_config_overrides": overrides},
                            training={"max_steps": 20, "learning_rate": 3e-3}))
    trainer = build_trainer(job)
    assert type(trainer.model).__name__ == "PanForPyramid"
    losses = []
    for _ in range(20):
        batches, _ = trainer.next_micro_batches()
        losses.append(trainer.train_step(batches)["loss"])
    assert sum(losses[-5:]) < sum(losses[:5]), losses


@pytest.mark.parametrize("distributed", [{"cp_size": 1}, {"cp_size": 2}], ids=["dp2", "cp2"])
def test_two_processes_killed_and_resumed_bit_identically(tmp_path, released, data, distributed):
    steps = 10  # the kill after step 3 lands well before the end (a step takes > 0.1 s)
    straight = write_config(tmp_path / "straight.yaml", released, data, tmp_path / "straight",
                            distributed=distributed, training={"max_steps": steps})
    run_to_end(straight, tmp_path / "straight.log")
    killed_dir = tmp_path / "killed"
    killed = write_config(tmp_path / "killed.yaml", released, data, killed_dir, distributed=distributed,
                          training={"max_steps": steps})
    log = tmp_path / "killed.log"
    kill_after_step(launch(killed, log), killed_dir, 3, log)
    run_to_end(killed, log)
    assert "resuming from checkpoint-" in log.read_text()
    reference, resumed = final_weights(tmp_path / "straight", steps), final_weights(killed_dir, steps)
    for folder in reference:
        for key, value in reference[folder].items():
            assert torch.equal(value, resumed[folder][key]), (folder, key)
    assert consumed(tmp_path / "straight") == consumed(killed_dir)
    if distributed["cp_size"] == 1:
        # Elastic: checkpoint-6 of 2 data-parallel ranks continues on 1 with 2 micro-batches a step
        # (the same 2 data shards): the same samples, draws and stage rotation at every step.
        elastic = tmp_path / "elastic"
        shutil.copytree(tmp_path / "straight" / "checkpoint-6", elastic / "checkpoint-6")
        config = write_config(tmp_path / "elastic.yaml", released, data, elastic,
                              training={"max_steps": steps, "gradient_accumulation_steps": 2})
        run_to_end(config, tmp_path / "elastic.log", world_size=1)
        assert "each of the 2 data shards continues exactly" in (tmp_path / "elastic.log").read_text()
        assert_continues_the_run(tmp_path / "straight", elastic, first_step=7, last_step=steps)
