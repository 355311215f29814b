"""Rollout scaling: how rollout throughput grows with engines (`python -m benchmarks.rollout_scaling`).

`fleet_simulation` simulates C3PO++ over a fleet of 64 to 512 engines with a long-tailed length distribution:
one global token budget with load-aware placement, against a static split that gives each engine a budget of
its own, and the synchronous batch. Its results are in docs/benchmarks.md ("Rollout scaling: the fleet
simulation").
"""
