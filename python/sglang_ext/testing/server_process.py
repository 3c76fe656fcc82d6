"""Start and stop a real server process for GPU tests (`python -m sglang[_ext].launch_server ...`).

The server runs in its own session (setsid), so `stop()` can end the whole process group
(launcher, tokenizer manager, scheduler, detokenizer) and nothing outlives the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional


class ServerHandle:
    def __init__(self, proc: subprocess.Popen, port: int, log_path: str):
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.base_url = f"http://127.0.0.1:{port}"

    def wait_healthy(self, timeout: float) -> float:
        """Wait until GET /health answers 200; returns seconds waited. Raises with the log tail."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server on port {self.port} exited with {self.proc.returncode}:\n"
                                   + self.log_tail(60))
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server on port {self.port} not healthy after {timeout:.0f}s:\n" + self.log_tail(60))

    def post(self, path: str, body: dict, timeout: float = 120, retries: int = 2) -> dict:
        """POST JSON, return the JSON answer. A refused/reset connection is retried while the
        server lives (a full accept backlog under many concurrent clients); HTTP errors are not."""
        data = json.dumps(body).encode()
        for attempt in range(retries + 1):
            req = urllib.request.Request(self.base_url + path, data=data,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as exc:
                raise RuntimeError(f"POST {path} on port {self.port}: HTTP {exc.code}: "
                                   f"{exc.read()[:500]!r}") from exc
            except (ConnectionError, urllib.error.URLError):
                if attempt == retries or self.proc.poll() is not None:
                    raise
                time.sleep(1.0)
        raise AssertionError("unreachable")

    def get_text(self, path: str, timeout: float = 30) -> str:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
            return r.read().decode()

    def stop(self, grace: float = 20) -> None:
        """SIGTERM the process group, SIGKILL what is left after `grace` seconds."""
        self.proc.poll()
        if _group_alive(self.proc.pid):
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + wait
                while time.monotonic() < deadline and _group_alive(self.proc.pid):
                    self.proc.poll()  # reap the leader: a zombie would keep the group "alive"
                    time.sleep(0.2)
                if not _group_alive(self.proc.pid):
                    break
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "r", encoding="utf-8", errors="replace") as f:
                lines = f.readlines()
        except OSError as exc:
            return f"(no log at {self.log_path}: {exc})"
        return "".join(lines[-n:])

    def log_text(self) -> str:
        with open(self.log_path, "r", encoding="utf-8", errors="replace") as f:
            return f.read()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def start_server(argv: List[str], env: Dict[str, str], port: int, log_path: str,
                 python: Optional[str] = None) -> ServerHandle:
    """Run `python <argv...>` (e.g. ["-m", "sglang.launch_server", ...]) in a new session.

    `env` is the complete environment of the server; stdout and stderr go to `log_path`.
    `port` is the HTTP port already named in argv (kept for URLs and messages).
    """
    log = open(log_path, "w", encoding="utf-8")
    try:
        proc = subprocess.Popen([python or sys.executable, *argv], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        log.close()
    return ServerHandle(proc, port, log_path)
