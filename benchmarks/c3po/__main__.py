"""`python -m benchmarks.c3po`: see `benchmarks.c3po.cli`."""

from benchmarks.c3po.cli import main

main()
