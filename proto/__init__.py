"""maskroll.proto: the contract both sides import — the trainer SDK and the replicas alike.

The wire schema (`maskroll/v1/rollout.proto`, the one source of truth for gRPC *and* the Redis records)
and everything derived from it or shared by both ends of a stream: the generated code (`_generated/`,
`make proto`), the protobuf ⇄ domain converter (`wire.py`; the PushWeights codec in `wire_push.py`, Score's in
`wire_score.py`, their shared ground in `wire_base.py`, the varint both hand-written codecs use in
`varint.py`), the plain-numpy record types
(`records.py`), the rules for sampling options (`sampling.py`), the Redis key layout and stream
primitives (`streams.py`), the Redis connection policy (`redis_conn.py`), the run record
(`run_record.py`), the replica heartbeat codec (`heartbeat.py`), the prompt rule (`prompts.py`) and the
PushWeights manifest (`tensor_push.py`).

It knows nothing of engines, trainers or torch. Importing the package loads nothing heavy.
"""
