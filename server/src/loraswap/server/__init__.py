"""The gRPC server: settings, app wiring and the transport layer."""
