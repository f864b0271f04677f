"""Data pipeline: video CSVs, image tars and precomputed latents -> packed batches."""
