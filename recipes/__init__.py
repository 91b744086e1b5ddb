"""maskroll.recipes: training loops to read and copy, built on the public APIs only.

`grpo.py` is the trainer of `maskroll demo` — the README's "plug in your own trainer" loop grown into a
complete one (admission control, group advantages, masks, loss, weight publishing, progress); its
settings are `config.py`'s GRPOConfig (the MaskConfig nested in it); `digits.py` is the demo's verifiable
toy task; `arithmetic.py` the task of `maskroll demo --model smollm2` (generated word problems, a plain
verifier), plugged in through `grpo.train(task=...)`. A recipe may import `maskroll.client`,
`maskroll.trainer_adapter`, `maskroll.weight_sync`, torch and transformers — never `maskroll.server`: a
user's trainer does not run a replica.
"""
