"""A package only so that pytest imports this folder's tests as `weights.test_*`: their names mirror
server/weights/ (test_stream.py for server/weights/stream.py), and tests/weight_sync mirrors weight_sync/
with the same names (its test_stream.py), which pytest's default import mode refuses as two top-level
`test_stream` modules. Helpers here are imported by module name (`push_helpers`, `weights_fixtures`):
the conftest puts this folder on sys.path."""
