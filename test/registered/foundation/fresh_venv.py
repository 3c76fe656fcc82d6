"""Fresh virtual environments for tests that run the real console scripts (import it to use it).

`fresh_venv(path, wheel)`: a new venv with only sglang-ext installed from its wheel, as
`pip install --no-deps .` leaves an empty venv (no sglang, no torch). With
`see_running_env=True` the venv also sees this interpreter's site-packages (sglang, torch,
pytest), like `venv --system-site-packages` would if this interpreter were the system one; its
own sglang-ext comes first on sys.path and in importlib.metadata.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig


def fresh_venv(path, wheel: str, *, see_running_env: bool = False) -> str:
    """Create the venv at `path` and install `wheel` into it (no dependencies); returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = os.path.join(str(path), "bin", "python")
    if see_running_env:
        site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              env=user_env(), check=True, capture_output=True, text=True, timeout=60).stdout.strip()
        running = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
        with open(os.path.join(site, "_running_env.pth"), "w", encoding="utf-8") as f:
            f.write("".join(f"{p}\n" for p in running))
    # this interpreter's pip installs into the venv (it has none of its own: --without-pip)
    # (without PYTHONPATH, which may show pip a sglang-ext it would then call already installed)
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel],
                          env=user_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return python


def user_env(**extra) -> dict:
    """This environment as a newcomer's shell has it: no sglang-ext settings, no PYTHONPATH or
    active venv leaking this test run's packages into the command under test."""
    env = {k: v for k, v in os.environ.items()
           if not (k == "SGLANG_EXT" or k.startswith("SGLANG_EXT_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(extra)
    return env
