"""maskroll.client: the SDK a trainer uses to reach rollout replicas (gRPC) and the rollout queue (Redis).

Owns the generated wire code, `RolloutClient`, `RolloutQueue` and plain-numpy records. It never imports
torch or vllm: a trainer on any framework can use it.
"""
