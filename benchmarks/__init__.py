"""Benchmarks, run from the repository root as `python -m benchmarks.bench_<topic> --help`.

harness.py holds what they share; baselines/ what they compare against. A bench imports only those two.
"""
