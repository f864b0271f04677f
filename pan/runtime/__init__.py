"""What a run does while it runs: the metrics log, the watchdog, and plots of a run."""
