"""Generated protobuf/gRPC modules; see protos/ and scripts/gen_protos.py."""
