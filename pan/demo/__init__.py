"""The demos: `make demo` / `pan demo [--recipe NAME]` (main.py, the dispatch to each recipe's `demo`
hook, pan/recipes/<name>/demo.py), what the demos share (kit.py), the analyser that scores their
videos (analyser.py, `pan eval`) and what they write beside their samples (report.py)."""

from pan.demo.main import main

__all__ = ["main"]
