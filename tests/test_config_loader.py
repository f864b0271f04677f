"""The config language on a small stand-in job config (the real recipe is tested in test_config_pan.py)."""

from dataclasses import dataclass
from typing import ClassVar, Literal

import pytest

from pan.config import JobConfig, knob
from pan.config.core import ConfigError, require
from pan.config.job import build_job, dump_job, key_owners
from pan.config.loader import parse_overrides, yaml_entries


@dataclass(kw_only=True)
class Arch:
    LEGACY_NAMES: ClassVar[dict] = {"heads_num": "num_heads"}
    num_heads: int = knob(4, "heads", ge=1)
    dims: list[int] = knob([2, 2], "dims", length=2)


@dataclass(kw_only=True)
class ModelPart:
    SECTION: ClassVar[str] = "model"
    arch: Arch = knob(Arch(), "architecture")
    zero_init: bool = knob(True, "zero init")


@dataclass(kw_only=True)
class TrainPart:
    SECTION: ClassVar[str] = "training"
    learning_rate: float = knob(1e-4, "lr", gt=0)
    schedule: Literal["constant", "cosine"] = knob("constant", "schedule")
    drop_prob: float = knob(0.1, "prob", ge=0, le=1)
    name: str | None = knob(None, "name")

    def check(self, job):
        require(job.model.arch.num_heads % 2 == 0, "num_heads", "must be even.")


@dataclass(kw_only=True)
class ToyJob(JobConfig):
    model: ModelPart = knob(ModelPart(), "")
    train: TrainPart = knob(TrainPart(), "")


def load(tmp_path, text, argv=(), warn=None):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    cfg_path, cli = parse_overrides(["--config", str(path), *argv])
    entries = yaml_entries(path, set(key_owners(ToyJob)) | {"recipe"})
    return build_job(ToyJob, entries, cli, warn=warn or (lambda m: None))


def test_sections_are_free_form_and_cli_beats_file(tmp_path):
    job = load(tmp_path, "whatever:\n  learning_rate: 1e-3\nmodel:\n  arch: {num_heads: 8}\n",
               ["--learning_rate", "5e-5", "--arch.dims", "[3, 5]"])
    assert job.train.learning_rate == 5e-5           # `1e-3` (a YAML 1.1 string) and CLI both coerced
    assert job.model.arch.num_heads == 8             # the CLI merged into the nested mapping
    assert job.model.arch.dims == [3, 5]
    assert job.explicit_keys == {"learning_rate", "arch"}
    assert load(tmp_path, "training:\n  learning_rate: 1.0e-4\n").explicit_keys == set()  # default


def test_keys_may_sit_at_top_level(tmp_path):
    job = load(tmp_path, "schedule: cosine\n")
    assert job.train.schedule == "cosine"


def test_unknown_key_suggests_and_names_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, "training:\n  learning_rat: 1.0\n")
    assert e.value.key == "learning_rat" and "learning_rate" in str(e.value)
    assert e.value.location.endswith("c.yaml:2")


def test_key_in_two_sections_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="set twice"):
        load(tmp_path, "a:\n  learning_rate: 1.0\nb:\n  learning_rate: 2.0\n")


@pytest.mark.parametrize("text,key,words", [
    ("training:\n  schedule: cosin\n", "schedule", "Did you mean 'cosine'"),
    ("training:\n  drop_prob: 1.5\n", "drop_prob", "<= 1"),
    ("training:\n  learning_rate: 0\n", "learning_rate", "> 0"),
    ("training:\n  learning_rate: fast\n", "learning_rate", "expected a number"),
    ("model:\n  arch: {dims: [1, 2, 3]}\n", "arch.dims", "exactly 2"),
    ("model:\n  arch: {num_heads: 3}\n", "num_heads", "even"),
    ("model:\n  zero_init: maybe\n", "zero_init", "true or false"),
    ("model:\n  arch: {zero_init: true}\n", "arch.zero_init", "move it out"),
    ("training:\n  num_heads: 4\n", "num_heads", "architecture key"),
])
def test_rejections(tmp_path, text, key, words):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, text)
    assert e.value.key == key
    assert words in str(e.value)


def test_legacy_names_translate_with_one_warning(tmp_path):
    warnings = []
    job = load(tmp_path, "model:\n  arch: {heads_num: 6}\n", warn=warnings.append)
    assert job.model.arch.num_heads == 6
    assert len(warnings) == 1 and "`arch.num_heads`" in warnings[0]
    with pytest.raises(ConfigError, match="both are set"):
        load(tmp_path, "model:\n  arch: {heads_num: 6, num_heads: 6}\n")


def test_resolved_config_round_trip(tmp_path):
    job = load(tmp_path, "model:\n  arch: {heads_num: 6}\n", ["--learning_rate", "3e-4", "--name", "x"])
    (tmp_path / "r.yaml").write_text(dump_job(job))
    again = load(tmp_path, (tmp_path / "r.yaml").read_text())
    assert again == job


def test_parse_overrides_forms():
    path, pairs = parse_overrides(["--config", "c.yaml", "--a=1", "--b", "x", "--flag", "--c", "[1, 2]"])
    assert path == "c.yaml"
    assert pairs == [("a", 1), ("b", "x"), ("flag", True), ("c", [1, 2])]
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_overrides(["oops"])
