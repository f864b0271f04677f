"""The demos: `make demo` / `pan demo` (main.py, the Pan recipe), `pan demo --recipe X` (recipes.py),
and what they write beside their samples (report.py)."""

from pan.demo.main import DEFAULT_CONFIG, PIX_FMT, SHAPE_SIZE, main, make_data

__all__ = ["DEFAULT_CONFIG", "PIX_FMT", "SHAPE_SIZE", "main", "make_data"]
