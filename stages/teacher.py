"""The teacher stage's step: score a finished record on a teacher replica (the Score RPC) and attach the
teacher's top-K and the logprob of each completion token (docs/rewards.md "The teacher stage";
docs/records.md "Teacher fields"). The StageWorker (worker.py) does the rest — at-least-once, dedupe,
dead letters, heartbeats — exactly as for the reward stage.

- A fleet of teacher replicas: each record goes to the next one in turn; one that answers UNAVAILABLE
  (or RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED: `RETRYABLE`) passes the record to the next, and when every
  one is unavailable the record waits (backoff) up to `retry_s`, then stays pending for another worker
  (TeachersUnavailable: never a dead letter — an outage is not the record's fault).
- A teacher that refuses the record's tokens (INVALID_ARGUMENT: an id outside its vocabulary, too long
  for its context) gives a TeacherError: the record is dead-lettered with the teacher's words.
- The records of one GRPO group go to the teacher in one Score call when the worker holds them together
  (teacher_batch.GroupBatcher, `--group-wait-s`); what happens to each record stays per record.
- At start-up, `check_vocabulary` refuses teachers whose vocabulary is not the student's (compared: the
  GetInfo vocab_size of every teacher and of one live student replica, then their tokenizer fingerprints,
  proto/tokenizer_fingerprint.py: the SHA-256 of the id → token map, reported in GetInfo by each replica
  and computed here from `--tokenizer` when one is given — no tokenizer file of a teacher is needed).

Knows nothing of Redis streams (worker.py) or of how the trainer uses the teacher's numbers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from maskroll.client.rollout_client import RolloutClient, RolloutError
from maskroll.proto.records import RolloutRecord, ServerInfo
from maskroll.proto.scoring import ScoreOptions, ScoreResult
from maskroll.proto.tokenizer_fingerprint import fingerprint_tokenizer_json, vocab_fingerprint

from .reward_call import RewardStep, StageError

if TYPE_CHECKING:
    from .teacher_batch import GroupBatcher

log = logging.getLogger("maskroll.teacher")

# gRPC status names (RolloutError.code.name): the client module owns grpc
RETRYABLE = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"})
REFUSED = frozenset({"INVALID_ARGUMENT", "OUT_OF_RANGE", "FAILED_PRECONDITION"})


class TeacherError(StageError):
    """The teachers refused this record; the message goes with its dead letter."""

    what = "no teacher score"


class TeachersUnavailable(RuntimeError):
    """No teacher answered within the retry budget: the record stays pending (taken over later)."""


class VocabularyMismatch(ValueError):
    """A teacher's vocabulary is not the student's (start-up)."""


class TeacherPool:
    """Round robin over the teacher replicas, with failover to the next on a RETRYABLE status."""

    def __init__(
        self,
        addresses: tuple[str, ...],
        *,
        token: str | None,
        timeout_s: float,
        retry_s: float,
        root_certs: bytes | None = None,
    ) -> None:
        """root_certs: the CA (PEM) the replicas' TLS certificates are checked against; None: plaintext."""
        self.addresses = addresses
        self.clients = [
            RolloutClient(a, token=token, root_certs=root_certs, timeout=timeout_s) for a in addresses
        ]
        self.timeout_s, self.retry_s, self.root_certs = timeout_s, retry_s, root_certs
        self._next = 0

    async def infos(self) -> list[ServerInfo]:
        return [await c.info(timeout=self.timeout_s) for c in self.clients]

    async def score(self, prompt_ids: np.ndarray, completion_ids: np.ndarray, options: ScoreOptions):
        """(ScoreResult, the address that scored) of one completion (`score_many`'s rules)."""
        return await self.score_many(prompt_ids, [completion_ids], options)

    async def score_many(self, prompt_ids: np.ndarray, completions: list[np.ndarray], options: ScoreOptions):
        """(ScoreResult, the address that scored) of completions of one prompt, in one call; TeacherError
        when a teacher refuses them, TeachersUnavailable when none answers within retry_s."""
        deadline = time.monotonic() + self.retry_s
        wait, last = 0.2, None
        while True:
            for _ in range(len(self.clients)):
                i = self._next
                self._next = (i + 1) % len(self.clients)
                try:
                    result = await self.clients[i].score(prompt_ids, list(completions), options)
                    return result, self.addresses[i]
                except RolloutError as e:
                    if e.code.name in REFUSED:
                        raise TeacherError(f"teacher {self.addresses[i]} refused it: {e}") from None
                    if e.code.name not in RETRYABLE:
                        raise
                    last = e
                    log.warning("teacher %s: %s; trying the next", self.addresses[i], e)
            if time.monotonic() + wait > deadline:
                raise TeachersUnavailable(
                    f"no teacher of {', '.join(self.addresses)} answered within {self.retry_s:g} s "
                    f"(last: {last})"
                )
            await asyncio.sleep(wait)
            wait = min(2 * wait, 5.0)

    async def close(self) -> None:
        for c in self.clients:
            await c.close()


