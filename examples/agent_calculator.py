"""A tool-using agent on the official `openai` client, trained from the trajectories a replica records.

The agent talks to a replica's OpenAI-compatible endpoint like any OpenAI-compatible server; two headers
make each episode an RL rollout: `X-Maskroll-Session: <episode id>` (the calls of one episode are one
trajectory) and `X-Maskroll-Group: <group id>` (the episodes that answer one question form a GRPO group).
An episode is three model turns around a calculator tool:

    system + user question (+ the tool's schema)  → model turn 1 (a tool call, if the model makes one)
    the calculator's result (a `tool` message)    → model turn 2
    "Answer with the number only."                → model turn 3, scored (1 if it holds the result)

`POST /v1/sessions/<id>/finish` with the reward as metadata publishes the episode as ONE RolloutRecord to
Redis: the exact token ids the engine read and sampled, a loss mask (1 = sampled by the model, 0 = the
tool result, the user's words and the chat template's text), logprobs and top-K of the sampled tokens,
policy versions. The trainer below reads whole groups with `RolloutQueue`, `collate`s them (the response
mask is the loss mask), takes a predictive-mask policy-gradient step and publishes the new weights to the
replica, which the next episodes sample from.

A model that knows the Hermes tool-call format (Qwen 2.5 / 3, Hermes) calls the calculator itself; the
tiny random model of `maskroll init-model` never does, so the agent then runs the calculator on the
question's expression itself and hands the model the result the same way (a `tool` message). Either way
the trajectory has three model turns with a tool result between them.

    python examples/agent_calculator.py               # all local: tiny model, Redis, one replica (~1 min)
    python examples/agent_calculator.py --steps 3 --group-size 4
    python examples/agent_calculator.py --base-url http://replica:8000/v1 --api-key $TOKEN \\
        --redis-url redis://redis:6379/0 --namespace agents --weights-root /shared/ckpt --model /models/qwen
        # a running replica: maskroll serve --http-port 8000 --redis-url ... --weights-root ...

Not a package (examples/ is outside the import boundaries): copy it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import operator
import os
import random
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import openai

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """The tool: + - * / on numbers, nothing else (never eval() what a model wrote)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"not arithmetic: {expression!r}")

    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def question(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(11, 99), rng.randint(11, 99)
    return f"What is {a}*{b}?", f"{a}*{b}"


# ---- the agent: three turns over the OpenAI API --------------------------------------------------------


def episode(
    client: openai.OpenAI, model: str, session: str, group: str, q: tuple[str, str], seed: int
) -> dict:
    """One episode as one session; returns the finish answer (the trajectory) with its reward."""
    text, expression = q
    headers = {"X-Maskroll-Session": session, "X-Maskroll-Group": group}
    kw = dict(model=model, max_tokens=24, temperature=1.0, extra_headers=headers, tools=[CALCULATOR])
    messages: list = [
        {"role": "system", "content": "You are a careful assistant. Use the calculator for arithmetic."},
        {"role": "user", "content": text},
    ]
    reply = client.chat.completions.create(messages=messages, seed=seed, **kw).choices[0].message
    messages.append(reply)  # the model's turn exactly as returned: the replica keeps its token ids
    if reply.tool_calls:  # the model called the tool
        for call in reply.tool_calls:
            args = json.loads(call.function.arguments or "{}")
            result = calculator(str(args.get("expression", "")))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    else:  # it did not: the agent runs the calculator on the question and reports it the same way
        messages.append({"role": "tool", "tool_call_id": "agent-0", "content": calculator(expression)})
    reply = client.chat.completions.create(messages=messages, seed=seed + 1, **kw).choices[0].message
    messages += [reply, {"role": "user", "content": "Answer with the number only."}]
    final = client.chat.completions.create(messages=messages, seed=seed + 2, **kw).choices[0].message
    return {"reward": reward(final.content or "", calculator(expression)), "final": final.content}


def reward(text: str, answer: str) -> float:
    """1 for the right number; otherwise a little credit for writing digits at all, so that even a random
    model's group has rewards to compare (GRPO learns nothing from a group of equal rewards)."""
    if answer in text:
        return 1.0
    return 0.2 * sum(c.isdigit() for c in text) / max(1, len(text))


def finish(base_url: str, api_key: str, session: str, reward: float, group_size: int, index: int) -> dict:
    import httpx

    r = httpx.post(
        f"{base_url.removesuffix('/v1')}/v1/sessions/{session}/finish",
        headers={"Authorization": f"Bearer {api_key}"},
        json={"metadata": {"reward": str(reward)}, "group_size": group_size, "sample_index": index},
        timeout=60,
    )
    r.raise_for_status()
    return r.json()


# ---- the trainer: whole groups from Redis, one masked policy-gradient step per batch ---------------------


def train(args: argparse.Namespace, base_url: str, api_key: str) -> None:
    import torch
    import transformers

    from maskroll.client import RolloutQueue
    from maskroll.trainer_adapter import MaskConfig, collate, compute_masks_for, policy_loss, token_logprobs
    from maskroll.weight_sync import CheckpointPublisher

    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    policy = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    cfg = MaskConfig(method="predictive", divergence="topk_kl", estimator="proportional", delta=0.05)
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=2)
    served = client.models.list().data[0].id
    rng = random.Random(0)
    g = args.group_size
    with RolloutQueue(args.redis_url, args.namespace, run="new", batch_size=g, token=api_key) as q:
        publisher = CheckpointPublisher(q, args.weights_root)
        # version 0 of the run: a replica started from this model adopts it, another one loads it
        publisher.start(policy)
        for step in range(1, args.steps + 1):
            q_text = question(rng)
            group = f"{q.run_id[:8]}-step{step}"
            for i in range(
                g
            ):  # a GRPO group: g episodes of one question (sequential here; run them in parallel)
                session = f"{group}-ep{i}"
                out = episode(client, served, session, group, q_text, seed=1000 * step + 10 * i)
                done = finish(base_url, api_key, session, out["reward"], g, i)
                sampled = sum(done["loss_mask"])
                print(
                    f"  step {step} episode {i}: {done['num_turns']} turns, {len(done['token_ids'])} tokens "
                    f"({sampled} sampled by the model), reward {out['reward']:.3f}",
                    flush=True,
                )
            batch = q.next_batch(timeout=120)  # the whole group, from Redis
            b = collate(batch, [float(r.metadata["reward"]) for r in batch])
            out = policy(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids)
            logits = out.logits[:, b.completion_logits_slice]
            lp, stats = token_logprobs(logits, b.completion_ids, temperature=b.temperature, return_stats=True)
            res = compute_masks_for(b, logits.detach(), config=cfg, vocab_stats=stats)
            loss, m = policy_loss(lp, b.sampled_logprobs, b.advantages, res.keep, masks=res)
            opt.zero_grad()
            loss.backward()
            opt.step()
            q.ack(batch)
            publisher.publish(policy)  # the next episodes sample from the new version
            print(
                f"step {step}: {len(batch)} trajectories, {int(b.response_mask.sum())} trained tokens of "
                f"{int(b.attention_mask.sum())}, mean reward {float(b.rewards.mean()):.2f}, "
                f"mask fraction {float(m['mask_frac']):.3f}, policy version {publisher.version}",
                flush=True,
            )


