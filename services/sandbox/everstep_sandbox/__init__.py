"""everstep sandbox service: SandboxFusion-compatible HTTP and gRPC code execution.

See `everstep_sandbox.runner` for what this skeleton does and does not isolate.
"""
