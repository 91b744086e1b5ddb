"""maskroll.local: local development servers — a private Redis, a private Redis Cluster, a replica
process and the session proxy (Caddy) — started on loopback ports and stopped by PID. The CLI (`maskroll
redis`), the demo, the examples, the benchmarks and the tests all start their servers through these.
"""
