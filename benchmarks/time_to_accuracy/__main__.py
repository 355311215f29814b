"""`python -m benchmarks.time_to_accuracy`: see `benchmarks.time_to_accuracy.cli`."""

from benchmarks.time_to_accuracy.cli import main

main()
