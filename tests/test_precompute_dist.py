"""`pan data precompute` in Pyramid-Flow's format under several processes: each encodes its share of
the rows and rank 0 writes the index once all are done, and the output is one process's: the same
files, the same tensor bytes, the same JSONLs and failures.csv."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from dist_utils import run_distributed
from pan.data.precompute import Share
from pan.data.reader import rules_of
from pan.data.sources import read_annotations, read_video_csv
from pan.data.synth import synth_dataset
from pan.recipes.pyramid_flow.precompute import PyramidEncoders, precompute_pyramid
from test_data_jsonl import stand_in_latent, stand_in_text, write_jsonl
from test_data_sources import BIKES, CARPHONE, clips_csv, image_bytes, real_video, small_config

REPO = Path(__file__).resolve().parents[1]
ENCODERS = PyramidEncoders(latent=stand_in_latent, text=stand_in_text)


def written(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by its relative path, as bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def sources_of(annotations: Path, clips: Path) -> list:
    return [read_annotations(annotations), read_video_csv(clips)]


def encode_my_share(annotations: Path, clips: Path, out: Path) -> tuple[int, list[int]]:
    """One process of the distributed precompute (RANK / WORLD_SIZE from the environment)."""
    report = precompute_pyramid(sources_of(annotations, clips), rules_of(small_config()), ENCODERS, out,
                                settings={"vae": {"name": "stand-in"}}, share=Share.from_env())
    return report.written, report.written_by_rank


def test_two_processes_write_what_one_process_writes(tmp_path):
    root = tmp_path / "data"
    (root / "clips").mkdir(parents=True)
    (root / "images").mkdir()
    os.symlink(real_video(BIKES), root / "clips" / "bikes.mp4")
    (root / "images" / "wide.jpg").write_bytes(image_bytes(96, 64, 1))
    (root / "images" / "tall.png").write_bytes(image_bytes(64, 96, 2, "PNG"))
    annotations = write_jsonl(root / "rows.jsonl", [
        {"video": "clips/bikes.mp4", "text": "bikes"},
        {"video": str(real_video(CARPHONE)), "text": "carphone, strided", "frames": [0, 2, 4, 6, 8]},
        {"image": "images/wide.jpg", "text": "a wide image"},
        {"image": "images/tall.png", "text": "a tall image"},                    # vae_shape
        {"video": "clips/nowhere.mp4", "text": "a missing clip"},                # missing_file
        {"video": "clips/bikes.mp4", "text": "the encoder fails here"},          # encode_error
        {"video": "clips/bikes.mp4", "text": "bikes again", "frames": [1, 3, 5]},
    ])
    clips = clips_csv(root / "clips.csv", seconds=3, videos=(CARPHONE,))

    one = tmp_path / "one"
    report = precompute_pyramid(sources_of(annotations, clips), rules_of(small_config()), ENCODERS, one,
                                settings={"vae": {"name": "stand-in"}})
    assert (report.written, len(report.failures)) == (7, 3)

    two = tmp_path / "two"
    (rank0, by_rank), (rank1, _) = run_distributed(encode_my_share, world_size=2, args=(annotations, clips, two))
    # Every other missing row of each source: rank 0 has annotation rows 0, 2, (4), 6 and CSV rows 0, 2;
    # rank 1 annotation rows 1, (3), (5) and CSV row 1 (in brackets: those that fail).
    assert rank0 == rank1 == 7 and by_rank == [5, 2]
    a, b = written(one), written(two)
    assert sorted(a) == sorted(b)
    assert [name for name in a if a[name] != b[name]] == []  # tensors, JSONLs, failures.csv, settings
    # Two files of each row written, the latent of the row whose text failed, the empty caption's.
    assert len([name for name in a if name.endswith(".pt")]) == 2 * 7 + 1 + 1


def test_torchrun_precomputes_a_pyramid_flow_job_as_one_process_does(tmp_path):
    """The command itself, 2 processes under torchrun against 1 (both with one thread, on the CPU):
    the recipe's own encoders (the tiny released text encoders, the identity VAE)."""
    from pyramid_tiny import write_released

    model = write_released(tmp_path / "model")
    clips = synth_dataset(tmp_path / "synth", num_train=5, num_heldout=1, size=16, num_frames=5)["train_csv"]
    with open(clips, "a") as f:
        f.write("nowhere.mp4,a missing clip,,,,\n")
    annotations = write_jsonl(tmp_path / "synth" / "more.jsonl", [
        {"video": f"train/{i:06d}.mp4", "text": f"clip {i} again"} for i in range(3)])
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "recipe": "pyramid_flow",
        "model": {"model_name": "pyramid_flux", "model_path": str(model), "vae_type": "identity"},
        "data": {"video_csv_paths": [str(clips)], "annotation_paths": [str(annotations)],
                 "resolution_buckets": ["16x16"], "min_frames": 5, "max_frames": 5, "frames_mod": 1,
                 "frames_remainder": 0, "packed_dataloader_num_workers": 0},
        "output": {"output_dir": str(tmp_path / "run")}}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    command = ["-m", "pan.cli", "data", "precompute", "--config", str(config)]

    def run(*launcher: str, out: Path) -> str:
        done = subprocess.run([*launcher, *command, "--out", str(out)], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return done.stdout

    single = run(sys.executable, out=tmp_path / "one")
    shared = run("torchrun", "--standalone", "--nproc_per_node", "2", out=tmp_path / "two")
    assert "8 latents written, 0 already there, 1 rows failed" in single, single
    # CSV rows 0, 2, 4 and annotation rows 0, 2 on rank 0; CSV rows 1, 3, (5: missing) and annotation row 1.
    assert "8 latents written (by rank: 5, 3), 0 already there, 1 rows failed" in shared, shared
    a, b = written(tmp_path / "one"), written(tmp_path / "two")
    assert sorted(a) == sorted(b) and "text_fea/empty.pt" in a and "train.jsonl" in a and "more.jsonl" in a
    assert [name for name in a if a[name] != b[name]] == []
