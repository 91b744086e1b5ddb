"""Engines: the contract every engine keeps, the choice made once, the torch and the vLLM engine.

`contract.py` (the contract and each engine's own request guard), `factory.py`; the torch reference
engine (`torch_engine.py`, with `torch_batch.py`: its KV cache batch, `torch_weights.py`: its weights)
and the vLLM engine (`vllm_engine.py`, the only vllm importer, with the pure `vllm_args.py`: its
configuration, and `vllm_outputs.py`: its outputs as the contract's arrays)."""
