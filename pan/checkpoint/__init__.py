"""DCP checkpoints: atomic saves, retention, resume with fallback, warm start, export."""
