"""Frozen encoders: the text encoder (transformers) and the VAE (identity, diffusers)."""
