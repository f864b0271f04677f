"""The row index (pan/data/index.py): a manifest read by row number from a memory-mapped file reads
exactly as the manifest itself (Python's csv module for CSVs, every odd line kept in its place as a
bad sample), is rebuilt when the manifest changes, is written whole when many processes start at
once, and `pan data index` builds it ahead of a run (split over torchrun's processes)."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pan.data.index as index_module
from pan.data.index import SourceError, index_candidates, open_index, stamp_of
from pan.data.plan import Ref
from pan.data.reader import SampleReader, rules_of
from pan.data.sources import read_annotations, read_image_tars, read_video_csv
from test_data_sources import small_config

REPO = Path(__file__).resolve().parents[1]

MESSY = ('\ufeffpath,caption,fps\n'
         'a.mp4,plain,24\n'
         '\n'
         'b.mp4,"a caption, with a comma",25\n'
         'c.mp4,"two\nlines",\n'
         'ragged.mp4\n'                     # fewer cells than the header
         'long.mp4,x,1,extra,cells\n'       # more
         ',,\n'                             # all blank: not a row
         '   \n'                            # blank too
         'd.mp4,"she said ""hi""",2\n'
         'e.mp4,  spaced  ,3\n')


def python_rows(path: Path) -> tuple[list[str], list[list[str]]]:
    """What Python's csv module reads (pan's reader before the index), cut/padded to the header."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader)]
        rows = [row for row in reader if any(cell.strip() for cell in row)]
    return header, [(row + [""] * len(header))[:len(header)] for row in rows]


@pytest.mark.parametrize("read_bytes", [64, 1 << 22])   # odd lines inside, between and across blocks
def test_a_messy_csv_reads_as_pythons_csv_module_reads_it(tmp_path, monkeypatch, read_bytes):
    monkeypatch.setattr(index_module, "READ_BYTES", read_bytes)
    monkeypatch.setattr(index_module, "BATCH_ROWS", 3)
    path = tmp_path / "messy.csv"
    path.write_text(MESSY * 7, encoding="utf-8")
    header, rows = python_rows(path)
    src = read_video_csv(path)
    assert list(src.columns) == header and list(src.rows) == rows
    ragged = rows.index(["ragged.mp4", "", ""])
    assert src.field(src.rows[ragged], "caption") is None  # read as a row without a caption: a bad sample


def test_a_ragged_row_is_one_bad_sample_and_the_rows_after_it_keep_their_ids(tmp_path):
    path = tmp_path / "clips.csv"
    path.write_text("path,caption\nmissing.mp4\nnowhere.mp4,second row\n")
    rules = rules_of(small_config(video_csv_paths=[str(path)]))
    reader = SampleReader({"video:clips": read_video_csv(path)}, None, rules)
    first, second = (reader[Ref(i, "video:clips", 0, i, i)] for i in range(2))
    assert (first.reason, second.reason) == ("empty_caption", "missing_file")
    assert "nowhere.mp4" in second.detail


def test_jsonl_lines_parquet_tables_and_tar_members_are_read_by_number(tmp_path):
    lines = [json.dumps({"video": f"v{i}.mp4", "text": f"row {i}"}) for i in range(5)]
    (tmp_path / "a.jsonl").write_bytes(("\r\n".join(lines[:2]) + "\n\n  \n" + "\n".join(lines[2:])).encode())
    (tmp_path / "b.jsonl").write_text(lines[0] + "\n" + json.dumps({"latent": "x.pt", "text": "t"}))
    jsonl = read_annotations(tmp_path / "a.jsonl")
    assert list(jsonl.rows) == [line.encode() for line in lines]
    assert not jsonl.names_latents and read_annotations(tmp_path / "b.jsonl").rows_naming("latent") == 1

    pq.write_table(pa.table({"path": ["a.mp4", None], "caption": ["one", "two"], "fps": [24, 30]}),
                   tmp_path / "t.parquet")
    table = read_video_csv(tmp_path / "t.parquet")
    assert list(table.rows) == [["a.mp4", "one", "24"], ["", "two", "30"]]

    tar_path = tmp_path / "s.tar"
    with tarfile.open(tar_path, "w") as tar:
        for name, data in (("k1.jpg", b"JPEG1"), ("k1.txt", b"cap one"), ("k2.png", b"PNG22"), ("notes.md", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tars = read_image_tars([tar_path, tar_path])
    assert len(tars) == 4 and [img.key for img in tars.images] == ["k1", "k2", "k1", "k2"]
    assert tars.read(tars.images[2]) == (b"JPEG1", b"cap one") and tars.images[3].caption is None
    assert tars.images[3].tar == 1


def test_the_index_is_reused_and_rebuilt_when_its_manifest_changes(tmp_path, monkeypatch):
    path = tmp_path / "clips.csv"
    path.write_text("path,caption\na.mp4,one\n")
    assert list(read_video_csv(path).rows) == [["a.mp4", "one"]]
    built = index_candidates(path)[0]
    assert built == tmp_path / "clips.csv.index.arrow" and stamp_of(built)
    calls = []
    real = index_module.write_index
    monkeypatch.setattr(index_module, "write_index", lambda *a, **k: calls.append(a) or real(*a, **k))
    read_video_csv(path)
    assert calls == []                                  # reused
    path.write_text("path,caption\nb.mp4,two\n")        # same size, likely the same mtime tick
    assert list(read_video_csv(path).rows) == [["b.mp4", "two"]] and len(calls) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clips.csv", "clips.csv.index.arrow"]  # no temp or lock left


def test_a_read_only_data_folder_indexes_into_the_cache_folder(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    (data / "clips.csv").write_text("path,caption\na.mp4,one\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    writable = index_module._writable_folder   # (root writes anywhere: the data folder is said read-only)
    monkeypatch.setattr(index_module, "_writable_folder", lambda folder: folder != data and writable(folder))
    assert len(read_video_csv(data / "clips.csv")) == 1
    assert list((tmp_path / "cache" / "pan" / "index").glob("clips.csv.*.index.arrow"))
    assert sorted(p.name for p in data.iterdir()) == ["clips.csv"]
    monkeypatch.setenv("PAN_INDEX_DIR", str(tmp_path / "mine"))   # an index folder of one's own
    assert len(read_video_csv(data / "clips.csv")) == 1 and list((tmp_path / "mine").glob("clips.csv.*"))


def test_many_processes_starting_at_once_all_read_a_whole_index(tmp_path):
    path = tmp_path / "clips.csv"
    path.write_text("path,caption\n" + "".join(f"c{i}.mp4,caption {i}\n" for i in range(20000)))
    code = ("import sys; from pan.data.sources import read_video_csv; s = read_video_csv(sys.argv[1]); "
            "print(len(s), s.rows[19999][0])")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
             for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [o for o, _ in outs] == ["20000 c19999.mp4\n"] * 4, outs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clips.csv", "clips.csv.index.arrow"]


def test_unusable_manifests_are_refused_with_their_reason(tmp_path):
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "latin1.csv").write_bytes("path,caption\na.mp4,caf\xe9\n".encode("latin-1"))
    (tmp_path / "late.csv").write_bytes(("path,caption\n" + "a.mp4,x\n" * 10000 + "b.mp4,caf\xe9\n").encode("latin-1"))
    pq.write_table(pa.table({"path": [["a"]], "caption": ["x"]}), tmp_path / "nested.parquet")
    for name, words in (("empty.csv", "needs a header row"), ("latin1.csv", "not UTF-8"), ("late.csv", "not UTF-8"),
                        ("nested.parquet", "has no text form")):
        with pytest.raises(SourceError, match=words):
            read_video_csv(tmp_path / name)


def test_pan_data_index_builds_every_manifest_split_over_processes(tmp_path):
    for i in range(3):
        (tmp_path / f"m{i}.csv").write_text(f"path,caption\n{i}.mp4,caption\n")
    (tmp_path / "rows.jsonl").write_text('{"video": "v.mp4", "text": "t"}\n')
    out = tmp_path / "indexes"
    env = {**os.environ, "PYTHONPATH": str(REPO), "WORLD_SIZE": "2"}
    args = [sys.executable, "-m", "pan.cli", "data", "index", *(str(tmp_path / f"m{i}.csv") for i in range(3)),
            str(tmp_path / "rows.jsonl"), "--out", str(out)]
    runs = [subprocess.run(args, env={**env, "RANK": str(r)}, cwd=REPO, capture_output=True, text=True, timeout=120)
            for r in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs
    assert sorted(p.name.split(".")[0] for p in out.glob("*.index.arrow")) == ["m0", "m1", "m2", "rows"]
    assert "m0.csv" in runs[0].stdout and "m1.csv" in runs[1].stdout and "m1.csv" not in runs[0].stdout
    assert "built in" in runs[0].stdout
    again = subprocess.run(args, env={**env, "RANK": "0"}, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout.count("up to date") == 2, again.stdout
    bad = subprocess.run([sys.executable, "-m", "pan.cli", "data", "index", str(tmp_path / "nowhere.csv")],
                         env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "nowhere.csv" in bad.stderr and "Traceback" not in bad.stderr
    help_text = subprocess.run([sys.executable, "-m", "pan.cli", "data", "index", "--help"], cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert help_text.returncode == 0 and "PAN_INDEX_DIR" in help_text.stdout


def test_an_index_is_opened_without_reading_its_rows(tmp_path):
    path = tmp_path / "clips.csv"
    path.write_text("path,caption\n" + "".join(f"c{i}.mp4,caption {i}\n" for i in range(200_000)))
    open_index(path, "table")                      # built
    import tracemalloc
    arrow_before = pa.total_allocated_bytes()
    tracemalloc.start()
    index = open_index(path, "table")              # opened again: mapped, nothing read into memory
    python_bytes = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(index) == 200_000 and read_video_csv(path).rows[123_456] == ["c123456.mp4", "caption 123456"]
    assert pa.total_allocated_bytes() - arrow_before < 64 << 10 and python_bytes < 1 << 20, python_bytes


def test_pan_check_reads_the_row_count_from_the_index_and_decodes_only_a_few_rows(tmp_path, monkeypatch):
    """`pan check`'s data rows at 100,000 rows: the count in the table, a handful of rows read."""
    from pan.config import load_job_config
    from pan.data.sources import TableRows
    from pan.data.synth import synth_dataset
    from pan.preflight import Preflight, run_preflight
    clips = synth_dataset(tmp_path / "synth", num_train=4, num_heldout=0)["train_csv"]
    header, *rows = clips.read_text().splitlines()
    big = clips.with_name("big.csv")
    big.write_text("\n".join([header] + [rows[i % len(rows)] for i in range(100_000)]) + "\n")
    reads = []
    real = TableRows.__getitem__
    monkeypatch.setattr(TableRows, "__getitem__", lambda self, i: reads.append(i) or real(self, i))
    job = load_job_config(["--config", str(REPO / "config/tiny_cpu.yaml"), "--video_csv_paths", str(big),
                           "--output_dir", str(tmp_path / "run")], warn=lambda msg: None)
    data_rows = [row for row in run_preflight(Preflight(job, 1, 1)) if row.check == "data"]
    assert data_rows and all(row.status == "pass" for row in data_rows), data_rows
    assert "100000 samples" in data_rows[0].detail, data_rows[0].detail
    assert 0 < len(reads) <= 50, len(reads)   # the sampled rows (read by the check's reader), not 100,000
