"""Clients of a running deployment: the gRPC client of the `Coordinator` API and `generate --target`."""
