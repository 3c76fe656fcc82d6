"""sglang_ext_testkit.server_process (the GPU server tests' launcher) with a real HTTP server
process that starts a child, becomes healthy late, exits early or never listens."""

from __future__ import annotations

import os
import sys
import time

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from sglang_ext_testkit.server_process import ServerError, free_port, group_members, start_server

register_cpu_ci(est_time=15, suite="base-a-test-cpu")

FAKE_SERVER = r"""
import http.server, subprocess, sys, time
port, delay, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("started child", child.pid, flush=True)
if mode == "exit":
    print("boom: cannot load the model", flush=True)
    sys.exit(3)
time.sleep(delay)
if mode == "silent":
    time.sleep(600)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _start(tmp_path, mode, delay=1.0):
    port = free_port()
    argv = [sys.executable, "-c", FAKE_SERVER, str(port), str(delay), mode]
    return start_server(argv, dict(os.environ), port, tmp_path / f"{mode}.log")


def _child_pid(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in server.log_tail().splitlines():
            if line.startswith("started child "):
                return int(line.split()[-1])
        time.sleep(0.1)
    raise AssertionError(server.log_tail())


def test_waits_for_health_and_stop_ends_the_whole_group(tmp_path):
    server = _start(tmp_path, "serve", delay=1.5)
    try:
        took = server.wait_healthy(timeout=60)
        child = _child_pid(server)
        assert took >= 1.0
        assert sorted(group_members(server.proc.pid)) == sorted([server.proc.pid, child])
        assert os.getpgid(child) == server.proc.pid != os.getpgid(0)  # own session, not the test's group
    finally:
        server.stop(grace=5)
    assert group_members(server.proc.pid) == []
    assert server.proc.poll() is not None


def test_early_exit_raises_with_the_log_tail(tmp_path):
    server = _start(tmp_path, "exit")
    try:
        with pytest.raises(ServerError, match=r"(?s)exited with status 3.*boom: cannot load the model"):
            server.wait_healthy(timeout=60)
    finally:
        server.stop(grace=5)
    assert group_members(server.proc.pid) == []  # the orphaned child went with the group


def test_timeout_raises_and_stop_still_cleans_up(tmp_path):
    server = _start(tmp_path, "silent", delay=0.0)
    try:
        _child_pid(server)
        with pytest.raises(ServerError, match=r"(?s)did not answer 200 within 2 s.*started child"):
            server.wait_healthy(timeout=2)
    finally:
        server.stop(grace=5)
    assert group_members(server.proc.pid) == []
