"""Data pipeline: video CSVs, image tars and precomputed latents -> packed, resumable batches.

User guide: docs/data.md (section 7 maps the modules). Entry point: `build_data_loader(cfg,
tokens_of=..., dp_rank=..., dp_size=..., seed=...)` -> `PackedLoader`, an endless iterator of
`RawBatch` with `state_dict` / `load_state_dict`.
"""

from pan.data.batch import RawBatch, Sample
from pan.data.build import build_data_loader
from pan.data.config import DataConfig
from pan.data.packed import DataResumeError, PackedLoader

__all__ = ["DataConfig", "DataResumeError", "PackedLoader", "RawBatch", "Sample", "build_data_loader"]
