"""The HTTP / OpenAI-compatible front end: the server, routes, OpenAI's shapes, agent sessions, chat.

uvicorn on the replica's loop (`server.py`), FastAPI routes (`routes.py`), the calls' work
(`openai_serving.py`) in OpenAI's shapes (`openai_compat.py`), agent sessions (`sessions.py`), the model's
text side (`chat.py`: tokenizer, chat template) and the HTTP statuses (`errors.py`)."""
