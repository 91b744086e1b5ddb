"""The data-parallel equivalence test's set-up and its rank processes (tests/trainer_adapter/
test_distributed_loss.py): a tiny float64 Llama, real RolloutRecords sampled from a perturbed copy of it
(the behaviour policy μ), one optimiser step on a batch, and `rank_main`, the body of each rank that
torch.multiprocessing.spawn starts (importable by name from the spawned processes).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import numpy as np
import torch

from maskroll.proto.records import RolloutRecord, Semantics
from maskroll.trainer_adapter import (
    MaskConfig,
    TorchCollective,
    collate,
    compute_masks_for,
    policy_loss,
    token_logprobs,
    torch_world,
)

VOCAB, K, TEMPERATURE, LR = 32, 4, 0.8, 0.5


def tiny_model(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,  # peaked enough that a small perturbation leaves some tokens near μ
        # sdpa, not eager: in float64 eager attention turns left-padded rows into nan (a query whose keys
        # are all padding softmaxes over −inf, and 0 · nan reaches the real positions in the next layer).
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).double().eval()


def perturbed(model: torch.nn.Module, seed: int, scale: float) -> torch.nn.Module:
    """A copy of `model` with Gaussian noise on every weight: a behaviour (or reference) policy near it."""
    other = tiny_model(0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for (_, p), (_, q) in zip(model.named_parameters(), other.named_parameters(), strict=True):
            q.copy_(p + scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return other


@torch.no_grad()
def sample_record(mu: torch.nn.Module, prompt: list[int], length: int, group: str, index: int, seed: int):
    """One completion of `length` tokens sampled from softmax(ℓ_μ / T), with μ's top-K: what an engine
    with processed logprobs would publish."""
    gen = torch.Generator().manual_seed(seed)
    ids, sampled, ranks, top_ids, top_lp = list(prompt), [], [], [], []
    for _ in range(length):
        logits = mu(input_ids=torch.tensor([ids])).logits[0, -1]  # [V]
        logp = torch.log_softmax(logits / TEMPERATURE, -1)  # [V]
        a = int(torch.multinomial(logp.exp(), 1, generator=gen))
        order = torch.argsort(logp, descending=True)
        ids.append(a)
        sampled.append(float(logp[a]))
        ranks.append(int((order == a).nonzero()) + 1)
        top_ids.append(order[:K].tolist())
        top_lp.append(logp[order[:K]].tolist())
    return RolloutRecord(
        rollout_id=f"{group}-{index}",
        request_id=group,
        prompt_ids=np.array(prompt, np.int32),
        completion_ids=np.array(ids[len(prompt) :], np.int32),
        sampled_logprobs=np.array(sampled, np.float32),
        sampled_ranks=np.array(ranks, np.int32),
        topk_ids=np.array(top_ids, np.int32),
        topk_logprobs=np.array(top_lp, np.float32),
        finish_reason="length",
        semantics=Semantics(logprobs_k=K, temperature=TEMPERATURE),
        job_id=group,
        group_id=group,
        sample_index=index,
        group_size=3,
        policy_version_first=1,
        policy_version_last=1,
    )


# Three GRPO groups of 3: the first two (short completions) go to rank 0, the third (long ones) to rank 1.
# Rank 0: 6 sequences, 17 response tokens; rank 1: 3 sequences, 24 — unequal in both, so a mean of
# per-rank means differs from the global mean for every aggregation.
GROUPS = [
    ("g0", [3, 5], [2, 4, 3], [1.0, 0.0, 0.0]),
    ("g1", [7, 1, 9], [1, 2, 5], [0.0, 1.0, 0.5]),
    ("g2", [4, 4, 2, 6], [9, 8, 7], [1.0, 0.0, 1.0]),
]
SHARES = [["g0", "g1"], ["g2"]]


def make_records(model: torch.nn.Module) -> tuple[list[RolloutRecord], list[float]]:
    mu = perturbed(model, seed=11, scale=0.05)
    records, rewards = [], []
    for g, (group, prompt, lengths, rs) in enumerate(GROUPS):
        for i, (n, r) in enumerate(zip(lengths, rs, strict=True)):
            records.append(sample_record(mu, prompt, n, group, i, seed=100 * g + i))
            rewards.append(r)
    return records, rewards


@dataclass(frozen=True)
class Case:
    aggregation: str
    method: str  # MaskConfig.method: "predictive" or "dppo"
    kl: bool = False  # add the KL-to-reference term (β = 0.1)

    @property
    def name(self) -> str:
        return f"{self.aggregation}-{self.method}" + ("-kl" if self.kl else "")

    @property
    def max_len(self) -> int | None:  # seq_mean_token_sum_norm's L: one constant on every rank
        return 12 if self.aggregation == "seq_mean_token_sum_norm" else None


CASES = [
    Case(agg, method)
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
    for method in ("predictive", "dppo")
] + [Case("token_mean", "predictive", kl=True), Case("seq_mean_token_mean", "dppo", kl=True)]

# On these records: 30 of 41 response tokens far (D > δ); predictive keeps 33, DPPO 31 (4 decisions differ).
MASK = {"divergence": "topk_kl", "delta": 0.05, "estimator": "aggregated", "compile": False}


def one_step(
    model: torch.nn.Module,  # trained in place (a DDP wrapper on several ranks)
    ref: torch.nn.Module,
    records: list[RolloutRecord],
    rewards: list[float],
    case: Case,
    world=None,
) -> dict[str, float]:
    """One SGD step on `records` with `case`'s loss; returns the loss and the mask's token counts."""
    b = collate(records, rewards)
    cfg = MaskConfig(method=case.method, **MASK)
    out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids)
    logits = out.logits[:, b.completion_logits_slice]  # [B, T, V]
    lp = token_logprobs(logits, b.completion_ids, temperature=b.temperature)  # [B, T]
    res = compute_masks_for(b, logits.detach(), config=cfg)
    kw = {}
    if case.kl:
        with torch.no_grad():
            r_out = ref(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids)
            kw["ref_logprobs"] = token_logprobs(
                r_out.logits[:, b.completion_logits_slice], b.completion_ids, temperature=b.temperature
            )
        kw["kl_coef"] = 0.1
    loss, _ = policy_loss(
        lp, b.sampled_logprobs, b.advantages, res.keep, masks=res, config=cfg,
        aggregation=case.aggregation, max_len=case.max_len, world=world, **kw,
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.zero_grad()
    loss.backward()
    opt.step()
    valid = b.response_mask
    return {
        "loss": float(loss.detach()),
        "kept": int((res.keep & valid).sum()),
        "masked": int((~res.keep & valid).sum()),
    }


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def rank_main(rank: int, world_size: int, port: int, payload: str, out: str) -> None:
    """One rank: rank 0 scatters the groups (TorchCollective, as RankedQueue does), then every case takes
    one DDP step on this rank's share with and without `world`; the parameters go to `out`.rank."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        coll = TorchCollective()
        with open(payload, "rb") as f:
            data = pickle.load(f) if rank == 0 else None
        shares = None
        if rank == 0:
            pairs = list(zip(data["records"], data["rewards"], strict=True))
            shares = [[(r, w) for r, w in pairs if r.group_id in share] for share in SHARES]
        mine = coll.scatter(shares)
        states = coll.broadcast(data["states"] if rank == 0 else None)
        result: dict = {
            "rank": coll.rank,
            "world_size": coll.world_size,
            "groups": sorted({r.group_id for r, _ in mine}),
            "gathered": coll.all_gather(rank * 10 + 1),
        }
        try:  # a wrong scatter raises on every rank, not only on the source
            coll.scatter([1] if rank == 0 else None)
        except ValueError as exc:
            result["scatter_error"] = str(exc)
        coll.barrier()
        records, rewards = [r for r, _ in mine], [w for _, w in mine]
        world = torch_world()
        for case in CASES:
            for use_world in (True, False):
                model = tiny_model(0)
                model.load_state_dict(states["model"])
                ref = tiny_model(0)
                ref.load_state_dict(states["ref"])
                ddp = DDP(model)
                stats = one_step(ddp, ref, records, rewards, case, world=world if use_world else None)
                result[(case.name, use_world)] = {**stats, "params": flat_params(model)}
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
    from maskroll.recipes.launch import exit_rank

    exit_rank(0)  # launch.exit_rank says why: gloo's threads can abort the interpreter's shutdown
