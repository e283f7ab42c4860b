"""The only grpc-aware server code: servicer, proto <-> domain conversion, error table, token interceptor, TLS."""
