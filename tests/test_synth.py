"""The demo's synthetic dataset: real MP4s, honest captions, held-out combinations, determinism."""

import csv
import json

import av
import numpy as np
import pytest

from pan.data.synth import (CSV_COLUMNS, DIRECTIONS, PALETTE, SHAPES, ClipSpec, main, parse_caption,
                            render_clip, sample_clip_specs, synth_dataset, train_combinations)

SIZE, FRAMES, FPS = 32, 9, 8


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def combo(caption):
    parsed = parse_caption(caption)
    return parsed["colour"], parsed["shape"], parsed["direction"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    return out, synth_dataset(out, num_train=90, num_heldout=30, size=SIZE, num_frames=FRAMES, fps=FPS,
                              seed=3)


def test_csvs_list_decodable_mp4s_with_the_stated_geometry(dataset):
    out, paths = dataset
    assert set(paths) == {"train_csv", "heldout_csv", "heldout_prompts"}
    for key, count in (("train_csv", 90), ("heldout_csv", 30)):
        with open(paths[key], newline="") as f:
            assert tuple(next(csv.reader(f))) == CSV_COLUMNS
        rows = read_csv(paths[key])
        assert len(rows) == count
        for row in rows[:10]:
            assert not row["path"].startswith("/")  # relative to the CSV
            assert (int(row["fps"]), int(row["num_frames"]), int(row["width"]), int(row["height"])) == \
                (FPS, FRAMES, SIZE, SIZE)
            with av.open(str(paths[key].parent / row["path"])) as container:
                stream = container.streams.video[0]
                assert stream.average_rate == FPS
                frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
            assert len(frames) == FRAMES and frames[0].shape == (SIZE, SIZE, 3)
            assert None not in combo(row["caption"])


def test_heldout_combinations_never_trained_but_every_word_is(dataset):
    _, paths = dataset
    train = {combo(row["caption"]) for row in read_csv(paths["train_csv"])}
    prompts = json.loads(paths["heldout_prompts"].read_text())
    heldout = {(p["colour"], p["shape"], p["direction"]) for p in prompts}
    assert heldout and not heldout & train
    assert all(combo(p["prompt"]) == (p["colour"], p["shape"], p["direction"]) for p in prompts)
    assert {combo(row["caption"]) for row in read_csv(paths["heldout_csv"])} <= heldout
    # Generalisation means composing known words: each word is shown in training.
    assert {c for c, _, _ in train} == set(PALETTE)
    assert {s for _, s, _ in train} == set(SHAPES)
    assert {d for _, _, d in train} == set(DIRECTIONS)
    # 90 clips cycle through all training combinations, balanced.
    assert len(train) == len(PALETTE) * len(SHAPES) * len(DIRECTIONS) - len(heldout)


def test_same_seed_same_bytes_other_seed_other_data(dataset, tmp_path):
    out, paths = dataset
    again = synth_dataset(tmp_path / "again", num_train=90, num_heldout=30, size=SIZE,
                          num_frames=FRAMES, fps=FPS, seed=3)
    assert again["train_csv"].read_text() == paths["train_csv"].read_text()
    for row in read_csv(paths["train_csv"]) + read_csv(paths["heldout_csv"]):
        assert (out / row["path"]).read_bytes() == (tmp_path / "again" / row["path"]).read_bytes(), row
    other = synth_dataset(tmp_path / "other", num_train=90, num_heldout=30, size=SIZE,
                          num_frames=FRAMES, fps=FPS, seed=4)
    assert other["train_csv"].read_text() != paths["train_csv"].read_text()


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_rendered_clip_shows_its_caption(direction):
    spec = ClipSpec("green", "square", direction, shape_size=10.0, start_xy=(11.0, 11.0), displacement=8.0)
    frames = render_clip(spec, SIZE, FRAMES).astype(np.float32)  # [T, H, W, 3]
    coverage = frames.max(axis=-1) / max(PALETTE["green"])  # [T, H, W], 1 inside the shape
    # Fully inside the frame in every frame: the drawn area never shrinks.
    np.testing.assert_allclose(coverage.sum(axis=(1, 2)), 100.0, rtol=0.02)
    inside = coverage > 0.99
    assert np.all(frames[inside] == PALETTE["green"])
    ys, xs = np.mgrid[0:SIZE, 0:SIZE]
    centre_x = (coverage * xs).sum(axis=(1, 2)) / coverage.sum(axis=(1, 2))
    centre_y = (coverage * ys).sum(axis=(1, 2)) / coverage.sum(axis=(1, 2))
    ux, uy = DIRECTIONS[direction]
    np.testing.assert_allclose(centre_x[-1] - centre_x[0], 8.0 * ux, atol=0.3)
    np.testing.assert_allclose(centre_y[-1] - centre_y[0], 8.0 * uy, atol=0.3)
    assert np.all(np.diff(centre_x) * ux >= 0) and np.all(np.diff(centre_y) * uy >= 0)  # constant way


@pytest.mark.parametrize("shape_size", [(0.28, 0.36), (0.44, 0.52)])
def test_sampled_paths_stay_inside_the_frame(shape_size):
    specs = sample_clip_specs(train_combinations(), 500, SIZE, np.random.default_rng(0), shape_size)
    for spec in specs:
        assert shape_size[0] * SIZE <= spec.shape_size <= shape_size[1] * SIZE
        ux, uy = DIRECTIONS[spec.direction]
        end = (spec.start_xy[0] + ux * spec.displacement, spec.start_xy[1] + uy * spec.displacement)
        for x, y in (spec.start_xy, end):  # the box's top-left; motion is linear in between
            assert 0 <= x <= SIZE - spec.shape_size and 0 <= y <= SIZE - spec.shape_size, spec
        assert spec.displacement > 0.1 * SIZE  # visibly moving


def test_mp4_keeps_the_palette_colour(dataset):
    out, paths = dataset
    for row in read_csv(paths["train_csv"])[:20]:
        with av.open(str(out / row["path"])) as container:
            frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
        colour = np.array(PALETTE[combo(row["caption"])[0]])
        core = frames.max(axis=-1) > 0.9 * colour.max()  # [T, H, W]
        assert core.any(axis=(1, 2)).all()
        # Near-lossless encoding: the shape keeps its palette colour (edges share chroma with the
        # background under yuv420p, hence the median).
        assert np.abs(np.median(frames[core], axis=0) - colour).max() < 8, row


def test_main_writes_a_dataset_and_bad_sizes_are_refused(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--num-train", "4", "--num-heldout", "2", "--num-frames", "5"]) == 0
    assert "train_csv" in capsys.readouterr().out
    assert len(read_csv(tmp_path / "train.csv")) == 4 and len(read_csv(tmp_path / "heldout.csv")) == 2
    with pytest.raises(ValueError, match="even"):
        synth_dataset(tmp_path / "odd", num_train=1, num_heldout=0, size=31)
    with pytest.raises(ValueError, match="shape_size"):
        synth_dataset(tmp_path / "huge", num_train=1, num_heldout=0, shape_size=(0.5, 1.2))


def test_shape_size_sets_the_drawn_area(tmp_path):
    """`--shape-size` reaches the clips: the object's area follows the fraction asked for."""
    big = tmp_path / "big"
    assert main(["--out", str(big), "--num-train", "6", "--num-heldout", "0", "--size", "16",
                 "--num-frames", "5", "--shape-size", "0.5", "0.5"]) == 0
    for row in read_csv(big / "train.csv"):
        with av.open(str(big / row["path"])) as container:
            frame = next(container.decode(video=0)).to_ndarray(format="rgb24").astype(np.float32)
        colour = np.array(PALETTE[combo(row["caption"])[0]], np.float32)
        area = (frame.max(axis=-1) / colour.max()).sum()  # coverage summed: the shape's area in pixels
        expected = {"square": 1.0, "circle": np.pi / 4, "triangle": 0.5}[combo(row["caption"])[1]] * 8 ** 2
        assert area == pytest.approx(expected, rel=0.15), row


def test_pix_fmt_yuv444p_keeps_colour_edges_at_full_resolution(tmp_path):
    """`--pix-fmt yuv444p` (the demo's 16-pixel clips): the MP4 stores 4:4:4, and the decoded clips
    are closer to the rendered frames than 4:2:0 ones, whose colour is stored on a 2-pixel grid."""
    errors = {}
    for pix_fmt in ("yuv420p", "yuv444p"):
        out = tmp_path / pix_fmt
        assert main(["--out", str(out), "--num-train", "8", "--num-heldout", "0", "--size", "16",
                     "--num-frames", "5", "--seed", "4", "--pix-fmt", pix_fmt]) == 0
        specs = sample_clip_specs(train_combinations(), 8, 16, np.random.default_rng(4))
        diffs = []
        for row, spec in zip(read_csv(out / "train.csv"), specs):
            assert row["caption"] == spec.caption
            with av.open(str(out / row["path"])) as container:
                assert container.streams.video[0].codec_context.pix_fmt == pix_fmt
                frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
            diffs.append(np.abs(frames.astype(np.float32) - render_clip(spec, 16, 5)).mean())
        errors[pix_fmt] = float(np.mean(diffs))
    assert errors["yuv444p"] < 0.5 * errors["yuv420p"], errors
    with pytest.raises(ValueError, match="pix_fmt"):
        synth_dataset(tmp_path / "bad", num_train=1, num_heldout=0, pix_fmt="rgb24")
