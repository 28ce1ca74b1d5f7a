"""Benchmarks: what idempotency costs, as ratios to a bare app measured in the same run.

Run ``python -m benchmarks`` (or ``make bench``); see ``benchmarks/README.md``.
Not part of the distribution: it is a tool for this repository.
"""
