"""The loss across data-parallel ranks (docs/math.md "Across ranks"; issue 21).

- Equivalence on a real model: 2 gloo ranks (torch.multiprocessing.spawn), each on its share of whole
  GRPO groups, DistributedDataParallel averaging the gradients, take one SGD step; the parameters equal
  one process's step on all the records — float64, |Δ| ≤ 1e-12 per parameter (steps are ~1e-2) — for
  the three aggregations with the predictive and the DPPO mask, and with the KL-to-reference term.
  Without `world` the same two ranks step elsewhere (a mean of per-rank means), so the test can fail.
- The denominators by hand, with an in-process World (threads, a sum over a list), for policy_loss and
  the distillation losses.
- TorchCollective over real gloo (scatter, broadcast, all_gather, the scatter error on every rank) and
  single_process().
"""

from __future__ import annotations

import math
import pickle
import socket
import threading

import pytest
import torch
from dp_loss_helpers import CASES, MASK, flat_params, make_records, one_step, perturbed, rank_main, tiny_model

from maskroll.trainer_adapter import (
    MaskConfig,
    collate,
    compute_masks_for,
    distill_loss,
    policy_loss,
    single_process,
    student_logprobs,
)

TOL = 1e-12  # float64; the two computations differ only in summation order (per-rank forward, all-reduce)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def setup():
    model = tiny_model(0)
    records, rewards = make_records(model)
    ref = perturbed(model, seed=12, scale=0.2)  # the KL term's π_ref
    states = {"model": model.state_dict(), "ref": ref.state_dict()}
    return {"states": states, "records": records, "rewards": rewards, "before": flat_params(model)}


@pytest.fixture(scope="module")
def two_ranks(setup, tmp_path_factory):
    """Every case's result on both ranks (one spawn for all of them: starting ranks is the slow part)."""
    d = tmp_path_factory.mktemp("dp")
    payload = d / "payload.pkl"
    payload.write_bytes(pickle.dumps(setup))
    torch.multiprocessing.spawn(rank_main, args=(2, _free_port(), str(payload), str(d / "out")), nprocs=2)
    return [torch.load(d / f"out.{r}", weights_only=False) for r in range(2)]


def _single(setup, case) -> tuple[dict, torch.Tensor]:
    model, ref = tiny_model(0), tiny_model(0)
    model.load_state_dict(setup["states"]["model"])
    ref.load_state_dict(setup["states"]["ref"])
    stats = one_step(model, ref, setup["records"], setup["rewards"], case)
    return stats, flat_params(model)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_two_ranks_step_as_one(setup, two_ranks, case) -> None:
    want_stats, want = _single(setup, case)
    r0, r1 = (two_ranks[r][(case.name, True)] for r in range(2))
    # The mask matters: some response tokens kept and some masked, and the ranks together see the batch.
    assert r0["kept"] + r1["kept"] == want_stats["kept"] > 0
    assert r0["masked"] + r1["masked"] == want_stats["masked"] > 0
    # DDP keeps the replicas identical, and they equal one process's step on all the records.
    assert torch.equal(r0["params"], r1["params"])
    assert (want - setup["before"]).abs().max().item() > 1e-3  # a real step, far above the tolerance
    assert (r0["params"] - want).abs().max().item() <= TOL
    # The loss is calibrated for averaging: the mean of the ranks' losses is the one-process loss.
    assert (r0["loss"] + r1["loss"]) / 2 == pytest.approx(want_stats["loss"], rel=1e-12, abs=1e-14)

    # Without `world`, each rank normalises by its own share: the step differs (the test can fail).
    n0 = two_ranks[0][(case.name, False)]["params"]
    assert (n0 - want).abs().max().item() > 1e-6


def test_the_masks_matter_on_these_records(setup) -> None:
    # Near and far tokens, and predictive and DPPO decide differently: the mask cases test two masks.
    b = collate(setup["records"], setup["rewards"])
    model = tiny_model(0)
    model.load_state_dict(setup["states"]["model"])
    with torch.no_grad():
        out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids)
    logits = out.logits[:, b.completion_logits_slice]
    res = {
        m: compute_masks_for(b, logits, config=MaskConfig(method=m, **MASK)) for m in ("predictive", "dppo")
    }
    valid = b.response_mask
    far = int((res["dppo"].far & valid).sum())
    keep = {m: r.keep & valid for m, r in res.items()}
    assert 0 < far < int(valid.sum())
    assert int((keep["predictive"] != keep["dppo"]).sum()) > 0


def test_torch_collective_over_gloo(two_ranks) -> None:
    r0, r1 = two_ranks
    assert (r0["rank"], r0["world_size"], r1["rank"], r1["world_size"]) == (0, 2, 1, 2)
    assert (r0["groups"], r1["groups"]) == (["g0", "g1"], ["g2"])  # whole groups, as scattered
    assert r0["gathered"] == r1["gathered"] == [1, 11]
    for r in (r0, r1):
        assert r["scatter_error"] == "scatter from rank 0: got 1 objects; expected one per rank (2)"


