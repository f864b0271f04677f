"""The process layout of a run: world = dp_replicate x dp_shard x cp, validated before anything is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from pan.config.core import ConfigError, knob, require


@dataclass(kw_only=True)
class ParallelConfig:
    SECTION: ClassVar[str] = "distributed"
    TRAINING_ONLY: ClassVar[bool] = True  # not checked where a trained model is only used (pan sample)

    data_parallel_mode: Literal["fsdp", "ddp"] = knob(
        "fsdp", "fsdp: shard parameters, gradients and optimizer state (FSDP2); ddp: replicate them "
                "on every rank (small models such as a VAE)")
    hybrid_shard: bool = knob(
        False, "shard within a node and replicate across nodes (HSDP); needs data_parallel_mode: fsdp")
    cp_size: int = knob(
        1, "Ulysses context-parallel degree: ranks that split one packed sequence; divides "
           "num_attention_heads and the ranks per node", ge=1)
    enable_gradient_checkpointing: bool = knob(
        False, "recompute each transformer block in the backward pass instead of storing activations")
    use_dedicated_gradient_checkpointing: bool = knob(
        False, "selective checkpointing: keep every matmul, attention and all-to-all output of a "
               "block and recompute only its element-wise work (docs/training.md); needs "
               "enable_gradient_checkpointing")

    def check(self, job) -> None:
        heads = job.attention_heads()
        require(heads is not None or self.cp_size == 1, "cp_size",
                f"is {self.cp_size}, but the {job.recipe} recipe's model has no attention heads for "
                "Ulysses context parallel to split: set cp_size: 1.")
        require(heads is None or heads % self.cp_size == 0, "cp_size",
                f"num_attention_heads ({heads}) must be divisible by cp_size ({self.cp_size}): Ulysses "
                f"gives each cp rank num_attention_heads / cp_size heads. Pick a cp_size that divides "
                f"{heads}.")
        require(not (self.hybrid_shard and self.data_parallel_mode == "ddp"), "hybrid_shard",
                "hybrid_shard shards within a node, but data_parallel_mode is ddp (no sharding): set "
                "one of them.")
        require(self.enable_gradient_checkpointing or not self.use_dedicated_gradient_checkpointing,
                "use_dedicated_gradient_checkpointing",
                "selects which activations checkpointing keeps, so it needs "
                "enable_gradient_checkpointing: true (or set it to false).")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the mesh dimensions for one run. Raises ConfigError for impossible layouts."""
    world_size: int
    local_world_size: int   # processes per node
    cp: int
    dp_replicate: int
    dp_shard: int

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own share of the data."""
        return self.dp_replicate * self.dp_shard

    # cp is the innermost mesh dimension (pan/parallel/mesh.py): a cp group is cp consecutive ranks.
    def dp_rank_of(self, rank: int) -> int:
        """Which share of the data global rank `rank` reads (the same for all ranks of a cp group)."""
        return rank // self.cp

    def cp_rank_of(self, rank: int) -> int:
        return rank % self.cp

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int, local_world_size: int) -> "ParallelDims":
        cp = cfg.cp_size
        if local_world_size % cp:
            raise ConfigError("cp_size", f"({cp}) does not divide the {local_world_size} processes per "
                              "node: a cp group must sit inside one node (its all-to-alls run in "
                              "every layer). Use a cp_size that divides the processes per node.")
        if world_size % cp:
            raise ConfigError("cp_size", f"the world size ({world_size} processes) is not divisible "
                                         f"by cp_size ({cp}). Launch a multiple of {cp} processes.")
        dp = world_size // cp
        if cfg.data_parallel_mode == "ddp":
            return cls(world_size, local_world_size, cp, dp_replicate=dp, dp_shard=1)
        if not cfg.hybrid_shard:
            return cls(world_size, local_world_size, cp, dp_replicate=1, dp_shard=dp)
        if world_size % local_world_size:
            raise ConfigError("hybrid_shard", f"hybrid shard needs whole nodes of {local_world_size} "
                              f"processes; world size {world_size} does not fit. Launch whole nodes, "
                              "or turn hybrid_shard off.")
        return cls(world_size, local_world_size, cp, dp_replicate=world_size // local_world_size,
                   dp_shard=local_world_size // cp)
