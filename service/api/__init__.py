"""The public gRPC surface: servicer, interceptors, proto <-> domain conversion, status mapping."""
