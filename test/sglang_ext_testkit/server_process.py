"""A server process for GPU tests: own process group, health wait, log file, clean stop.

    server = start_server([sys.executable, "-m", "sglang_ext.serve", ...], env, port, log_path)
    try:
        server.wait_healthy(timeout=600)
        ...  # requests to server.url
    finally:
        server.stop()

The server runs in a new session (`setsid`), so `stop()` ends it and every process it
started (schedulers, workers) by its process group, and nothing else. Its stdout and
stderr go to `log_path`; `log_tail()` returns the end of it for failure messages.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from typing import Mapping, Optional, Sequence


class ServerError(RuntimeError):
    """The server exited or did not become healthy in time; the message carries its log tail."""


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, port: int, log_path: str) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"

    def log_tail(self, max_chars: int = 6000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - max_chars))
                return f.read().decode("utf-8", "replace")
        except OSError as exc:
            return f"(no log at {self.log_path}: {exc})"

    def _failure(self, what: str) -> ServerError:
        return ServerError(f"{what}; log {self.log_path}, last lines:\n{self.log_tail()}")

    def log_text(self) -> str:
        with open(self.log_path, "r", encoding="utf-8", errors="replace") as f:
            return f.read()

    def post(self, path: str, body: dict, timeout: float = 120, retries: int = 2) -> dict:
        """POST JSON, return the JSON answer. A refused/reset connection is retried while the
        server lives (a full accept backlog under many concurrent clients); HTTP errors are not."""
        data = json.dumps(body).encode()
        for attempt in range(retries + 1):
            req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as exc:
                raise RuntimeError(f"POST {path} on port {self.port}: HTTP {exc.code}: {exc.read()[:500]!r}") from exc
            except (ConnectionError, urllib.error.URLError):
                if attempt == retries or self.proc.poll() is not None:
                    raise
                time.sleep(1.0)
        raise AssertionError("unreachable")

    def get_text(self, path: str, timeout: float = 30) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read().decode()

    def wait_healthy(self, timeout: float, path: str = "/health") -> float:
        """Poll GET `path` until it answers 200; returns the seconds it took.

        Raises ServerError (with the log tail) if the process exits first or `timeout` passes.
        """
        start = time.monotonic()
        while True:
            code = self.proc.poll()
            if code is not None:
                raise self._failure(f"server exited with status {code} before {path} answered")
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() - start > timeout:
                raise self._failure(f"{path} did not answer 200 within {timeout:.0f} s")
            time.sleep(1.0)

    def stop(self, grace: float = 20.0) -> Optional[int]:
        """SIGTERM the process group, SIGKILL what is left after `grace` s; returns the exit status."""
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self.proc.poll()
                if not _group_alive(pgid):
                    return self.proc.poll()
                time.sleep(0.2)
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None


def group_members(pgid: int) -> list:
    """Live (not zombie) pids of process group `pgid`, from /proc (Linux)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "r") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            members.append(int(entry))
    return members


def _group_alive(pgid: int) -> bool:
    if os.path.isdir("/proc"):
        return bool(group_members(pgid))  # zombies would keep killpg(pgid, 0) succeeding
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def start_server(argv: Sequence[str], env: Mapping[str, str], port: int, log_path) -> ServerProcess:
    """Start `argv` with exactly `env` in a new session, output to `log_path` (overwritten)."""
    log_path = os.fspath(log_path)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return ServerProcess(proc, port, log_path)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
