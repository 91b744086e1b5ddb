"""Engines: the contract every engine keeps (`contract.py`), the choice made once (`factory.py`), the
torch reference engine and the vLLM engine (the only vllm importer)."""
