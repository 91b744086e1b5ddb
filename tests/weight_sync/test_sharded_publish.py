"""Publishing from a data-parallel trainer (issue 21): 2 CPU ranks under torchrun (gloo) publish through
`make_publisher(..., collective=TorchCollective())` to a real replica (the torch engine behind a real
gRPC server, in this process, pulling from a real Redis), after one real optimiser step.

- FSDP2 (`fully_shard`), stream: every rank joins a gather per parameter, rank 0 writes and pushes; the
  engine's tensors afterwards equal, bit for bit, the full state dict as torch's own
  `get_model_state_dict` gathers it; both ranks report the same version; the push's extra memory per
  rank is printed (and is far from a whole model). Fresh ranks then resume the run from rank 0's copy
  (every shard loaded exactly) and publish version 2.
- FSDP2, directory: rank 0 writes into the replica's --weights-root, UpdateWeights loads it; the same
  exact equality.
- DDP: rank 0 alone pushes, the other rank only learns the version; the same exact equality.
- The gather and the file on their own (`sharded.write_gathered`, `read_written`, `load_sharded`), and
  `RankedPublisher`'s errors: rank 0's raised on every rank.
- GPUs (skipped without three CUDA devices and vLLM): FSDP2 over the NCCL transport to a vLLM replica.
The single-process publishers are covered, unchanged, by tests/weight_sync/test_directory.py and
tests/weight_sync/test_stream.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "server"))

from grpc_fixtures import ServerLoop, replica, server_config, start_torch_engine  # noqa: E402

from maskroll.local.redis_server import LocalRedis  # noqa: E402

pytestmark = pytest.mark.slow

NS = "sharded"
MODEL = {"hidden": 256, "heads": 4, "layers": 3}  # ~11 MB of float32: a gather of one parameter shows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from maskroll.app.model_init import init_model

    return init_model(tmp_path_factory.mktemp("model") / "sharded", seed=0, **MODEL)


@pytest.fixture(scope="module")
def redis_url():
    with LocalRedis() as r:
        yield r.url


@pytest.fixture(scope="module")
def engine_replica(model_dir, redis_url, tmp_path_factory):
    """(the engine, its --weights-root): pulls from namespace NS, so the trainer's queue finds it."""
    from maskroll.server.weights.stream import SPOOL_ENV

    os.environ[SPOOL_ENV] = str(tmp_path_factory.mktemp("spool"))
    root = tmp_path_factory.mktemp("weights-root")
    loop = ServerLoop()
    engine = start_torch_engine(loop, model_dir, max_logprobs=5, max_batch=2, threads=1)
    config = server_config(
        model_dir,
        redis_url=redis_url,
        namespace=NS,
        pull=True,
        replica_id="rep-0",
        heartbeat_ttl_s=3,
        weights_root=root,
    )
    with replica(loop, config, engine):
        yield engine, root
    loop.run(engine.close())
    loop.close()


