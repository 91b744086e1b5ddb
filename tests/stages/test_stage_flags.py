"""The stages' flags (`maskroll reward`, `maskroll teacher`) from their configs, which share StageConfig's
fields: each flag's help is its field's entry in the config's docstring or, for an inherited field, its
base's (app/flags.py `field_docs` walks the MRO), and each stage keeps its own defaults."""

from __future__ import annotations

import dataclasses

import pytest

from maskroll.app import reward, teacher
from maskroll.app.flags import field_docs
from maskroll.stages.config import RewardStageConfig, StageConfig, TeacherStageConfig

URL = "redis://127.0.0.1:1"


def test_every_flag_of_both_stages_has_its_fields_doc() -> None:
    base = field_docs(StageConfig)
    for cls, flags in ((RewardStageConfig, reward.FLAGS), (TeacherStageConfig, teacher.FLAGS)):
        docs = field_docs(cls)
        assert set(flags) == {f.name for f in dataclasses.fields(cls)}
        assert all(docs.get(name) for name in flags), [n for n in flags if not docs.get(n)]
    # inherited: the base's words, continuation lines joined
    assert (
        field_docs(TeacherStageConfig)["max_deliveries"]
        == base["max_deliveries"]
        == (
            "a record delivered this many times without being scored (its worker died on it each time) "
            "is dead-lettered"
        )
    )
    assert field_docs(RewardStageConfig) == base  # the reward stage words nothing again
    # worded again by the teacher stage
    assert (
        field_docs(TeacherStageConfig)["timeout_s"] == "seconds one Score call (or one reward call) may take"
    )
    assert base["timeout_s"].startswith("seconds one reward call may take")


def test_help_shows_inherited_docs_and_each_stages_defaults(capsys) -> None:
    helps = {}
    for name, module in (("reward", reward), ("teacher", teacher)):
        with pytest.raises(SystemExit) as e:
            module.parse(["--help"])
        assert e.value.code == 0
        helps[name] = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for text in helps.values():
        assert "--max-len MAX_LEN the most unconsumed records the trainer's rollout stream may hold" in text
    assert "--timeout-s TIMEOUT_S seconds one reward call may take" in helps["reward"]
    assert "--timeout-s TIMEOUT_S seconds one Score call (or one reward call) may take" in helps["teacher"]


def test_each_stage_parses_its_own_defaults_and_flags() -> None:
    r = reward.parse(["--redis-url", URL, "--reward", "m:f", "--max-deliveries", "3"])
    assert (r.timeout_s, r.claim_idle_s, r.max_deliveries, r.max_len) == (30.0, 60.0, 3, 100_000)
    t = teacher.parse(["--redis-url", URL, "--teacher", "127.0.0.1:5", "--claim-idle-s", "90"])
    assert (t.timeout_s, t.claim_idle_s, t.max_deliveries, t.teacher_k) == (60.0, 90.0, 5, 20)
    assert t.teachers == ("127.0.0.1:5",) and t.reward == ""
    assert isinstance(r, StageConfig) and isinstance(t, StageConfig)
    assert not isinstance(t, RewardStageConfig)


def test_the_shared_limits_name_the_offending_value() -> None:
    with pytest.raises(ValueError, match=r"claim_idle_s=50 must exceed timeout_s=60.0"):
        TeacherStageConfig(redis_url=URL, teacher="127.0.0.1:5", claim_idle_s=50)
    with pytest.raises(ValueError, match=r"max_len=0; expected an int in \[1, 1000000000\]"):
        RewardStageConfig(redis_url=URL, reward="m:f", max_len=0)
    with pytest.raises(ValueError, match=r"reward='nope'; expected MODULE:FUNCTION, or none"):
        TeacherStageConfig(redis_url=URL, teacher="127.0.0.1:5", reward="nope")