class TeacherStep:
    """What the teacher stage does to one record (the StageWorker's `scorer`): its reward first when the
    stage has one (`reward`: reward_call.RewardStep), then the teacher's scores under μ_teacher =
    softmax(ℓ_teacher / teacher_temperature) with K_teacher top-K entries."""

    kind = "teacher"
    what = TeacherError.what

    def __init__(
        self,
        pool: TeacherPool,
        options: ScoreOptions,
        reward: RewardStep | None = None,
        batcher: GroupBatcher | None = None,
    ) -> None:
        """batcher: scores a group's records in one call (its score_many must be this pool's at these
        options); None: one Score call per record."""
        self.pool, self.options, self.reward, self.batcher = pool, options, reward, batcher
        self.label = "teacher " + ",".join(pool.addresses) + (f" + {reward.label}" if reward else "")
        self.scored_by: dict[str, int] = {}  # address -> records it scored (round robin, for tests and logs)

    @property
    def hung(self) -> int:
        return self.reward.hung if self.reward else 0

    async def __call__(self, rec: RolloutRecord) -> None:
        if self.reward is not None:
            await self.reward(rec)
        if rec.has_teacher:
            return
        if rec.num_tokens == 0:  # Score refuses an empty completion: one token, for the semantics only
            result, _ = await self.pool.score(rec.prompt_ids, np.zeros(1, np.int32), self.options)
            t = _empty_like(result)
        elif self.batcher is not None:
            t, result, address = await self.batcher.score(rec)
            self.scored_by[address] = self.scored_by.get(address, 0) + 1
        else:
            result, address = await self.pool.score(rec.prompt_ids, rec.completion_ids, self.options)
            self.scored_by[address] = self.scored_by.get(address, 0) + 1
            t = result.completions[0]
        k = self.options.logprobs_k
        if t.num_tokens != rec.num_tokens or t.topk_ids.shape != (rec.num_tokens, k):
            raise TeacherError(
                f"the teacher answered {t.num_tokens} tokens of K = {t.topk_ids.shape[-1]} for a "
                f"{rec.num_tokens}-token completion at K = {k}"
            )
        ids, lps, sampled = t.topk_ids, t.topk_logprobs, t.logprobs
        if rec.loss_mask is not None:  # the record's convention: zero where the model did not sample
            off = ~rec.generated
            ids, lps, sampled = ids.copy(), lps.copy(), sampled.copy()
            ids[off], lps[off], sampled[off] = 0, 0.0, 0.0
        rec.teacher_topk_ids = ids.astype(np.int32, copy=False)
        rec.teacher_topk_logprobs = lps.astype(np.float32, copy=False)
        rec.teacher_sampled_logprobs = sampled.astype(np.float32, copy=False)
        rec.teacher_semantics, rec.teacher_policy_version = result.semantics, result.policy_version
        problems = rec.teacher_problems()
        if problems:
            raise TeacherError("the teacher's scores are not valid: " + "; ".join(problems))

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
        if self.reward is not None:
            self.reward.close()


def _empty_like(result: ScoreResult):
    from maskroll.proto.scoring import ScoredTokens

    k = result.completions[0].topk_ids.shape[-1]
    return ScoredTokens(
        np.zeros(0, np.float32),
        np.zeros(0, np.int32),
        np.zeros((0, k), np.int32),
        np.zeros((0, k), np.float32),
    )


# ---- the vocabulary check ---------------------------------------------------------------------------