def _torchrun(
    mode: str, model_dir: Path, redis_url: str, out: Path, *extra: str, ranks: int = 2, namespace: str = NS
) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd += [str(HERE / "sharded_ranks.py"), "--model", str(model_dir), "--redis", redis_url]
    cmd += ["--namespace", namespace, "--mode", mode, "--out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def _engine_state(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine._model.state_dict().items()}


def _assert_exact(engine, reference_file: Path) -> None:
    from safetensors.torch import load_file

    reference = load_file(str(reference_file))
    held = _engine_state(engine)
    assert set(held) == set(reference)
    for name, t in reference.items():
        assert held[name].dtype == t.dtype and torch.equal(held[name], t), name


def _report(reports: list[dict]) -> None:
    for r in reports:
        print(
            f"{r['mode']} rank {r['rank']}/{r['world_size']}: publish {r['publish_s']:.2f} s, peak RSS "
            f"+{r['rss_peak_delta'] / 2**20:.1f} MiB (model {r['model_bytes'] / 2**20:.1f} MiB, this "
            f"rank's shard {r['shard_bytes'] / 2**20:.1f} MiB, largest parameter "
            f"{r['largest_param_bytes'] / 2**20:.2f} MiB)"
        )


@pytest.mark.parametrize("mode", ["fsdp", "ddp", "fsdp-directory"])
def test_two_ranks_publish_exactly_the_full_state_dict_to_a_real_replica(
    mode, model_dir, redis_url, engine_replica, tmp_path
):
    """Stream (PushWeights) for both models; "fsdp-directory": the sharded model written by rank 0 into
    the replica's --weights-root, loaded by UpdateWeights."""
    from safetensors.torch import load_file

    engine, weights_root = engine_replica
    base = load_file(str(model_dir / "model.safetensors"))  # what the replica started from
    if mode == "fsdp-directory":
        root = weights_root / tmp_path.name  # a run's own directory under the replica's root
        reports = _torchrun(
            "fsdp", model_dir, redis_url, tmp_path, "--root", str(root), "--transport", "directory"
        )
    else:
        root = tmp_path / "ckpt"
        reports = _torchrun(mode, model_dir, redis_url, tmp_path, "--root", str(root))
    _report(reports)
    # both ranks: the new run's version 0, then version 1, and the same per-replica results
    assert [(r["start_version"], r["version"]) for r in reports] == [(0, 1), (0, 1)]
    assert reports[0]["results"] == reports[1]["results"] == {"rep-0": "ok"}
    _assert_exact(engine, tmp_path / "reference_v1.safetensors")
    if mode != "fsdp-directory":  # the stream: every tensor digested, the replica checked them all
        fingerprint = reports[0]["fingerprint"]
        assert fingerprint.startswith("wxh1:")
        assert reports[0]["replica_fingerprints"] == {"rep-0": fingerprint}
    # the trainer's resume copy is the checkpoint layout, kept versions only (keep=2: v0 and v1)
    assert sorted(p.name for p in root.iterdir()) == ["v0", "v1"]
    assert sorted(p.name for p in (root / "v1").iterdir()) == ["model.safetensors"]
    # the step moved every tensor: the equality above is not the replica's starting weights
    assert not [n for n, t in _engine_state(engine).items() if torch.equal(t, base[n])]
    if mode.startswith("fsdp"):
        r0 = reports[0]
        assert r0["shard_bytes"] < 0.6 * r0["model_bytes"]  # really sharded across the 2 ranks
        # The extra memory of the push on every rank is far from one model (a full snapshot would be at
        # least model_bytes): one parameter, gRPC's and the chunks' buffers, allocator slack.
        for r in reports:
            assert r["rss_peak_delta"] < 0.5 * r["model_bytes"], r
    if mode in ("fsdp", "ddp"):
        # A restarted trainer (fresh processes, base weights) resumes the run: start() loads version 1
        # from rank 0's copy into every rank's model (FSDP: scattered into the shards; DDP: loaded on
        # rank 0 and broadcast), exactly what was published; the replica already serves it; the next
        # step is published as version 2.
        reports = _torchrun(mode, model_dir, redis_url, tmp_path, "--root", str(root), "--resume")
        assert [r["start_version"] for r in reports] == [1, 1]
        assert [r["resumed_exact"] for r in reports] == [True, True]
        assert [r["version"] for r in reports] == [2, 2] and reports[0]["results"] == {"rep-0": "ok"}
        _assert_exact(engine, tmp_path / "reference_v2.safetensors")


# ---- NCCL (GPUs): vLLM's trainer engine, the sender on rank 0, the others in its gathers -----------------


def _cuda_devices() -> int:
    try:
        return torch.cuda.device_count()
    except Exception:  # no torch CUDA build
        return 0


@pytest.mark.gpu
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or _cuda_devices() < 3,
    reason="FSDP2 over NCCL to a vLLM replica needs vLLM and three CUDA devices (2 trainer ranks, a replica)",
)
def test_fsdp_over_nccl_reaches_a_vllm_replica(model_dir, redis_url, tmp_path):
    """Two FSDP2 ranks on GPUs 0-1 publish through the nccl transport to a vLLM replica on GPU 2;
    both ranks end at version 1 and the replica serves it. (Not run on the CPU machine of this change.)"""
    from maskroll.client import SyncRolloutClient
    from maskroll.local.replica import LocalReplica

    serve = ["--model", str(model_dir), "--engine", "vllm", "--port", "0", "--namespace", NS + "-nccl"]
    serve += ["--pull", "--replica-id", "gpu-2", "--vllm-arg", 'weight_transfer_config={"backend":"nccl"}']
    env = {"CUDA_VISIBLE_DEVICES": "2", "MASKROLL_REDIS_URL": redis_url}
    with LocalReplica(serve, env=env, log=tmp_path / "replica.log", ready_timeout=900) as rep:
        rep.wait_ready()
        os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
        try:
            reports = _torchrun(
                "fsdp", model_dir, redis_url, tmp_path, "--transport", "nccl", namespace=NS + "-nccl"
            )
        finally:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        assert [(r["start_version"], r["version"]) for r in reports] == [(0, 1), (0, 1)]
        with SyncRolloutClient(f"127.0.0.1:{rep.port}") as c:
            assert c.info().policy_version == 1


# ---- the gather and the file, without replicas -------------------------------------------------------

