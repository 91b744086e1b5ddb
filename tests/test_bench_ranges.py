"""bench/common.py: the ranges every benchmark reports (median [min, max]) and `--baseline`, which
alternates repetitions of this tree and another checkout and compares them per repetition. Numbers only:
no timing is asserted (the figures live in docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# bench/ is not a package: its modules import each other plainly, as under `python bench/server.py`.
sys.path.append(str(ROOT / "bench"))

import common  # noqa: E402


def test_spread_and_its_text_are_median_min_max():
    assert common.spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0}
    assert common.fmt_spread([24.6, 30.7, 28.2]) == "28.2 [24.6, 30.7]"
    assert common.fmt_spread({"median": 0.8, "min": 0.62, "max": 0.93}, 2, "x") == "0.80 [0.62, 0.93] x"


def test_without_flag_drops_the_flag_and_its_value_in_both_spellings():
    argv = ["--scripted", "--reps", "3", "--baseline", "/tmp/b", "--k=20", "--reps=5", "--json"]
    assert common.without_flag(argv, "--reps") == ["--scripted", "--baseline", "/tmp/b", "--k=20", "--json"]
    assert common.without_flag(argv, "--json", has_value=False) == argv[:-1]
    assert common.without_flag(argv, "--baseline") == [a for a in argv if a not in ("--baseline", "/tmp/b")]


def test_compare_pairs_repetition_i_of_each_tree():
    new = {"µs": [18.0, 20.0, 16.0]}
    old = {"µs": [24.0, 25.0, 32.0]}
    row = common.compare(new, old)["µs"]
    assert row["new"] == {"median": 18.0, "min": 16.0, "max": 20.0}
    assert row["old"] == {"median": 25.0, "min": 24.0, "max": 32.0}
    # per repetition: 18/24 = 0.75, 20/25 = 0.8, 16/32 = 0.5 (not the ratio of medians, 0.72)
    assert row["new_over_old"] == pytest.approx({"median": 0.75, "min": 0.5, "max": 0.8})
    assert "new_over_old" not in common.compare({"n": [1.0]}, {"n": [0.0]})["n"]


def test_interleave_alternates_the_trees_and_runs_one_repetition_at_a_time(tmp_path):
    calls = []
    figures = {"new": iter([10.0, 12.0, 11.0]), "old": iter([20.0, 15.0, 22.0])}

    def runner(script, argv, env):
        side = "new" if Path(env["PYTHONPATH"].split(":")[0], "maskroll").resolve() == ROOT else "old"
        calls.append((side, list(argv)))
        return {"value": next(figures[side])}

    out = common.interleave(
        ROOT / "bench" / "server.py",
        ["--scripted", "--reps", "3", "--json"],
        tmp_path,
        3,
        lambda r: {"value": r["value"]},
        runner=runner,
    )
    assert [side for side, _ in calls] == ["new", "old", "old", "new", "new", "old"] == out["order"]
    assert all(argv == ["--scripted", "--reps", "1", "--json"] for _, argv in calls)
    assert out["new"] == {"value": [10.0, 12.0, 11.0]} and out["old"] == {"value": [20.0, 15.0, 22.0]}
    s = out["summary"]["value"]
    assert s["new"]["median"] == 11.0 and s["old"]["median"] == 20.0
    assert s["new_over_old"] == pytest.approx({"median": 0.5, "min": 0.5, "max": 0.8})
    assert len(out["load_average_1m"]) == 2
    table = common.compare_table(out)
    assert "| value | 11.0 [10.0, 12.0] | 20.0 [15.0, 22.0] | 0.500 [0.500, 0.800] |" in table


def test_tree_env_makes_maskroll_the_other_tree(tmp_path):
    # A stand-in checkout whose proto package says where it is: under tree_env, `maskroll.proto` is its
    # code, not this tree's (the editable install's finder comes after PYTHONPATH).
    other = tmp_path / "checkout"
    (other / "proto").mkdir(parents=True)
    (other / "proto" / "__init__.py").write_text("WHERE = 'other checkout'\n")
    (tmp_path / "shim").mkdir()
    env = common.tree_env(other, tmp_path / "shim")
    code = "import json, maskroll.proto as p; print(json.dumps([p.WHERE, p.__file__]))"
    where, path = json.loads(subprocess.check_output([sys.executable, "-c", code], env=env, cwd=tmp_path))
    assert where == "other checkout" and Path(path).resolve() == (other / "proto" / "__init__.py").resolve()
    assert common.parse_json_output('{"a": 1}') == {"a": 1}
    assert common.parse_json_output('a table\n{"a": [1, 2]}\n') == {"a": [1, 2]}


def test_server_summary_reports_ranges_of_per_repetition_differences_and_ratios():
    import argparse
    import importlib.util

    # By path: `server` on sys.path is the repository's server/ folder.
    spec = importlib.util.spec_from_file_location("bench_server", ROOT / "bench" / "server.py")
    server = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(server)
    args = argparse.Namespace(reps=3, k=20, requests=2, tokens=10, stream_interval=1, server_settings={})
    runs = []
    # Per repetition: in-process and gRPC server CPU for 1000 tokens, so µs/token = CPU ms; the serving
    # figure is their difference: K=20 → 25-10 = 15, 30-12 = 18, 22-11 = 11 µs.
    cpu = {20: [(10, 25), (12, 30), (11, 22)], 0: [(9, 20), (9, 21), (10, 20)]}
    for rep in range(3):
        for k in (0, 20):
            inproc, grpc = cpu[k][rep]
            base = {"rep": rep, "k": k, "tokens": 1000, "first_token_ms": [1.0], "client_cpu_s": 0.01}
            runs.append({**base, "path": "inprocess", "seconds": 1.0, "server_cpu_s": inproc / 1e3})
            runs.append(
                {**base, "path": "grpc", "seconds": [1.0, 1.25, 2.0][rep], "server_cpu_s": grpc / 1e3,
                 "chunks": 100, "wire_bytes": 177_000, "json_bytes": 1_250_000}
            )  # fmt: skip
            runs.append({**base, "path": "grpc_1proc", "seconds": 1.0, "server_cpu_s": grpc / 1e3})
    r = server.summarise(runs, args, ROOT, "test", 1.0, (1.5, 2.5))
    assert r["serving_cpu_us_per_token_range"]["20"] == {"median": 15.0, "min": 11.0, "max": 18.0}
    assert r["serving_cpu_us_per_token"]["20"] == 15.0
    # gRPC / in-process tokens/s per repetition: 1/1, 1/1.25, 1/2
    assert r["ratio_ranges"]["grpc_vs_inprocess_k"] == {"median": 0.8, "min": 0.5, "max": 1.0}
    assert r["load_average_1m"] == [1.5, 2.5]
    text = server.table(r)
    assert "K=20 15.0 [11.0, 18.0] µs" in text and "K=20 0.800 [0.500, 1.000]" in text
    assert server.headline(r)["serving µs/token K=20"] == 15.0


def test_grpc_floor_runs_and_reports_one_repetition_as_its_own_range():
    args = ["--reps", "1", "--rounds", "1", "--calls", "2", "--messages", "1", "3", "--gap-ms", "1", "--json"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "grpc_floor.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    r = json.loads(out.stdout)
    assert (r["calls"], r["messages"], r["reps"]) == (2, [1, 3], 1)
    for figure in ("server_us_per_call", "server_us_per_message"):
        s = r[figure]  # one repetition: median, min and max are that repetition's value
        assert s["median"] == s["min"] == s["max"] and abs(s["median"]) < 1e6
