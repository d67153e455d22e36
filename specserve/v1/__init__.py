"""Generated protobuf / gRPC modules (scripts/gen_proto.sh). Do not edit."""