# ---- running it all locally ------------------------------------------------------------------------------


@contextlib.contextmanager
def local_replica(tmp: Path, args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """A tiny model, a private Redis and one replica with HTTP; yields (base_url, api_key), then stops
    the replica and Redis (only the processes started here)."""
    from maskroll.app.model_init import init_model
    from maskroll.local.redis_server import LocalRedis
    from maskroll.local.replica import LocalReplica

    args.model = init_model(tmp / "tiny")
    args.weights_root = tmp / "ckpt"
    args.weights_root.mkdir()
    api_key = os.urandom(16).hex()
    with LocalRedis() as redis:
        args.redis_url = redis.url
        env = {"MASKROLL_AUTH_TOKEN": api_key, "MASKROLL_REDIS_URL": redis.url, "OMP_NUM_THREADS": "1"}
        serve = ["--model", args.model, "--engine", "torch", "--port", "0", "--http-port", "0"]
        serve += ["--namespace", args.namespace, "--weights-root", args.weights_root]
        serve += ["--threads", "1", "--drain-timeout-s", "2"]
        with LocalReplica(serve, env=env, log=tmp / "replica.log", ready_timeout=180) as replica:
            yield replica.http_url + "/v1", api_key


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2, help="training steps (one group each)")
    p.add_argument("--group-size", type=int, default=4, help="episodes per question (the GRPO group)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--namespace", default="agent-calculator", help="the queue namespace (one per run)")
    p.add_argument("--base-url", help="a replica's OpenAI endpoint, http://host:port/v1 (default: start one)")
    p.add_argument("--api-key", default=os.environ.get("MASKROLL_AUTH_TOKEN", ""), help="the replica's token")
    p.add_argument("--redis-url", help="the replica's Redis (with --base-url)")
    p.add_argument("--weights-root", type=Path, help="the replica's --weights-root (with --base-url)")
    p.add_argument("--model", type=Path, help="the model directory the replica serves (with --base-url)")
    args = p.parse_args(argv)
    if args.base_url:
        missing = [f for f in ("redis_url", "weights_root", "model") if getattr(args, f) is None]
        if missing:
            p.error(f"--base-url needs {', '.join('--' + f.replace('_', '-') for f in missing)}")
        train(args, args.base_url, args.api_key)
        return 0
    with (
        tempfile.TemporaryDirectory(prefix="maskroll-agent-") as tmp,
        local_replica(Path(tmp), args) as (base_url, api_key),
    ):
        train(args, base_url, api_key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
