"""The three gRPC services (gateway, verifier, drafter), their shared plumbing and the CLI."""
