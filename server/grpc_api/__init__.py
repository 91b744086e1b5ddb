"""The gRPC front end: the servicer (Generate, UpdateWeights, PushWeights, GetInfo) and the one
boundary that maps exceptions to gRPC status codes (the HTTP front end derives its statuses from it)."""
