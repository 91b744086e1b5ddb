"""The vocabulary kernels (trainer_adapter/kernels.py, docs/math.md §8): the eager anchor of logsumexp
and its fallback, the compiled kernels against the eager ones and the float64 reference, the choice
of kernel, and the fallback after a compile failure.

Stated tolerances, compiled vs eager in float32 (both are float32 arithmetic in a different order):
log π_a and logsumexp within 2e-5 absolute (|lse| ≤ 20 here: a few ulp), Σ π² within 2e-5 relative,
the gradient g·(e_a − π)/T within 2e-6 absolute (|g/T| ≤ 4: a few ulp). bfloat16 logits: the same on
log π_a and the statistics (both upcast exactly), the bfloat16 gradient within one bfloat16 ulp of the
larger entry (2⁻⁷ relative).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import reference_impl as ref
import torch
from adapter_helpers import run_masks

from maskroll.trainer_adapter import MaskConfig, kernels, token_logprobs
from maskroll.trainer_adapter.processed import Workspace

F32_LSE_ATOL = 2e-5
F32_SUMSQ_RTOL = 2e-5
F32_GRAD_ATOL = 2e-6


def _reference_stats(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    x = logits.double().numpy() / temperature.double().numpy()[:, None]
    lse = np.array([ref.logsumexp(row) for row in x])
    pi = np.exp(x - lse[:, None])
    return lse, (pi**2).sum(-1)


def test_eager_lse_anchored_at_a_and_its_fallback_rows() -> None:
    """lse = x_a − log π_a where π_a is a trustworthy float32 anchor; rows where π_a underflows
    (a 150 nats below the max) or is 0 (−inf logit) take max x − log max π. Both within float32
    rounding of the float64 reference."""
    g = torch.Generator().manual_seed(3)
    n, v = 6, 400
    logits = torch.randn(n, v, generator=g) * 3
    ids = torch.tensor([0, 5, 9, 17, 33, 100])
    logits[1, 5] = logits[1].max() - 150.0  # π_a = e^-150·… underflows in float32
    logits[3, 17] = float("-inf")  # π_a = 0
    temp = torch.tensor([1.0, 1.0, 0.7, 1.0, 1.3, 1.0], dtype=torch.float64)
    st = kernels.chunk_stats(
        logits, temp, ids, None, compiled=False, top_k=None, top_p=None, work=Workspace()
    )
    lse, sum_sq = _reference_stats(logits, temp)
    np.testing.assert_allclose(st.lse.double().numpy(), lse, rtol=0, atol=F32_LSE_ATOL)
    np.testing.assert_allclose(st.sum_sq.double().numpy(), sum_sq, rtol=F32_SUMSQ_RTOL)
    x_a = logits[torch.arange(n), ids].double() / temp
    np.testing.assert_allclose(st.x_a.double().numpy(), x_a.numpy(), rtol=1e-7)
    assert float(st.x_a[3]) == float("-inf")  # log π_a = −inf for an impossible token, lse still finite
    assert np.isfinite(st.lse.numpy()).all()


@pytest.mark.parametrize(
    ("setting", "vocab", "dtype", "top_k", "want"),
    [
        ("auto", kernels.AUTO_MIN_VOCAB, torch.float32, None, True),
        ("auto", kernels.AUTO_MIN_VOCAB, torch.bfloat16, None, True),
        ("auto", kernels.AUTO_MIN_VOCAB - 1, torch.float32, None, False),  # toy vocabularies stay eager
        ("auto", kernels.AUTO_MIN_VOCAB, torch.float64, None, False),  # float64: the reference arithmetic
        ("auto", kernels.AUTO_MIN_VOCAB, torch.float32, 50, False),  # replayed truncation runs eager
        (True, 8, torch.float64, None, True),
        (True, 8, torch.float32, 5, False),
        (False, kernels.AUTO_MIN_VOCAB, torch.float32, None, False),
    ],
)
def test_which_kernel_runs(setting, vocab: int, dtype: torch.dtype, top_k, want: bool) -> None:
    logits = torch.empty(1, vocab, dtype=dtype)
    assert kernels.use_compiled(setting, logits, top_k, None) is want


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_compile_setting_is_validated(bad) -> None:
    with pytest.raises(ValueError, match=rf"MaskConfig.compile={bad!r}; expected 'auto', True or False"):
        MaskConfig(compile=bad)
    with pytest.raises(ValueError, match=rf"compile={bad!r}; expected 'auto', True or False"):
        token_logprobs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), compile=bad)


def test_compile_failure_warns_once_and_runs_eager(monkeypatch) -> None:
    """A compiled kernel that raises (here: a stand-in for a missing C++ compiler) switches the process
    to the eager kernels with one RuntimeWarning naming the error; results are the eager ones."""

    def broken_compile(fn, **_):
        def call(*args):
            raise RuntimeError("CppCompileError: g++ not found")

        return call

    monkeypatch.setattr(kernels, "_broken", None)
    monkeypatch.setattr(kernels, "_compiled", {})
    monkeypatch.setattr(torch, "compile", broken_compile)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 50, generator=g)
    ids = torch.randint(0, 50, (9,), generator=g)
    x_eager = logits.clone().requires_grad_()
    want = token_logprobs(x_eager, ids, temperature=0.8, compile=False)
    want.sum().backward()

    x = logits.clone().requires_grad_()
    with pytest.warns(RuntimeWarning, match=r"torch.compile of the vocabulary kernels failed \(RuntimeError: "
                      r"CppCompileError: g\+\+ not found\); using the eager kernels"):  # fmt: skip
        got = token_logprobs(x, ids, temperature=0.8, compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, and the backward runs eager too
        got.sum().backward()
        token_logprobs(logits, ids, temperature=0.8, compile=True)
    assert kernels.compile_failure() == "RuntimeError: CppCompileError: g++ not found"
    assert kernels.use_compiled(True, logits, None, None) is False
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x_eager.grad, rtol=0, atol=0)


@pytest.mark.slow  # two Inductor compiles per dtype: ≈ 10–40 s on 2 shared cores, less from its disk cache
def test_compiled_kernels_match_eager_and_reference() -> None:
    """token_logprobs (forward stats and backward) and compute_masks' own pass, compiled vs eager on the
    same float32 record (per-token temperatures, three chunks of 32/32/6 rows: one compile for any
    row count), and both against the float64 reference of reference_impl.py; bfloat16 logits too."""
    assert kernels.compile_failure() is None
    rec = ref.make_record(seed=11, n=70, v=300, k=10, temperature=np.linspace(0.6, 1.4, 70))
    temp = torch.tensor(rec.temperature)
    ids = torch.tensor(rec.sampled_ids)
    upstream = torch.tensor(np.random.default_rng(1).standard_normal(70), dtype=torch.float32)
    want = ref.record_reference(rec)
    want_lp = np.array([t.logpi_a for t in want])

    def run(dtype: torch.dtype, compile: bool):
        x = torch.tensor(rec.logits, dtype=dtype).requires_grad_()
        lp, st = token_logprobs(x, ids, temperature=temp, chunk_tokens=32, return_stats=True, compile=compile)
        (lp * upstream).sum().backward()
        return lp.detach(), st, x.grad

    lp_e, st_e, grad_e = run(torch.float32, False)
    lp_c, st_c, grad_c = run(torch.float32, True)
    assert kernels.compile_failure() is None  # the compiled kernels ran, not the fallback
    torch.testing.assert_close(lp_c, lp_e, rtol=0, atol=F32_LSE_ATOL)
    torch.testing.assert_close(st_c.lse, st_e.lse, rtol=0, atol=F32_LSE_ATOL)
    torch.testing.assert_close(st_c.sum_sq, st_e.sum_sq, rtol=F32_SUMSQ_RTOL, atol=0)
    torch.testing.assert_close(grad_c, grad_e, rtol=0, atol=F32_GRAD_ATOL)
    np.testing.assert_allclose(lp_c.double().numpy(), want_lp, rtol=0, atol=F32_LSE_ATOL)
    _, sum_sq = _reference_stats(torch.tensor(rec.logits), temp)
    np.testing.assert_allclose(st_c.sum_sq.double().numpy(), sum_sq, rtol=F32_SUMSQ_RTOL)
    # d Σ g log π_a / dℓ = g (e_a − π) / T, from the reference's float64 π
    pi = np.exp(np.stack([ref.processed_logprobs(rec.logits[i], rec.temperature[i]) for i in range(70)]))
    onehot = np.eye(300)[rec.sampled_ids]
    want_grad = upstream.double().numpy()[:, None] * (onehot - pi) / rec.temperature[:, None]
    np.testing.assert_allclose(grad_c.double().numpy(), want_grad, rtol=0, atol=F32_GRAD_ATOL)
    assert float(grad_c.abs().max()) > 0.5  # a real gradient

    # compute_masks' own vocabulary pass (no vocab_stats): same decisions, D and P̂ within float32 rounding
    cfg = dict(
        method="predictive", divergence="topk_kl", estimator="proportional", delta=0.05, chunk_tokens=32
    )
    m_e = run_masks(rec, MaskConfig(**cfg, compile=False), dtype=torch.float32, per_token_temperature=True)
    m_c = run_masks(rec, MaskConfig(**cfg, compile=True), dtype=torch.float32, per_token_temperature=True)
    assert torch.equal(m_c.keep, m_e.keep) and 0 < int((~m_c.keep).sum()) < 70
    torch.testing.assert_close(m_c.divergence, m_e.divergence, rtol=1e-4, atol=1e-6)
    # P̂ is a difference of O(π) terms: its float32 rounding is absolute, ≈ 1e-6 in either kernel
    torch.testing.assert_close(m_c.predicted_direction, m_e.predicted_direction, rtol=1e-4, atol=2e-6)
    want_d = np.array([t.divergence["topk_kl"] for t in want])
    np.testing.assert_allclose(m_c.divergence.double().numpy(), want_d, rtol=1e-4, atol=1e-6)

    # bfloat16 logits: the compiled kernels upcast in the loop instead of into a workspace
    lp_be, st_be, grad_be = run(torch.bfloat16, False)
    lp_bc, st_bc, grad_bc = run(torch.bfloat16, True)
    assert kernels.compile_failure() is None
    torch.testing.assert_close(lp_bc, lp_be, rtol=0, atol=F32_LSE_ATOL)
    torch.testing.assert_close(st_bc.sum_sq, st_be.sum_sq, rtol=F32_SUMSQ_RTOL, atol=0)
    assert grad_bc.dtype == torch.bfloat16
    torch.testing.assert_close(grad_bc.float(), grad_be.float(), rtol=2**-7, atol=F32_GRAD_ATOL)
