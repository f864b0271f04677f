"""The demo's analyser: right on real clips, robust to mild damage, and says "unknown" for noise."""

import csv
import json

import numpy as np
import pytest
import torch
import yaml
from scipy import ndimage

from pan.data.synth import DIRECTIONS, PALETTE, synth_dataset
from pan.demo.analyser import (STATIC, UNKNOWN, analyse_video, format_table, load_video, main, score_videos,
                      to_unit_frames)
from pan.demo.kit import SHAPE_SIZE
from pan.recipes.pan.demo import DEFAULT_CONFIG

OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """(decoded videos [T, H, W, 3] uint8, captions, paths) of 90 training + 30 held-out clips."""
    out = tmp_path_factory.mktemp("synth")
    paths = synth_dataset(out, num_train=90, num_heldout=30, size=32, num_frames=9, fps=8, seed=7)
    rows = []
    for key in ("train_csv", "heldout_csv"):
        with open(paths[key], newline="") as f:
            rows += list(csv.DictReader(f))
    files = [out / row["path"] for row in rows]
    return [load_video(p) for p in files], [row["caption"] for row in rows], files, paths


def test_generator_clips_decoded_from_mp4_score_at_least_99_percent(clips):
    _, captions, files, _ = clips
    scores = score_videos(files, captions)  # MP4 paths: decoded by the analyser with PyAV
    assert scores["num_videos"] == 120
    assert scores["colour_accuracy"] >= 0.99 and scores["direction_accuracy"] >= 0.99
    assert scores["joint_accuracy"] >= 0.99
    assert scores["shape_accuracy"] >= 0.95


def test_the_demo_geometry_keeps_every_attribute_readable(tmp_path):
    """The demo's own clips (its frame size, frame count and shape size), decoded from MP4."""
    output = yaml.safe_load(DEFAULT_CONFIG.read_text())["output"]
    paths = synth_dataset(tmp_path, num_train=90, num_heldout=30, size=output["sample_height"],
                          num_frames=output["sample_num_frames"], seed=5, shape_size=SHAPE_SIZE)
    rows = []
    for key in ("train_csv", "heldout_csv"):
        with open(paths[key], newline="") as f:
            rows += list(csv.DictReader(f))
    scores = score_videos([tmp_path / row["path"] for row in rows], [row["caption"] for row in rows])
    assert scores["colour_accuracy"] >= 0.99 and scores["direction_accuracy"] >= 0.99
    assert scores["shape_accuracy"] >= 0.97 and scores["joint_accuracy"] >= 0.97


def test_wrong_prompts_score_zero(clips):
    """The analyser reads pixels, not prompts: swapped colours and reversed motion all fail."""
    videos, captions, _, _ = clips
    colours = list(PALETTE)
    wrong = []
    for caption in captions:
        _, colour, shape, _, direction = caption.split()
        other = colours[(colours.index(colour) + 1) % len(colours)]
        wrong.append(f"a {other} {shape} moving {OPPOSITE[direction]}")
    scores = score_videos(videos, wrong)
    assert scores["colour_accuracy"] == 0.0 and scores["direction_accuracy"] == 0.0


def damage(video: np.ndarray, rng: np.random.Generator, blur: float, noise: float) -> np.ndarray:
    frames = ndimage.gaussian_filter(video.astype(np.float32) / 255.0, (0, blur, blur, 0))
    return np.clip(frames + rng.normal(0.0, noise, frames.shape), 0.0, 1.0).astype(np.float32)


@pytest.mark.parametrize("blur, noise", [(0.0, 0.05), (1.0, 0.0), (1.0, 0.05)])
def test_robust_to_mild_noise_and_blur(clips, blur, noise):
    videos, captions, _, _ = clips
    rng = np.random.default_rng(0)
    scores = score_videos([damage(v, rng, blur, noise) for v in videos], captions)
    assert scores["colour_accuracy"] >= 0.97 and scores["direction_accuracy"] >= 0.97


def test_noise_and_empty_videos_are_unknown():
    rng = np.random.default_rng(1)
    videos = [rng.random((9, 32, 32, 3), dtype=np.float32) for _ in range(5)]  # uniform colour noise
    videos += [np.clip(rng.normal(0.5, 0.2, (9, 32, 32, 3)), 0, 1).astype(np.float32)]  # gaussian
    videos += [np.repeat(rng.random((9, 32, 32, 1), dtype=np.float32), 3, axis=-1)]  # grey noise
    videos += [np.zeros((9, 32, 32, 3), np.uint8)]  # nothing at all
    videos += [(rng.random((9, 32, 32, 3)) * 0.1).astype(np.float32)]  # faint noise, no object
    for video in videos:
        seen = analyse_video(video)
        assert (seen.colour, seen.direction, seen.shape) == (UNKNOWN, UNKNOWN, UNKNOWN)
    scores = score_videos(videos, ["a red square moving left"] * len(videos))
    assert scores["colour_accuracy"] == scores["direction_accuracy"] == 0.0


