"""pan: a training system for video diffusion transformers."""

__version__ = "0.1.0"
