"""Pull mode: the prompt stream's consumer, a job through the pipeline, the finished records' publisher.

`puller.py` (claim, heartbeats, reclaim), `jobs.py` (a job through the pipeline), `publisher.py` (into
the rollout stream)."""
