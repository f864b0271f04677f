"""Wan 2.1 / 2.2 (text- and image-to-video) from their diffusers folders: the transformer, its
weights, and (to come) the recipe that trains it."""
