"""The sandbox's two front doors onto one `SandboxRunner`: SandboxFusion's HTTP API (`http_app`, with the
`hot_path` in front of FastAPI for the two endpoints that carry the load) and gRPC `everstep.v1.Sandbox`
(`grpc_service`)."""
