"""Parallelism applied to single-device models from outside: device mesh, FSDP2/HSDP, Ulysses CP."""
