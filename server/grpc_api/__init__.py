"""The gRPC front end: the servicer and the one boundary that maps exceptions to gRPC status codes.

`servicer.py` (Generate, UpdateWeights, PushWeights, GetInfo), `errors.py` (the statuses; the HTTP front
end derives its own from them)."""
