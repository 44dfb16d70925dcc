"""`lightning-rl serve` as a child process, for the demo, the benchmarks and the tests.

Started from this interpreter (so the child runs the same installation), waited for until its
/health answers, and stopped with SIGINT so that it closes the store cleanly.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil

from lightning_core.errors import LightningError, StoreUnavailable

log = logging.getLogger(__name__)

# Restarts of one supervised server over its whole life: a server that dies once in a long run
# is brought back; one that keeps dying (a broken model, a full disk) fails the run.
MAX_RESTARTS = 3


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now (the OS picks it)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` different TCP ports on `host` that are free now: all held until all are
    picked, so that the OS cannot hand out one twice."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]


def die_with_parent(sig: int = signal.SIGINT) -> None:
    """Run in the child before exec: send it `sig` when the thread that started it ends, the
    process with it, even by SIGKILL (Linux; elsewhere nothing). A policy server outliving a
    killed flow would keep its store file locked, and a resumed run could not open it."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, sig)


# glibc's mallopt parameter for the most malloc arenas (malloc.h).
_M_ARENA_MAX = -8


def limit_malloc_arenas(arenas: int) -> bool:
    """Cap glibc's malloc arenas for this process; True if set (Linux with glibc only).

    glibc gives threads that allocate at once arenas of their own, up to 8 per core, and
    memory freed in one is not reused by another: under 64 clients the server's threads
    (event loop, store writer, backend, torch) kept growing its resident memory for minutes.
    Measured here (benchmarks/soak.py --warmup 20): the server's tree grew 11.6 % over 3
    minutes with glibc's default, 7.3 % and 9.6 % in two runs with 2 arenas (222-253 requests/s
    in all three, within this machine's noise)."""
    if arenas <= 0 or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return bool(ctypes.CDLL(None).mallopt(_M_ARENA_MAX, arenas))
    except (OSError, AttributeError):  # a libc without mallopt (musl)
        return False


def serve_command(db: str | Path, port: int, *options: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "lightning_rl.flows.cli",
        "serve",
        "--db",
        str(db),
        "--port",
        str(port),
        *options,
    ]


def start_serve(
    db: str | Path,
    port: int,
    *options: str,
    timeout: float = 120.0,
    preexec_fn: Callable[[], None] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start the server and return once it answers; its output goes to `proc.log_path`.
    `env` replaces the child's environment (an API key goes there, never on its command line,
    which any user of the machine can read)."""
    proc = spawn(serve_command(db, port, *options), "serve", preexec_fn, env)
    wait_healthy(proc, port, timeout, "lightning-rl serve")
    return proc


def spawn(
    command: list[str],
    name: str,
    preexec_fn: Callable[[], None] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start `command` with its output in a log file, `proc.log_path`."""
    # A file, not a pipe: a pipe nobody reads would block the server once it filled up.
    with tempfile.NamedTemporaryFile(
        prefix=f"lightning-{name}-", suffix=".log", delete=False
    ) as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=preexec_fn, env=env
        )
    proc.log_path = Path(log.name)  # type: ignore[attr-defined]
    return proc


def wait_healthy(
    proc: subprocess.Popen,
    port: int,
    timeout: float,
    what: str,
    error: type[LightningError] = StoreUnavailable,
    host: str = "127.0.0.1",
) -> None:
    """Return once the server `proc` answers on `host`:`port`/health; `error` (the server's
    log tail in it, where it has a log file) when it exits first or does not answer in time,
    killed then. An answer counts only once `proc` (or a process it started) listens on the
    port: a free port can be taken by another process before `proc` binds it, and that
    process's answer must not pass for this server's (seen under a parallel test run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise error(f"{what} exited ({proc.returncode}): {_tail(proc)}")
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=1):
                if _listens(proc, port):
                    return
            time.sleep(0.1)
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise error(f"{what} did not answer within {timeout} s: {_tail(proc)}")


def _listens(proc: subprocess.Popen, port: int) -> bool:
    """Whether `proc` or one of its descendants listens on TCP `port`; True when the system
    does not say (then the answer on the port is taken as this server's, as before)."""
    try:
        parent = psutil.Process(proc.pid)
        for p in [parent, *parent.children(recursive=True)]:
            # net_connections since psutil 6; `connections` before it.
            connections = getattr(p, "net_connections", None) or p.connections
            for c in connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
                    return True
    except psutil.Error:
        return True
    return False


def stop_serve(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGINT (a clean shutdown), then SIGKILL if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _tail(proc: subprocess.Popen, lines: int = 20) -> str:
    # A server started with its output on the terminal (`production`) has no log file.
    log_path = getattr(proc, "log_path", None)
    if log_path is None:
        return "(its output is above)"
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class Supervised:
    """A `lightning-rl serve` child that is started again, the same way, when it dies unasked.

    `start` starts it and returns once it answers (start_serve with its store file, port and
    options bound), so a restarted server has the same URL, store and key, and its clients only
    see it gone for the seconds it takes to start: they wait that long (HttpStoreClient's
    retry_s). The store comes back with every acknowledged write (its DuckDB file), the gateway
    with every registered policy version (loaded on first use). After `max_restarts` restarts
    the server stays down and `failure` says why.
    """

    def __init__(self, start: Callable[[], subprocess.Popen], max_restarts: int = MAX_RESTARTS):
        self._start = start
        self.max_restarts = max_restarts
        self.restarts = 0
        self.failure: str | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.proc = start()
        # The thread that starts a restarted child must outlive it: die_with_parent signals the
        # child when that thread ends. This one waits on the child until it exits.
        self._watcher = threading.Thread(
            target=self._watch, name="lightning-serve-supervisor", daemon=True
        )
        self._watcher.start()

    @property
    def log_path(self) -> Path:
        return Path(self.proc.log_path)  # type: ignore[attr-defined]

    def _watch(self) -> None:
        while True:
            code = self.proc.wait()
            if self._stopping.is_set():
                return
            tail = _tail(self.proc)
            if self.restarts >= self.max_restarts:
                self.failure = (
                    f"the policy server exited ({code}) after {self.restarts} restarts, the most "
                    f"allowed (max_restarts={self.max_restarts}); its log ({self.log_path}) "
                    f"ends with:\n{tail}"
                )
                log.error("%s", self.failure)
                return
            self.restarts += 1
            log.warning(
                "the policy server exited (%s); restarting it on the same store and port "
                "(restart %d of at most %d); its log (%s) ends with:\n%s",
                code,
                self.restarts,
                self.max_restarts,
                self.log_path,
                tail,
            )
            try:
                proc = self._start()
            except LightningError as exc:
                self.failure = f"the policy server could not be restarted: {exc}"
                log.error("%s", self.failure)
                return
            with self._lock:
                if self._stopping.is_set():  # stopped while it restarted
                    stop_serve(proc)
                    return
                self.proc = proc
            log.warning("the policy server is back (log: %s)", self.log_path)

    def stop(self, timeout: float = 30.0) -> int:
        """Stop the server for good (cleanly) and its supervision with it."""
        self._stopping.set()
        with self._lock:
            code = stop_serve(self.proc, timeout)
        self._watcher.join(timeout)
        return code
