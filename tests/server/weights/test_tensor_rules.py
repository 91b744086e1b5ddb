"""The one weight rule set (`server/weights/tensor_rules.py`) that both engines ask: names (tied storage
counted once), shapes, dtype kinds and finite values as served, on hand-built layouts and tensors; and
`check_checkpoint` (the vLLM engine's check of a checkpoint before it pauses) on written files."""

from __future__ import annotations

from pathlib import Path

import pytest

from maskroll.server.weights.tensor_rules import (
    Layout,
    check_checkpoint,
    compare,
    finite_problem,
    floating_dtype,
    nonfinite,
)

torch = pytest.importorskip("torch")

F, I = True, False  # floating, not


def test_compare_names_every_kind_of_mismatch() -> None:
    served = {"a": Layout((2, 3), F), "b": Layout((4,), F), "c": Layout((1,), I)}
    assert not compare({"a": Layout((2, 3), F), "b": Layout((4,), F), "c": Layout((1,), I)}, served)
    m = compare({"b": Layout((2, 2), F), "c": Layout((1,), F), "z": Layout((1,), F)}, served)
    assert m.missing == ["a"] and m.unexpected == ["z"]
    assert m.wrong_shape == [("b", (2, 2), (4,))] and m.wrong_dtype == ["c"]
    # an integer tensor in a float's place is wrong even at the right shape; float64 for float32 is not
    assert compare(
        {"a": Layout((2, 3), I), "b": Layout((4,), F), "c": Layout((1,), I)}, served
    ).wrong_dtype == ["a"]


def test_a_tied_tensor_stored_once_under_either_name_is_not_missing() -> None:
    served = {"embed": Layout((8, 2), F), "lm_head": Layout((8, 2), F), "norm": Layout((2,), F)}
    storage = {"embed": 1, "lm_head": 1, "norm": 2}
    for stored in ("embed", "lm_head"):
        new = {stored: Layout((8, 2), F), "norm": Layout((2,), F)}
        assert not compare(new, served, storage=storage)
        assert compare(new, served).missing == sorted({"embed", "lm_head"} - {stored})  # untied: missing
    assert compare({"embed": Layout((8, 2), F)}, served, storage=storage).missing == ["norm"]


def test_floating_dtype_names_of_safetensors_and_torch() -> None:
    floating = ["F32", "F16", "BF16", "F8_E4M3", "float32", "bfloat16", "float8_e5m2", "torch.float16"]
    assert all(floating_dtype(n) for n in floating)
    assert not any(floating_dtype(n) for n in ["I64", "U8", "BOOL", "int32", "bool", "uint8", "complex64"])


def test_nonfinite_counts_exactly_and_finite_is_judged_as_served() -> None:
    t = torch.ones(3, 4)
    assert nonfinite(t) == 0 and nonfinite(torch.arange(5)) == 0  # an integer tensor holds no NaN
    t[0, 1], t[2, 3], t[1, 0] = float("nan"), float("inf"), -float("inf")
    assert nonfinite(t) == 3
    big = torch.full((2,), 3e38)  # finite in float32; the sum overflows, so the exact count decides
    assert nonfinite(big) == 0
    assert finite_problem("w", big, "ckpt") is None
    # beyond bfloat16 / float16 range: inf once cast to the served dtype
    wide = torch.tensor([1.0, 1e39], dtype=torch.float64)
    assert finite_problem("w", wide, "ckpt") is None
    msg = finite_problem("w", wide.to(torch.float32), "ckpt", arrived=torch.float64)
    assert msg == (
        "'w' in ckpt has 1 non-finite values (NaN or inf after the cast to torch.float32); refused, the "
        "current weights are kept"
    )
    assert "after the cast" not in finite_problem("w", t, "ckpt", arrived=t.dtype)