def test_single_process() -> None:
    one = single_process()
    assert (one.rank, one.world_size) == (0, 1)
    assert one.broadcast({"v": 3}) == {"v": 3}
    assert one.scatter([[1, 2]]) == [1, 2]
    assert one.all_gather(7) == [7]
    one.barrier()
    x = torch.tensor([2.0, 3.0], requires_grad=True)
    s = one.sum(x)
    assert s.tolist() == [2.0, 3.0] and not s.requires_grad
    with pytest.raises(ValueError, match="expected one"):
        one.scatter([1, 2])
    with pytest.raises(ValueError, match="rank 0 only"):
        one.broadcast(1, src=1)
    # A one-rank world changes nothing.
    lp = torch.tensor([[-1.0, -2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    args = (lp, torch.full_like(lp, -1.5), torch.tensor([2.0], dtype=torch.float64), mask)
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        a, _ = policy_loss(*args, response_mask=mask, aggregation=agg, max_len=4)
        b, _ = policy_loss(*args, response_mask=mask, aggregation=agg, max_len=4, world=one)
        assert a.item() == b.item()


# ---- an in-process World: W threads, a sum over a list ------------------------------------------------


class ThreadWorld:
    """World for W threads of one process: `sum` waits for every thread's value and returns their sum."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._slots: list = [None] * world_size
        self._barrier = threading.Barrier(world_size)

    def rank_view(self, rank: int) -> _RankView:
        return _RankView(self, rank)


class _RankView:
    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world, self.rank, self.world_size = world, rank, world.world_size

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        w = self.world
        w._slots[self.rank] = x.detach().clone()
        w._barrier.wait()
        total = sum(w._slots[1:], w._slots[0].clone())
        w._barrier.wait()  # every thread has read the slots before the next sum writes them
        return total


def _run_ranks(world: ThreadWorld, fn) -> list:
    out: list = [None] * world.world_size
    errors: list = []

    def body(rank: int) -> None:
        try:
            out[rank] = fn(rank, world.rank_view(rank))
        except BaseException as exc:  # surfaced below; a thread's exception would be lost
            errors.append(exc)
            world._barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def test_denominators_by_hand() -> None:
    # Rank 0: one sequence of 3 response tokens; rank 1: two sequences of 2 and 3 (padded to T = 4).
    # ℓ_token = −A · w · M · log π_a with w = 1 (π = μ) and M = 1: ℓ = −A · log π_a.
    f64 = torch.float64
    shares = [
        (torch.tensor([[-1.0, -2.0, -3.0]], dtype=f64), torch.tensor([[1, 1, 1]]), [1.0]),
        (torch.tensor([[-1.0, -1.0, 0.0, 0.0], [-2.0, -2.0, -2.0, 0.0]], dtype=f64),
         torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]]), [2.0, -1.0]),
    ]  # fmt: skip
    # Per-token ℓ: rank 0: 1, 2, 3 (sum 6); rank 1: 2, 2 (sum 4) and −2, −2, −2 (sum −6).
    world = ThreadWorld(2)

    def loss(rank: int, w, agg: str) -> float:
        lp, mask, adv = shares[rank]
        mask = mask.bool()
        out, _ = policy_loss(
            lp, lp.detach(), torch.tensor(adv, dtype=f64), mask, response_mask=mask,
            aggregation=agg, max_len=5, world=w,
        )  # fmt: skip
        return out.item()

    # token_mean: 8 tokens in all; W · (this rank's sum) / 8.
    assert _run_ranks(world, lambda r, w: loss(r, w, "token_mean")) == pytest.approx([2 * 6 / 8, 2 * -2 / 8])
    # seq_mean_token_mean: 3 sequences in all; per sequence 6/3 = 2 | 4/2 = 2, −6/3 = −2.
    assert _run_ranks(world, lambda r, w: loss(r, w, "seq_mean_token_mean")) == pytest.approx(
        [2 * 2 / 3, 2 * 0 / 3]
    )
    # seq_mean_token_sum_norm, L = 5: per sequence 6/5 | 4/5, −6/5.
    assert _run_ranks(world, lambda r, w: loss(r, w, "seq_mean_token_sum_norm")) == pytest.approx(
        [2 * 1.2 / 3, 2 * -0.4 / 3]
    )
    # One process on the padded union: the mean of the ranks' losses (what gradient averaging takes).
    lp = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-1.0, -1.0, 0.0, 0.0], [-2.0, -2.0, -2.0, 0.0]], dtype=f64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 0]]).bool()
    adv = torch.tensor([1.0, 2.0, -1.0], dtype=f64)
    for agg, want in (
        ("token_mean", 4 / 8),
        ("seq_mean_token_mean", 2 / 3),
        ("seq_mean_token_sum_norm", 0.8 / 3),
    ):
        one, _ = policy_loss(lp, lp, adv, mask, response_mask=mask, aggregation=agg, max_len=5)
        assert one.item() == pytest.approx(want)


def test_kl_term_counts_its_own_tokens() -> None:
    # The KL term's denominator is its own count, summed over ranks: a −inf log π_a (a replayed
    # truncation) is not counted on rank 1, so 2 + 1 = 3 counted tokens in all, not 4.
    f64 = torch.float64
    lps = [torch.tensor([-1.0, -2.0], dtype=f64), torch.tensor([-1.0, float("-inf")], dtype=f64)]
    refs = [torch.tensor([-1.5, -1.0], dtype=f64), torch.tensor([-0.5, -1.0], dtype=f64)]

    def k3(lp: float, ref: float) -> float:
        d = ref - lp
        return math.exp(d) - d - 1

    def loss(rank: int, w) -> float:
        lp = lps[rank]
        keep = torch.zeros(2, dtype=torch.bool)  # no policy term: the KL term alone
        mu = torch.full_like(lp, -1.0)
        out, _ = policy_loss(
            lp, mu, torch.zeros(2, dtype=f64), keep, ref_logprobs=refs[rank], kl_coef=1.0,
            kl_is_weight=False, world=w,
        )  # fmt: skip
        return out.item()

    got = _run_ranks(ThreadWorld(2), loss)
    total0 = k3(-1.0, -1.5) + k3(-2.0, -1.0)
    total1 = k3(-1.0, -0.5)
    assert got == pytest.approx([2 * total0 / 3, 2 * total1 / 3], rel=1e-12)


def test_sum_norm_across_ranks_needs_max_len() -> None:
    lp = torch.zeros(1, 3, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="needs max_len"):
        policy_loss(
            lp, lp, torch.ones(1), mask, aggregation="seq_mean_token_sum_norm", world=single_process()
        )


@pytest.mark.parametrize("kind", ["forward_kl", "jsd"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_distill_loss_across_ranks(kind: str, aggregation: str) -> None:
    """W ranks' averaged gradients of distill_loss(world=…) equal one process's on the padded union."""
    gen = torch.Generator().manual_seed(5)
    f64, v, k = torch.float64, 11, 3
    lengths = [[2], [4, 1]]  # rank 0: one sequence of 2 tokens; rank 1: 4 and 1 (T = 4)
    t_all = 4
    union = [n for share in lengths for n in share]
    logits = torch.randn(len(union), t_all, v, generator=gen, dtype=f64)  # [B, T, V]
    ids = torch.randint(0, v, (len(union), t_all), generator=gen)
    t_lp = torch.log_softmax(torch.randn(len(union), t_all, v, generator=gen, dtype=f64), -1)  # teacher
    t_ids = t_lp.topk(k, -1).indices  # [B, T, K]
    mask = torch.arange(t_all)[None, :] < torch.tensor(union)[:, None]  # [B, T]

    def loss(lg: torch.Tensor, rows: slice, t: int, world) -> torch.Tensor:
        s = student_logprobs(lg, ids[rows, :t], t_ids[rows, :t], temperature=1.3, compile=False)
        out, _ = distill_loss(
            s, ids[rows, :t], t_ids[rows, :t], t_lp[rows, :t].gather(-1, t_ids[rows, :t]),
            t_lp[rows, :t].gather(-1, ids[rows, :t, None])[..., 0], kind=kind, aggregation=aggregation,
            response_mask=mask[rows, :t], max_len=6, world=world,
        )  # fmt: skip
        return out

    one_logits = logits.clone().requires_grad_(True)
    one = loss(one_logits, slice(0, 3), t_all, None)
    one.backward()

    spans = [(slice(0, 1), 2), (slice(1, 3), 4)]  # each rank pads to its own T

    def rank(r: int, w) -> tuple[float, torch.Tensor]:
        rows, t = spans[r]
        lg = logits[rows, :t].clone().requires_grad_(True)
        out = loss(lg, rows, t, w)
        out.backward()
        return out.item(), lg.grad

    (l0, g0), (l1, g1) = _run_ranks(ThreadWorld(2), rank)
    assert (l0 + l1) / 2 == pytest.approx(one.item(), rel=1e-12)
    # DDP averages: the one-process gradient at rank r's rows is rank r's gradient / W.
    torch.testing.assert_close(one_logits.grad[0:1, :2], g0 / 2, rtol=0, atol=1e-14)
    torch.testing.assert_close(one_logits.grad[1:3, :4], g1 / 2, rtol=0, atol=1e-14)
    assert one_logits.grad[0:1, 2:].abs().max().item() == 0.0  # padding
    assert g0.abs().max().item() > 1e-3
    # Without `world`, a mean of per-rank means is another loss.
    m0, m1 = (loss(logits[rows, :t], rows, t, None).item() for rows, t in spans)
    assert abs((m0 + m1) / 2 - one.item()) > 1e-6
