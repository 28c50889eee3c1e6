"""Experiments: fair comparisons, component ladders, replays, reports and diagnosis."""
