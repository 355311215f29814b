"""Rollout scaling: how rollout throughput grows with engines (`python -m benchmarks.rollout_scaling`).

`fleet_simulation` simulates C3PO++ over a fleet of 64 to 512 engines with a long-tailed length distribution:
one global token budget with load-aware placement, against a static split that gives each engine a budget of
its own, and the synchronous batch. Its results are in docs/benchmarks.md ("Rollout scaling: the fleet
simulation").

`real_engines` measures rollout tokens/s of one real engine process against a pool of two on this machine, on the
same seeded work, with the controller's `PoolStream` placing the groups (`speedup_2`). Its results are in
docs/benchmarks.md ("Rollout scaling: real engines").
"""
