"""The replica's weights: which checkpoints may load (`checkpoints.py`), the one weight-source contract
(`sources.py`: directory, streamed, collective), the receiving end of PushWeights (`receive.py`) and
joining a run at its current version (`join.py`)."""
