"""The OpenAI-compatible API: its routes (`router.py`), shapes (`protocol.py`) and work (`serving.py`)."""
