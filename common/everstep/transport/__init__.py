"""How every everstep process talks gRPC: `channels` (servers and channels, message limits, mutual TLS from the
environment), `health_check` (the probe command the chart runs under mutual TLS) and `peer_identity` (the host and
/dev/shm a process sees, which the weight push compares between trainer and engine)."""
