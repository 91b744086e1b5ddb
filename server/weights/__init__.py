"""The replica's weights: which may load, the one rule set they must pass, their sources, joining a run.

`checkpoints.py` (which checkpoint files may load, opened as checked), `tensor_rules.py` (names, shapes,
dtypes, finite values against the served model: both engines ask it), `sources.py` (the one weight-source
contract: directory, streamed, collective), `receive.py` (the receiving end of PushWeights), `join.py`
(joining a run at its current version)."""
