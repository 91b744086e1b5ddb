"""The HTTP / OpenAI-compatible front end: uvicorn on the replica's loop, FastAPI routes, OpenAI's
shapes, agent sessions and the model's text side (tokenizer, chat template)."""
