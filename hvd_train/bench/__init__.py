"""Benchmarks that measure where a distributed step's time goes (run under a launcher).

Each module's `main` runs on every rank and rank 0 writes one JSON result; `hvd-train bench ...`
starts the ranks, then plots the result next to its JSON.
"""
