"""The repository's benchmark harnesses, outside the installed package: run from the repository
root (`benchmarks/run.sh`, `python -m benchmarks.peers ...`)."""
