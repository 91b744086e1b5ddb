"""maskroll.integrations: maskroll inside the trainers people already use.

The home of adapters to third-party training frameworks — TRL (a `GRPOTrainer` whose generation goes
through maskroll replicas and whose loss is maskroll's masks) and verl (maskroll losses registered as
verl policy losses). Each integration is one module named after its framework, imported explicitly
(`maskroll.integrations.trl`), and installed by the extra of the same name; importing this package
loads none of them. `rollouts.py` is what the framework modules share: where rollouts come from (the
Redis queue or direct gRPC) under one admission and staleness rule. docs/integrations.md compares them.

May import torch, the framework it adapts, `maskroll.client`, `maskroll.trainer_adapter` and
`maskroll.weight_sync`; never `maskroll.server`. The maths stays in `maskroll.trainer_adapter`, which
imports none of these.
"""
