"""maskroll.app: the application layer — the `maskroll` command, the demo orchestrator and the model
builder (`init-model`). It sits above the replica (`maskroll.server`), the recipes and the integrations
and may import any of them; nothing imports it.
"""
