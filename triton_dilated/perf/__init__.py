"""Benchmarks behind `python -m triton_dilated.perf`."""
