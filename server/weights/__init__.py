"""The replica's weights: the weight manager, the rules new weights pass, a module per transport, joining.

`updates.py` (the weight manager: the version rule, one load at a time, adoption, adapter pushes, the
full-weights refusal), a transport's replica end per module — `directory.py` (a checkpoint under
--weights-root), `stream.py` (PushWeights received into memory or the spool), `nccl.py` (a broadcast) —,
`checkpoints.py` (which checkpoint files may load, opened as checked), `tensor_rules.py` (names, shapes,
dtypes, finite values against the served model: both engines ask it), `adapters.py` (LoRA adapters),
`dir_fingerprint.py` (the starting weights' fingerprint), `join.py` (joining a run at its current version)."""
