"""Pull mode: the prompt stream's consumer (claim, heartbeats, reclaim), a job through the pipeline,
and the publisher of finished records into the rollout stream."""