def square_video(path_xy, colour=(1.0, 0.1, 0.1), side=8, size=(40, 48)) -> np.ndarray:
    """A square with its top-left corner at each (x, y) of `path_xy`, drawn with plain numpy."""
    frames = np.zeros((len(path_xy), *size, 3), np.float32)
    for t, (x, y) in enumerate(path_xy):
        frames[t, y:y + side, x:x + side] = colour
    return frames


def test_hand_drawn_clips_on_a_non_square_frame():
    down = analyse_video(square_video([(20, 4 + 3 * t) for t in range(9)], colour=(0.9, 0.9, 0.1)))
    assert (down.colour, down.direction, down.shape) == ("yellow", "down", "square")
    assert down.dy == pytest.approx(24 / 40, abs=0.02) and abs(down.dx) < 0.01
    # A dim colour is still its colour: brightness is divided out before the palette look-up.
    left = analyse_video(square_video([(36 - 3 * t, 10) for t in range(9)], colour=(0.1, 0.15, 0.45)))
    assert (left.colour, left.direction) == ("blue", "left")
    # A grey background, as a half-trained model may paint it, is estimated and subtracted.
    on_grey = square_video([(4 + 3 * t, 10) for t in range(9)], colour=(0.3, 0.85, 0.3))
    on_grey[on_grey.max(axis=-1) == 0] = 0.25
    assert (analyse_video(on_grey).colour, analyse_video(on_grey).direction) == ("green", "right")


def test_joint_accuracy_needs_every_property_the_prompt_names():
    video = square_video([(36 - 3 * t, 10) for t in range(9)])  # a red square moving left
    prompts = ["a red square moving left", "a red circle moving left", "a red thing moving left",
               "a blue square moving left", "something"]
    rows = score_videos([video] * len(prompts), prompts)["per_video"]
    assert [row["joint_ok"] for row in rows] == [True, False, True, False, None]
    assert score_videos([video] * 2, prompts[:2])["joint_accuracy"] == 0.5  # the wrong shape counts


def test_static_jumping_and_diagonal_objects_name_no_direction():
    assert analyse_video(square_video([(20, 15)] * 9)).direction == STATIC
    # Jumps between far corners: large spread but no line through time.
    jumps = [(2, 2), (36, 28), (2, 28), (36, 2), (20, 15), (2, 2), (36, 28), (36, 2), (2, 28)]
    assert analyse_video(square_video(jumps)).direction == UNKNOWN
    diagonal = analyse_video(square_video([(4 + 3 * t, 4 + 3 * t) for t in range(9)]))
    assert diagonal.direction == UNKNOWN and diagonal.colour == "red"


def test_input_forms_agree_and_signed_floats_are_refused(clips):
    videos, _, files, _ = clips
    uint8 = videos[0]
    as_float = torch.from_numpy(uint8).float().div(255).permute(0, 3, 1, 2)  # [T, 3, H, W] tensor
    assert analyse_video(files[0]) == analyse_video(uint8) == analyse_video(as_float)
    np.testing.assert_allclose(to_unit_frames(as_float), uint8 / 255.0, atol=1e-6)
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        analyse_video(as_float * 2 - 1)
    with pytest.raises(ValueError, match="shape"):
        analyse_video(uint8[0])


def test_prompt_dicts_and_prompts_without_targets(clips):
    videos, captions, _, paths = clips
    prompts = json.loads(paths["heldout_prompts"].read_text())
    by_caption = {p["prompt"]: p for p in prompts}
    heldout = [(v, by_caption[c]) for v, c in zip(videos, captions) if c in by_caption]
    assert len(heldout) == 30
    scores = score_videos([v for v, _ in heldout], [p for _, p in heldout])
    assert scores["colour_accuracy"] == 1.0 and scores["direction_accuracy"] == 1.0
    vague = score_videos(videos[:2], ["a thing", "something moving"])
    assert vague["colour_accuracy"] is None and vague["per_video"][0]["colour_ok"] is None
    assert vague["per_video"][0]["colour"] in PALETTE
    assert set(DIRECTIONS) >= {row["direction"] for row in vague["per_video"]}


def test_table_and_command_line(clips, tmp_path, capsys):
    _, _, _, paths = clips
    assert main(["--csv", str(paths["heldout_csv"]), "--json", str(tmp_path / "scores.json"),
                 "--max-rows", "3"]) == 0
    printed = capsys.readouterr().out
    assert "colour accuracy      100.0%" in printed and "27 more" in printed
    saved = json.loads((tmp_path / "scores.json").read_text())
    assert saved["num_videos"] == 30 and len(saved["per_video"]) == 30
    table = format_table(score_videos([np.zeros((9, 32, 32, 3), np.uint8)], ["a red circle moving up"]))
    assert "unknown X" in table and "colour accuracy      0.0%" in table
