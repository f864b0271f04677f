"""`pan plot` (pan/runtime/plot.py): a run's metrics.jsonl drawn as four panels into a PNG."""

import json
import math
import random

import matplotlib.pyplot as plt
from PIL import Image

from pan.runtime.plot import draw, main, plot_run, read_records

STEPS = 400


def rows(grad_norm: bool = True) -> list[dict]:
    """A run's log rows as the trainer writes them: a noisy decaying loss, warm-up then cosine LR."""
    rng = random.Random(0)
    out = []
    for step in range(1, STEPS + 1):
        row = {"step": step, "loss": (0.2 + 2 * math.exp(-step / 80)) * math.exp(rng.gauss(0, 0.2)),
               "lr": 1e-3 * min(1, step / 40) * 0.5 * (1 + math.cos(math.pi * step / STEPS)),
               "step_time": 0.05 + 0.01 * rng.random(), "samples_per_s": 40.0}
        if grad_norm:
            row["grad_norm"] = 1 + rng.random()
        out.append(row)
    return out


def write(path, records: list[dict], tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_plot_run_writes_the_figure_as_a_png(tmp_path):
    write(tmp_path / "metrics.jsonl", rows())
    out = plot_run(tmp_path)
    assert out == tmp_path / "metrics.png"
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (1200, 800)  # 12 x 8 inches at 100 dpi


def test_loss_is_on_a_log_axis_with_its_smoothed_line_and_every_panel_has_data():
    fig = draw(rows())
    try:
        loss, grad, lr, time = fig.axes[:4]
        assert loss.get_yscale() == "log"
        assert [line.get_label() for line in loss.get_legend().get_lines()] == \
            ["loss (EMA over 20 points; raw faint)"]
        assert len(loss.get_lines()) == 2  # the raw points under their EMA
        for ax in (grad, lr, time):
            assert len(ax.get_lines()) == 1 and len(ax.get_lines()[0].get_xdata()) == STEPS
            assert not ax.texts
        assert time.get_ylabel() == "seconds per step"
    finally:
        plt.close(fig)


def test_every_loss_grad_norm_and_lr_of_a_recipe_is_drawn_and_a_signed_loss_gets_symlog():
    """The causal VAE's parts: `loss/<term>`, `grad_norm/discriminator`, `lr/discriminator`; its total
    loss can go below 0 (GAN term, learned log-variance), which a plain log axis would drop."""
    records = [{"step": s, "loss": 1.0 - s / 10, "loss/kl": 0.1 * s, "loss/perceptual": 0.0,
                "grad_norm": 2.0, "grad_norm/discriminator": 3.0, "lr": 1e-3, "lr/discriminator": 1e-4,
                "disc/weight": 0.5, "step_time": 0.2} for s in range(1, 21)]
    fig = draw(records)
    try:
        loss, grad, lr, _ = fig.axes[:4]
        assert loss.get_yscale() == "symlog"
        assert [line.get_label() for line in loss.get_lines()] == ["loss", "loss/kl"]  # the 0s: switched off
        assert [line.get_label() for line in grad.get_lines()] == ["grad_norm", "grad_norm/discriminator"]
        assert [line.get_label() for line in lr.get_lines()] == ["lr", "lr/discriminator"]
    finally:
        plt.close(fig)


def test_a_truncated_last_line_and_rows_without_a_key_are_skipped(tmp_path):
    records = rows()[:10]
    records[3].pop("loss")
    records[4]["loss"] = float("nan")  # a window of skipped steps: json writes NaN
    path = tmp_path / "metrics.jsonl"
    write(path, records, tail='{"step": 11, "loss": 0.')  # killed mid-write
    assert [r["step"] for r in read_records(path)] == list(range(1, 11))
    fig = draw(read_records(path))
    try:
        assert list(fig.axes[0].get_lines()[0].get_xdata()) == [1, 2, 3, 6, 7, 8, 9, 10]
        assert len(fig.axes[1].get_lines()[0].get_xdata()) == 10
    finally:
        plt.close(fig)
    assert plot_run(path, tmp_path / "sub" / "plot.png").is_file()


def test_a_run_without_grad_norm_says_not_logged_in_that_panel():
    fig = draw(rows(grad_norm=False))
    try:
        grad = fig.axes[1]
        assert [t.get_text() for t in grad.texts] == ["not logged"] and not grad.get_lines()
        assert not fig.axes[0].texts
    finally:
        plt.close(fig)


def test_main_prints_the_path_written(tmp_path, capsys):
    write(tmp_path / "metrics.jsonl", rows())
    assert main([str(tmp_path / "metrics.jsonl"), "--out", str(tmp_path / "p.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "p.png")
    assert (tmp_path / "p.png").is_file()


def test_a_missing_run_is_exit_2_with_a_one_line_message(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pan plot: ") and "nowhere" in err and err.count("\n") == 1
    assert main([str(tmp_path)]) == 2  # a folder without metrics.jsonl
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_a_file_of_garbage_is_exit_2(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('not json\n[1, 2]\n{"loss": 1.0}\n{"step": 3, "lo')
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pan plot: ") and "no metrics row" in err and err.count("\n") == 1
    assert not (tmp_path / "metrics.png").exists()
