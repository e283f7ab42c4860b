"""The engine: the resident pipeline, its adapters and its queue. It knows nothing of gRPC."""
