"""Agent sessions: routes (`router.py`), their lifecycle (`serving.py`), the token-exact trajectory and the
store (`trajectory.py`), its state as bytes (`state.py`), fleet-wide in Redis (`durable.py`)."""
