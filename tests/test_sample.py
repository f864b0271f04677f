"""`pan sample` from a real run: text-to-video, image-to-video and exported weights."""

from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from pan.checkpoint.consolidate import export_checkpoint
from pan.config import load_job_config
from pan.data.synth import synth_dataset
from pan.sampling import add_batch_size_option, prompt_batches, sample_parser
from pan.sampling import main as sample_main
from pan.trainer import build_trainer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    data = synth_dataset(tmp_path_factory.mktemp("data"), num_train=4, num_heldout=1, size=32,
                         num_frames=5)["train_csv"]
    out = tmp_path_factory.mktemp("run")
    job = load_job_config(["--config", str(REPO / "config/tiny_cpu.yaml"), "--output_dir", str(out),
                           "--video_csv_paths", str(data), "--max_steps", "2",
                           "--conditioning_schema", "latent_concat_mask",
                           "--transformer_config_overrides.in_channels", "7",
                           "--sample_num_frames", "5", "--sample_height", "32", "--sample_width", "32"],
                          warn=lambda m: None)
    build_trainer(job).fit()
    return out


def frames_of(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def test_text_to_video_from_a_run_dir(run, tmp_path):
    out = tmp_path / "a.mp4"
    assert sample_main(["--checkpoint", str(run), "--prompt", "a red square moving left",
                        "--prompt", "a blue circle moving up", "--out", str(out), "--steps", "3"]) == 0
    for i in range(2):
        video = frames_of(tmp_path / f"a_{i:02d}.mp4")
        assert video.shape == (5, 32, 32, 3)
        assert (tmp_path / f"a_{i:02d}.gif").is_file()


def test_image_to_video_keeps_the_first_frame(run, tmp_path):
    image = np.zeros((32, 32, 3), np.uint8)
    image[8:24, 8:24] = (230, 40, 40)
    Image.fromarray(image).save(tmp_path / "first.png")
    out = tmp_path / "i2v.mp4"
    assert sample_main(["--checkpoint", str(run / "checkpoint-2"), "--image", str(tmp_path / "first.png"),
                        "--prompt", "a red square moving left", "--out", str(out), "--steps", "3"]) == 0
    first = frames_of(out)[0].astype(int)
    assert np.abs(first - image).mean() < 6  # the given frame comes back (up to video coding)


def test_exported_weights_sample_the_same_video(run, tmp_path):
    export_checkpoint(run / "checkpoint-2", tmp_path / "model.safetensors")
    args = ["--prompt", "a green triangle moving down", "--steps", "3", "--seed", "7"]
    sample_main(["--checkpoint", str(run), "--out", str(tmp_path / "a.mp4"), *args])
    sample_main(["--checkpoint", str(tmp_path / "model.safetensors"), "--config", str(run / "config.yaml"),
                 "--out", str(tmp_path / "b.mp4"), *args])
    assert np.array_equal(frames_of(tmp_path / "a.mp4"), frames_of(tmp_path / "b.mp4"))


def test_fresh_noise_changes_the_steps_and_is_bounded(run, tmp_path):
    """--fresh-noise reaches the sampler: the same seed gives another video than Euler's, the same
    video twice; a share outside [0, 1] is refused."""
    def sample(name: str, *extra: str) -> np.ndarray:
        assert sample_main(["--checkpoint", str(run), "--prompt", "a red square moving left",
                            "--out", str(tmp_path / name), "--steps", "4", *extra]) == 0
        return frames_of(tmp_path / name)

    euler, renoised = sample("e.mp4"), sample("r.mp4", "--fresh-noise", "1")
    assert not np.array_equal(euler, renoised)
    assert np.array_equal(renoised, sample("r2.mp4", "--fresh-noise", "1"))
    with pytest.raises(SystemExit):
        sample_main(["--checkpoint", str(run), "--prompt", "x", "--out", str(tmp_path / "bad.mp4"),
                     "--fresh-noise", "1.5"])


def test_prompt_batches_keep_each_prompts_seed_whatever_the_batch_size():
    prompts = [f"p{i}" for i in range(5)]
    for batch_size in (1, 2, 5, 8):
        batches = list(prompt_batches(prompts, 10, batch_size))
        assert all(len(b) <= batch_size for _, b, _ in batches)
        assert [p for _, b, _ in batches for p in b] == prompts
        assert [s for _, _, seeds in batches for s in seeds] == [10, 11, 12, 13, 14]
        assert [first for first, _, _ in batches] == list(range(0, 5, batch_size))


def test_a_batch_size_below_one_is_refused_by_the_parser(capsys):
    parser = sample_parser("test")
    add_batch_size_option(parser, 3)
    required = ["--checkpoint", "c", "--prompt", "p", "--out", "o.mp4"]
    assert parser.parse_args(required).batch_size == 3
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([*required, "--batch-size", "0"])
    assert exit_info.value.code == 2
    assert "--batch-size: must be >= 1" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# A trained model samples anywhere: without its training data, from a copied run folder, and from
# an exported file that carries its own config.
# ------------------------------------------------------------------------------------------------

ARGS = ["--prompt", "a yellow circle moving right", "--steps", "3", "--seed", "3"]


def relocated_run(run: Path, where: Path, **changes) -> Path:
    """A copy of `run` at `where` whose config.yaml has `changes` (training data moved away, ...)."""
    import shutil

    import yaml

    shutil.copytree(run, where)
    config = yaml.safe_load((where / "config.yaml").read_text())
    for section in config.values():
        if isinstance(section, dict):
            section.update({k: v for k, v in changes.items() if k in section})
    (where / "config.yaml").write_text(yaml.safe_dump(config))
    return where


def test_a_copied_run_without_its_training_data_samples_the_same_video(run, tmp_path):
    moved = relocated_run(run, tmp_path / "elsewhere" / "run", video_csv_paths=[str(tmp_path / "gone.csv")],
                          output_dir=str(tmp_path / "purged" / "run"))
    assert sample_main(["--checkpoint", str(run), "--out", str(tmp_path / "a.mp4"), *ARGS]) == 0
    assert sample_main(["--checkpoint", str(moved), "--out", str(tmp_path / "b.mp4"), *ARGS]) == 0
    assert np.array_equal(frames_of(tmp_path / "a.mp4"), frames_of(tmp_path / "b.mp4"))


def test_an_export_of_the_run_folder_samples_without_a_config(run, tmp_path):
    from pan.export import main_export

    assert main_export([str(run), "--out", str(tmp_path / "model.safetensors")]) == 0  # its latest checkpoint
    assert sample_main(["--checkpoint", str(run), "--out", str(tmp_path / "a.mp4"), *ARGS]) == 0
    assert sample_main(["--checkpoint", str(tmp_path / "model.safetensors"), "--out", str(tmp_path / "b.mp4"),
                        *ARGS]) == 0
    assert np.array_equal(frames_of(tmp_path / "a.mp4"), frames_of(tmp_path / "b.mp4"))
    # A --config given still wins, key by key: one key changes the sampler's default, the rest stays.
    (tmp_path / "two_steps.yaml").write_text("output:\n  sample_steps: 2\n")
    args = ["--prompt", "a yellow circle moving right", "--seed", "3"]  # ARGS without --steps
    assert sample_main(["--checkpoint", str(tmp_path / "model.safetensors"), "--config",
                        str(tmp_path / "two_steps.yaml"), "--out", str(tmp_path / "c.mp4"), *args]) == 0
    assert sample_main(["--checkpoint", str(run), "--out", str(tmp_path / "d.mp4"), *args, "--steps", "2"]) == 0
    assert np.array_equal(frames_of(tmp_path / "c.mp4"), frames_of(tmp_path / "d.mp4"))


def test_a_missing_encoder_is_still_refused_by_name(run, tmp_path):
    import subprocess
    import sys

    moved = relocated_run(run, tmp_path / "run", text_encoder_path=str(tmp_path / "no_encoder"))
    done = subprocess.run([sys.executable, "-m", "pan.cli", "sample", "--checkpoint", str(moved),
                           "--out", str(tmp_path / "a.mp4"), *ARGS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "text_encoder_path" in done.stderr and "Traceback" not in done.stderr


def test_an_unreadable_safetensors_is_refused_by_name(tmp_path):
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    for path in (tmp_path / "broken.safetensors", tmp_path / "missing.safetensors"):
        try:  # refused by the command (exit code) or by its parser (argparse's SystemExit 2)
            code = sample_main(["--checkpoint", str(path), "--out", str(tmp_path / "a.mp4"), *ARGS])
        except SystemExit as e:
            code = e.code
        assert code == 2, path
