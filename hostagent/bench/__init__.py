"""Benchmark helpers: figures, machine facts, a demo agent as a subprocess, an in-process agent over fakes.

Used by `scripts/bench_*.py` (and `hostagent bench`); nothing in the agent imports this package.
"""
