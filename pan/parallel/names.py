"""Parameter names as the unwrapped model spells them.

Wrappers that are applied from outside (activation checkpointing, torch.compile, FSDP1, DDP in
other trainers' files) insert these components into parameter names; pan's own names, optimizer
groups, EMA, checkpoints and warm-start comparisons use the unwrapped names.
"""

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "module.")


def unwrapped_name(name: str) -> str:
    """`blocks.0._checkpoint_wrapped_module.qkv.weight` -> `blocks.0.qkv.weight`."""
    for prefix in WRAPPER_PREFIXES:
        if prefix == "module.":
            name = name.removeprefix(prefix)  # DDP's: only ever the outermost component
        else:
            name = name.replace(prefix, "")
    return name
