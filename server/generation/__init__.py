"""The one request path every front end shares: validate, fan out to the engine, chunks and records.

`serving.py` (a client's Generate or Score: the serving check, adapter, duplicate ids, the running set,
publishing), `validation.py` (against the replica's limits), `pipeline.py` (a request run once),
`fanout.py` (n engine requests), `records_builder.py` (engine outputs → chunks and finished records)."""
