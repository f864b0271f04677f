"""`python -m pan.recipes.causal_vae export <checkpoint-N> --out <folder> [--ema]` (export.py)."""

import sys

from pan.recipes.causal_vae.export import main

sys.exit(main())
