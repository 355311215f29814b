"""Tensors and weights between the trainer and the rollout engines, with torch alone (no grpc, protobuf or stubs
needed to import them): `tensor_codec` (dtype names, `common.Tensor` both ways), `cuda_ipc` (CUDA IPC handles) and
`process_group` (the weight-broadcast group). They need the package's `torch` extra."""
