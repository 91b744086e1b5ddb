"""The HTTP / OpenAI-compatible front end of the replica's core, a room per endpoint family.

uvicorn on the replica's loop (`server.py`: `HttpFrontEnd`), the app and its health routes (`routes.py`),
what every route shares (`boundary.py`: auth, body checks, the error boundary, streaming), the native JSON
API (`native.py`: the gRPC service as JSON), the OpenAI API (`openai/`: router, protocol, serving), agent
sessions (`sessions/`: router, serving, trajectory, state, durable), the model's text side (`chat.py`:
tokenizer, chat template) and the HTTP statuses (`errors.py`). Imports nothing of grpc_api."""