def tokenizer_fingerprint(directory: str | Path) -> str | None:
    """proto/tokenizer_fingerprint.py's fingerprint of a local tokenizer directory (tokenizer.json, else a
    Hugging Face tokenizer's get_vocab(): the same map), or None when `directory` holds no tokenizer."""
    path = Path(directory)
    if not path.is_dir():
        return None
    found = fingerprint_tokenizer_json(path)
    if found is None and (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        found = vocab_fingerprint(AutoTokenizer.from_pretrained(str(path)).get_vocab())
    return found


def vocabulary_problems(
    student: ServerInfo, teachers: dict[str, ServerInfo], student_tokenizer: str | Path | None = None
) -> tuple[list[str], list[str]]:
    """(why a teacher may not teach the student, what could not be compared). Compared: each teacher's
    GetInfo vocab_size with the student's, then the tokenizer fingerprints — the student's of
    `student_tokenizer` when given (the tokenizer the stage decodes with), else its replica's GetInfo
    (else its model directory's, when local); a teacher's from its GetInfo (else its model directory's)."""
    problems, skipped = [], []
    where = student_tokenizer if student_tokenizer is not None else student.model
    if student_tokenizer is not None:
        student_fp = tokenizer_fingerprint(student_tokenizer)
    else:
        student_fp = student.tokenizer_fingerprint or tokenizer_fingerprint(student.model)
    if student_fp is None:
        skipped.append(f"the student's tokenizer ({where}) has no fingerprint: not in GetInfo, not local")
    for address, t in teachers.items():
        if t.vocab_size != student.vocab_size:
            problems.append(
                f"teacher {address} ({t.model}) has vocab_size {t.vocab_size}, the student "
                f"({student.model}) {student.vocab_size}"
            )
            continue
        teacher_fp = t.tokenizer_fingerprint or tokenizer_fingerprint(t.model)
        if teacher_fp is None:
            skipped.append(
                f"teacher {address}'s tokenizer ({t.model}) has no fingerprint: not in GetInfo, not local"
            )
        elif student_fp is not None and teacher_fp != student_fp:
            problems.append(
                f"teacher {address} ({t.model}) has another tokenizer than the student ({where}): same "
                f"vocab_size {t.vocab_size}, but its id → token map differs ({teacher_fp} != {student_fp})"
            )
    return problems, skipped


async def student_info(
    redis, keys, *, token: str | None, wait_s: float, root_certs: bytes | None = None
) -> ServerInfo:
    """GetInfo of a live student replica of the namespace (from its registry heartbeat), waiting up to
    `wait_s` for one to register."""
    from maskroll.proto.heartbeat import decode_heartbeat

    deadline, said = time.monotonic() + wait_s, False
    while True:
        async for key in redis.scan_iter(match=keys.replica_pattern, count=100):
            raw = await redis.get(key)
            address = decode_heartbeat(raw).address if raw else ""
            if address:
                async with RolloutClient(address, token=token, root_certs=root_certs, timeout=10.0) as c:
                    try:
                        return await c.info()
                    except RolloutError as e:
                        log.warning("student replica %s: %s", address, e)
        if time.monotonic() > deadline:
            raise VocabularyMismatch(
                f"no live student replica registered in namespace {keys.namespace!r} within {wait_s:g} s: "
                "its vocabulary cannot be compared with the teachers' (start a replica, or raise "
                "--student-wait-s)"
            )
        if not said:
            log.info("waiting for a student replica in namespace %s (its vocabulary)", keys.namespace)
            said = True
        await asyncio.sleep(1.0)


async def check_vocabulary(pool: TeacherPool, redis, keys, cfg) -> tuple[ServerInfo, list[ServerInfo]]:
    """(the student's info, the teachers'): VocabularyMismatch naming every teacher that may not teach."""
    teachers = dict(zip(pool.addresses, await pool.infos(), strict=True))
    student = await student_info(
        redis, keys, token=cfg.token, wait_s=cfg.student_wait_s, root_certs=pool.root_certs
    )
    problems, skipped = vocabulary_problems(student, teachers, cfg.tokenizer)
    for address, t in teachers.items():  # what every record would be refused for: say it once, here
        if cfg.teacher_k > t.max_logprobs_k:
            problems.append(
                f"teacher {address} scores at most K = {t.max_logprobs_k}; --teacher-k {cfg.teacher_k}"
            )
        if t.engine == "vllm" and cfg.teacher_temperature != 1.0:
            problems.append(
                f"teacher {address} runs vLLM, which scores only temperature 1; --teacher-temperature "
                f"{cfg.teacher_temperature:g} needs torch teachers"
            )
    if problems:
        raise VocabularyMismatch("; ".join(problems))
    for s in skipped:
        log.warning("vocabulary check: %s; compared vocab_size only", s)
    return student, list(teachers.values())