_WRITE_RANKS = """
import sys, torch, torch.distributed as dist, json, zlib
from torch.distributed.fsdp import fully_shard
from maskroll.trainer_adapter.distributed import TorchCollective
from maskroll.weight_sync.sharded import write_gathered, read_written, load_sharded, is_sharded
from maskroll.weight_sync.stream import manifest_of
out = sys.argv[1]
dist.init_process_group("gloo")
coll = TorchCollective()
torch.manual_seed(0)
def make():
    m = torch.nn.Sequential(
        torch.nn.Embedding(11, 6), torch.nn.Linear(6, 7), torch.nn.Linear(7, 5, dtype=torch.float64)
    )
    m.register_buffer("steps", torch.tensor([3, 4], dtype=torch.int64))
    return m
m = make()
full = {k: v.clone() for k, v in m.state_dict().items()}
for layer in m:
    fully_shard(layer)
fully_shard(m)
assert is_sharded(m)
w = write_gathered(m, f"{out}/v1/model.safetensors" if coll.rank == 0 else None, version=1)
if coll.rank == 0:
    from safetensors.torch import load_file
    back = load_file(str(w.path))
    assert list(back) == list(full) or set(back) == set(full)
    assert all(torch.equal(back[k], full[k]) for k in full)
    assert w.manifest == manifest_of({k: v.contiguous() for k, v in full.items()}, 1, digests=True)
    again = read_written(w.path, 1)
    assert again.manifest == w.manifest and again.fingerprint == w.fingerprint
    from maskroll.weight_sync.model_fingerprint import model_fingerprint
    assert w.fingerprint == model_fingerprint(full)
    pushed = b"".join(bytes(d) for _, _, d in w.chunks(5))
    raw = [bytes(v.contiguous().reshape(-1).view(torch.uint8).numpy()) for v in full.values()]
    assert pushed == b"".join(raw)
# load back into a freshly initialised sharded model: every rank's shard holds the file's values
torch.manual_seed(1)
m2 = make()
m2.steps.zero_()
for layer in m2:
    fully_shard(layer)
fully_shard(m2)
load_sharded(m2, f"{out}/v1" if coll.rank == 0 else None, coll)
got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in m2.state_dict().items()}
assert all(torch.equal(got[k], full[k]) for k in full), [k for k in full if not torch.equal(got[k], full[k])]

# RankedPublisher over the directory transport and a stand-in for the replicas (a directory.Fleet): the
# sharded model is written under the root by rank 0, both ranks learn the version, and rank 0's errors
# are raised on both ranks (none is left waiting in a collective)
from maskroll.weight_sync import CheckpointPublisher, WeightSyncError
from maskroll.weight_sync.ranked import RankedPublisher
class Fleet:
    def __init__(self):
        self.version, self.calls, self.answer = 0, [], "ok"
    def broadcast_weights(self, version, checkpoint_dir, timeout=120.0):
        self.calls.append((version, checkpoint_dir))
        self.version = version
        return {"r": self.answer}
fleet = Fleet() if coll.rank == 0 else None
inner = CheckpointPublisher(fleet, f"{out}/root") if coll.rank == 0 else None
pub = RankedPublisher(inner, coll, "directory")
assert pub.publish(m2) == {"r": "ok"} and pub.version == 1
if coll.rank == 0:
    from safetensors.torch import load_file
    assert fleet.calls == [(1, f"{out}/root/v1")]
    back = load_file(f"{out}/root/v1/model.safetensors")
    assert set(back) == set(full) and all(torch.equal(back[k], full[k]) for k in full)
try:
    pub.publish(m2, version=1)
    raise AssertionError("a version that does not move the run forward was published")
except (ValueError, RuntimeError) as e:
    assert "does not move the run forward" in str(e), e
    assert isinstance(e, ValueError if coll.rank == 0 else RuntimeError), e
    assert coll.rank == 0 or str(e).startswith("rank 0 failed to publish: ValueError"), e
if fleet is not None:
    fleet.answer = "Unavailable: gone"
try:
    pub.publish(m2)
    raise AssertionError("a version no replica loaded was taken")
except WeightSyncError as e:
    assert e.version == 2 and e.failed == {"r": "Unavailable: gone"}, e
# a plain (replicated) model: rank 0 alone writes and announces it, both ranks learn the version
plain = make()
if fleet is not None:
    fleet.answer = "ok"
assert pub.publish(plain) == {"r": "ok"} and pub.version == 3
if coll.rank == 0:
    assert fleet.calls[-1] == (3, f"{out}/root/v3")
open(f"{out}/ok{coll.rank}", "w").write("ok")
dist.destroy_process_group()
from maskroll.recipes.launch import exit_rank
exit_rank(0)  # launch.exit_rank says why: gloo's threads can abort the interpreter's shutdown
"""


def test_write_gathered_is_the_state_dict_and_loads_back_into_a_sharded_model(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(_WRITE_RANKS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*cmd, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()
    assert sorted(p.name for p in (tmp_path / "v1").iterdir()) == ["model.safetensors"]  # no temporary left
