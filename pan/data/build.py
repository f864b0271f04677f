"""Building the loaders from a DataConfig: `build_data_loader` (the PackedLoader of one
data-parallel rank), `build_sharded_loader` (the ShardedLoader of its data shards) and
`build_step_shards` (the latter for a recipe's task)."""

from __future__ import annotations

import dataclasses

from pan.data.config import DataConfig
from pan.data.fit import SampleFit
from pan.data.packed import PackedLoader, TokensOf
from pan.data.plan import IMAGE_STREAM, Planner, StreamOrder
from pan.data.reader import RowSource, read_row_sources
from pan.data.sharded import ShardedLoader
from pan.data.sources import SourceError, VideoCsvSource, read_image_tars


def names_latents(source: RowSource) -> bool:
    return source.precomputed if isinstance(source, VideoCsvSource) else source.names_latents


def row_weights(cfg: DataConfig, sources: dict[str, RowSource]) -> dict[str, float]:
    """Sampling weight of each row source: the given lists, else each file's number of rows."""
    csvs = [n for n, s in sources.items() if isinstance(s, VideoCsvSource)]
    annotations = [n for n in sources if n not in csvs]
    weights = {}
    for names, given in ((csvs, cfg.video_csv_weights), (annotations, cfg.annotation_weights)):
        weights.update(zip(names, given or [len(sources[n]) for n in names]))
    return weights


def build_data_loader(cfg: DataConfig, *, tokens_of: TokensOf, dp_rank: int, dp_size: int, seed: int,
                      latent_tokens_of: TokensOf | None = None, fit: SampleFit | None = None) -> PackedLoader:
    """The packed loader of one data-parallel rank.

    tokens_of(num_frames, height, width) -> model tokens of a decoded sample (pixel dims);
    latent_tokens_of(t, h, w) -> model tokens of a precomputed latent grid (needed only when a CSV
    has a latent_path column or an annotation row names a latent); fit: what the run's model takes
    (pan/data/fit.py; a sample that does not fit is skipped as a bad sample). Every rank reads a
    disjoint share of every stream.
    """
    return build_sharded_loader(cfg, tokens_of=tokens_of, dp_rank=dp_rank, dp_size=dp_size, seed=seed,
                                latent_tokens_of=latent_tokens_of, fit=fit).loaders[dp_rank]


def build_sharded_loader(cfg: DataConfig, *, tokens_of: TokensOf, dp_rank: int, dp_size: int, seed: int,
                         accumulation: int = 1, latent_tokens_of: TokensOf | None = None,
                         writes_cursors: bool = True, fit: SampleFit | None = None) -> ShardedLoader:
    """The `accumulation` data shards of one data-parallel rank (see ShardedLoader), the sources
    read once for all of them; arguments as for build_data_loader."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
    sources = read_row_sources(cfg)
    if latent_tokens_of is None and any(names_latents(s) for s in sources.values()):
        raise ValueError("a video CSV has a latent_path column or an annotation row names a latent "
                         "(precomputed rows): pass latent_tokens_of to build_data_loader.")
    tars = read_image_tars(cfg.image_tar_paths) if cfg.image_tar_paths else None
    sizes = {name: len(s) for name, s in sources.items()}
    if tars is not None:
        sizes[IMAGE_STREAM] = len(tars)
    count = dp_size * accumulation
    sharers = (f"{count} data-parallel ranks" if accumulation == 1 else
               f"{count} data shards (data-parallel ranks x gradient_accumulation_steps)")
    for name, size in sizes.items():
        if size < count:
            raise SourceError(f"{name} has {size} samples, fewer than the {sharers} that share it.")
    if accumulation > 1 and cfg.packed_dataloader_num_workers:  # the rank's workers, split
        cfg = dataclasses.replace(cfg, packed_dataloader_num_workers=-(-cfg.packed_dataloader_num_workers
                                                                         // accumulation))
    image_prob = cfg.image_sample_prob if tars is not None else 0.0
    loaders = {}
    for shard in range(dp_rank * accumulation, (dp_rank + 1) * accumulation):
        streams = {name: StreamOrder(name, size, seed, shard, count) for name, size in sizes.items()}
        planner = Planner(streams, row_weights(cfg, sources), image_prob, seed, shard)
        loaders[shard] = PackedLoader(cfg, sources=sources, tars=tars, planner=planner, tokens_of=tokens_of,
                                      latent_tokens_of=latent_tokens_of, dp_rank=shard, dp_size=count,
                                      seed=seed, fit=fit)
    return ShardedLoader(loaders, writes_cursors)


def build_step_shards(task, dims) -> ShardedLoader:
    """The loader of a recipe whose micro-batches are data shards (`Task.sharded_micro_batches`):
    its job's data keys, seed and accumulation, its `tokens_of` / `latent_tokens_of`, and what its
    model takes (`sample_fit()`, when the task has one)."""
    job = task.job
    fit = task.sample_fit() if hasattr(task, "sample_fit") else None
    return build_sharded_loader(job.data, tokens_of=task.tokens_of, dp_rank=task.dp_rank, dp_size=dims.dp,
                                seed=job.trainer.seed, accumulation=job.trainer.gradient_accumulation_steps,
                                latent_tokens_of=task.latent_tokens_of, fit=fit)
