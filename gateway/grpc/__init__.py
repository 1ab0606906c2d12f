"""The gRPC front end: Triton's ``inference.GRPCInferenceService`` and
``grpc.health.v1.Health`` (see docs/grpc.md). Importing this package imports nothing of
grpcio; the vendored messages are in :mod:`zeroserve.models.proto`."""