def test_the_torch_engine_checks_a_state_dict_by_these_rules_and_names_the_first_bad_key() -> None:
    from maskroll.server.engines.torch_weights import checked

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(8, 2)
            self.head = torch.nn.Linear(2, 8, bias=False)
            self.head.weight = self.embed.weight  # tied: one storage, two names
            self.norm = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))

    model, cpu = Tied(), torch.device("cpu")
    good = {"embed.weight": torch.full((8, 2), 0.5, dtype=torch.float64), "norm": torch.ones(2)}
    out = checked(model, dict(good), "ckpt", cpu)
    assert out["embed.weight"].dtype == torch.float32 and out["norm"].dtype == torch.float16  # cast
    assert set(checked(model, {"head.weight": torch.ones(8, 2), "norm": torch.ones(2)}, "ckpt", cpu)) == {
        "head.weight",
        "norm",
    }  # the tied twin, stored under the other name
    for tensors, message in [
        ({**good, "extra": torch.ones(1)}, "unexpected key 'extra' in ckpt (1 unexpected)"),
        ({"norm": torch.ones(2)}, "missing key 'embed.weight' in ckpt (2 missing)"),
        ({**good, "norm": torch.ones(3)}, "shape of 'norm': checkpoint (3,), model (2,)"),
        (
            {**good, "norm": torch.ones(2, dtype=torch.int64)},
            "'norm' has dtype torch.int64; expected a floating-point tensor",
        ),
        (
            {**good, "norm": torch.tensor([1.0, 7e4])},  # finite in float32, inf in the model's float16
            "'norm' in ckpt has 1 non-finite values (NaN or inf after the cast to torch.float16); refused, "
            "the current weights are kept",
        ),
    ]:
        with pytest.raises(ValueError) as err:
            checked(model, dict(tensors), "ckpt", cpu)
        assert str(err.value) == message


def test_check_checkpoint_applies_the_weight_rules(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    def write(name: str, tensors: dict) -> Path:
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        return d

    ref = write("ref", {"a": torch.zeros(2, 3), "b": torch.zeros(4)})
    check_checkpoint(write("same", {"a": torch.ones(2, 3), "b": torch.ones(4, dtype=torch.float64)}), ref)
    with pytest.raises(ValueError, match="missing \\['b'\\]"):
        check_checkpoint(write("missing", {"a": torch.ones(2, 3)}), ref)
    with pytest.raises(ValueError, match="wrong shape"):
        check_checkpoint(write("shape", {"a": torch.ones(3, 2), "b": torch.ones(4)}), ref)
    # the rules the torch engine applies too (server/weights/tensor_rules.py): dtype kinds, and finite
    # values as served, after the cast to the engine's dtype
    ints = write("ints", {"a": torch.ones(2, 3, dtype=torch.int64), "b": torch.ones(4)})
    with pytest.raises(ValueError, match=r"wrong dtype \(floating point or not\) \['a'\]"):
        check_checkpoint(ints, ref)
    wide = write("wide", {"a": torch.ones(2, 3, dtype=torch.float64) * 1e39, "b": torch.ones(4)})
    check_checkpoint(wide, ref)  # finite as stored
    with pytest.raises(
        ValueError, match=r"'a' in .* has 6 non-finite values .*after the cast to torch\.float32"
    ):
        check_checkpoint(wide, ref, dtype="float32")
    truncated = write("truncated", {"a": torch.ones(2, 3), "b": torch.ones(4)})
    path = truncated / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        check_checkpoint(truncated, ref)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        check_checkpoint(tmp_path / "empty", ref)


def test_a_push_of_a_tied_model_carries_the_shared_tensor_once(tmp_path: Path) -> None:
    """A model whose config ties the head to the embedding (SmolLM2) may store both; a push sends one."""
    import json

    from safetensors.torch import save_file

    def write(name: str, tensors: dict, tied: bool | None = None) -> Path:
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        if tied is not None:
            (d / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
        return d

    both = {"model.embed_tokens.weight": torch.zeros(8, 2), "lm_head.weight": torch.zeros(8, 2)}
    pushed = write("pushed", {"model.embed_tokens.weight": torch.ones(8, 2)})
    check_checkpoint(pushed, write("tied", both, tied=True))
    for name, tied in (("untied", False), ("no-config", None)):  # two tensors of their own: both needed
        with pytest.raises(ValueError, match=r"missing \['lm_head\.weight'\]"):
            check_checkpoint(pushed, write(name, both, tied=tied))
