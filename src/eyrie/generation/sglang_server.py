"""A managed SGLang server: start, health, shutdown (the command itself: eyrie.target.serving).

`managed_server` runs the launch command on 127.0.0.1 and a free port in its own process
group, with its log under logs/, waits until /health answers, and always stops the whole group: on return, on an
exception, on SIGTERM/SIGHUP (turned into SystemExit here), and — through the kernel's
parent-death signal — when the job itself is killed with -9.

With one_server_per_job false, jobs on one machine share one server (`shared_server`):
the first starts it, later ones reuse it, the last one out stops it (file locks under the
state directory; a lock dies with its holder, so a killed job never blocks the others).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from eyrie.core.atomic import write_text_atomically
from eyrie.core.errors import EyrieError
from eyrie.target.serving import HOST


class ServerStartError(EyrieError):
    pass


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends SIGKILL when the parent dies (also by kill -9)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _log_tail(log_path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_healthy(url: str, process: subprocess.Popen | None, timeout_s: float, log_path: Path) -> None:
    import httpx2 as httpx

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ServerStartError(f"the SGLang server exited with code {process.returncode} before it was healthy; last lines of {log_path}:\n{_log_tail(log_path)}")
        try:
            response = httpx.get(f"{url}/health", timeout=5.0)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}"
        except httpx.TransportError as err:
            last = f"{type(err).__name__}"
        time.sleep(1.0)
    raise ServerStartError(f"the SGLang server at {url} was not healthy within {timeout_s:.0f} s (last: {last}); see {log_path}:\n{_log_tail(log_path)}")


def stop_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the server's whole process group, SIGKILL after grace_s."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait)
            # The leader is gone; children in its group may linger a moment.
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
        break
    process.poll()


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM / SIGHUP (Snakemake stopping a job) become SystemExit, so `finally` blocks run."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def start(command: list[str], log_path: Path, *, detached: bool = False, env: dict | None = None) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n# eyrie: {' '.join(command)}\n".encode())
        log.flush()
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=None if detached else _die_with_parent,
            env=env,
        )


@contextmanager
def managed_server(command_for_port, log_path: str | Path, *, startup_timeout_s: float = 900.0, shutdown_timeout_s: float = 30.0, env: dict | None = None) -> Iterator[str]:
    """Start a server for this job only; yields its base URL; always stops its process group."""
    log_path = Path(log_path)
    port = free_port()
    command = command_for_port(port)
    with _signals_raise():
        process = start(command, log_path, env=env)
        try:
            url = f"http://{HOST}:{port}"
            print(f"sglang: started pid {process.pid} on {url}, log {log_path}", file=sys.stderr)
            wait_healthy(url, process, startup_timeout_s, log_path)
            yield url
        finally:
            stop_group(process, shutdown_timeout_s)
            print(f"sglang: stopped pid {process.pid} (exit {process.returncode})", file=sys.stderr)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@contextmanager
def _locked(path: Path):
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def shared_server(command_for_port, log_path: str | Path, state_dir: str | Path, *, startup_timeout_s: float = 900.0, shutdown_timeout_s: float = 30.0, env: dict | None = None) -> Iterator[str]:
    """One server per machine and command, shared by the jobs that run at once; the last one out stops it.

    A job killed with -9 leaves the server running for the others (or for the next job, which
    reuses it); when the last user was killed, stop it with `kill -- -<pid>` from the state file.
    """
    log_path, state_dir = Path(log_path), Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(json.dumps(command_for_port(0)).encode()).hexdigest()[:16]
    lock, users, state = state_dir / f"{key}.lock", state_dir / f"{key}.users", state_dir / f"{key}.json"
    users_file = open(users, "a+")
    with _signals_raise():
        try:
            with _locked(lock):
                info = json.loads(state.read_text()) if state.exists() else None
                if info and _alive(info["pid"]):
                    try:
                        wait_healthy(info["url"], None, startup_timeout_s, Path(info["log"]))
                        print(f"sglang: reusing the shared server pid {info['pid']} at {info['url']}", file=sys.stderr)
                    except ServerStartError:
                        os.killpg(info["pid"], signal.SIGKILL)
                        info = None
                else:
                    info = None
                if info is None:
                    port = free_port()
                    process = start(command_for_port(port), log_path, detached=True, env=env)
                    info = {"pid": process.pid, "url": f"http://{HOST}:{port}", "log": str(log_path)}
                    write_text_atomically(state, json.dumps(info))
                    print(f"sglang: started shared server pid {process.pid} on {info['url']}, log {log_path}", file=sys.stderr)
                    try:
                        wait_healthy(info["url"], process, startup_timeout_s, log_path)
                    except BaseException:
                        stop_group(process, shutdown_timeout_s)
                        state.unlink(missing_ok=True)
                        raise
                fcntl.flock(users_file, fcntl.LOCK_SH)
            yield info["url"]
        finally:
            with _locked(lock):
                fcntl.flock(users_file, fcntl.LOCK_UN)
                with open(users, "a+") as probe:
                    try:
                        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        last = True
                        fcntl.flock(probe, fcntl.LOCK_UN)
                    except BlockingIOError:
                        last = False
                current = json.loads(state.read_text()) if state.exists() else None
                if last and current and _alive(current["pid"]):
                    for sig in (signal.SIGTERM, signal.SIGKILL):
                        try:
                            os.killpg(current["pid"], sig)
                        except ProcessLookupError:
                            break
                        deadline = time.monotonic() + (shutdown_timeout_s if sig == signal.SIGTERM else 10)
                        while _alive(current["pid"]) and time.monotonic() < deadline:
                            try:
                                os.waitpid(current["pid"], os.WNOHANG)  # reap it when it is our child
                            except ChildProcessError:
                                pass
                            time.sleep(0.2)
                        if not _alive(current["pid"]):
                            break
                    print(f"sglang: last user out, stopped the shared server pid {current['pid']}", file=sys.stderr)
                if last:
                    state.unlink(missing_ok=True)
            users_file.close()
