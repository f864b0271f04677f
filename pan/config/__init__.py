"""pan's config language: typed component dataclasses, YAML sections, command-line overrides."""

from dataclasses import dataclass, field
from typing import ClassVar

from pan.config.core import ConfigError, knob, require
from pan.config.job import DEFAULT_RECIPE, EXIT_CONFIG_ERROR, dump_job, load_config_or_exit, load_job_config


@dataclass(kw_only=True)
class JobConfig:
    """Base of a recipe's job config: one attribute per component config."""
    recipe: str = DEFAULT_RECIPE  # the top-level `recipe` key
    # What shared components ask of a recipe, set on its job config class (never keyed on its name):
    # its task and sampler read `prediction_type` (FlowConfig); without it its models predict the velocity.
    READS_PREDICTION_TYPE: ClassVar[bool] = False
    # Why gradient_accumulation_steps > 1 deserves a warning in this recipe (None: the trainer notes it).
    ACCUMULATION_WARNING: ClassVar[str | None] = None
    # Keys the user set (in the file or on the command line) to a non-default value, for rules such
    # as "this key has no effect in this mode".
    explicit_keys: set[str] = field(default_factory=set, repr=False, compare=False)

    def attention_heads(self) -> int | None:
        """The attention heads Ulysses context parallel splits over cp_size; None: the recipe's
        model has no attention to split (cp_size must stay 1)."""
        return None


__all__ = ["ConfigError", "DEFAULT_RECIPE", "EXIT_CONFIG_ERROR", "JobConfig", "knob", "require", "load_job_config",
           "load_config_or_exit", "dump_job"]
