"""everstep sandbox service: SandboxFusion-compatible HTTP and gRPC code execution.

See `everstep_sandbox.isolation` for what it protects against and what it does not.
"""
