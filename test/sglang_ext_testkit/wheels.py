"""Released sglang wheels, unpacked for reading (never imported, never installed).

Fingerprint tables (`scripts/gen_fingerprints.py`), the fingerprint tests and
`sglang-ext doctor --source-root` read sglang sources of other releases. A wheel
is fetched once with `pip download --no-deps` into `<wheels_dir>/dl/` and only
its `sglang/**.py` files are unpacked into `<wheels_dir>/v<version>/`, so
`<wheels_dir>/v<version>` is a `source_root` for `sglang_ext.fingerprint`.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import zipfile
from typing import Optional

# Every release the registry records fingerprints for (0.5.12 to 0.5.23;
# 0.5.13, 0.5.14 and 0.5.16 were never published).
RECORDED_RELEASES = ("0.5.12", "0.5.15", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")

_COMPLETE = ".unpacked"


def default_wheels_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "sglang-ext", "wheels")


def source_root(version: str, wheels_dir: Optional[str] = None) -> str:
    """Directory holding the unpacked `sglang/` package of `version` (may not exist yet)."""
    return os.path.join(wheels_dir or default_wheels_dir(), f"v{version}")


def is_unpacked(version: str, wheels_dir: Optional[str] = None) -> bool:
    return os.path.exists(os.path.join(source_root(version, wheels_dir), _COMPLETE))


def find_wheel(version: str, wheels_dir: Optional[str] = None) -> Optional[str]:
    found = sorted(glob.glob(os.path.join(wheels_dir or default_wheels_dir(), "dl", f"sglang-{version}-*.whl")))
    return found[0] if found else None


def download_wheel(version: str, wheels_dir: Optional[str] = None, *, quiet: bool = True) -> str:
    """`pip download --no-deps sglang==<version>` into `<wheels_dir>/dl` (skipped when present)."""
    existing = find_wheel(version, wheels_dir)
    if existing:
        return existing
    dl = os.path.join(wheels_dir or default_wheels_dir(), "dl")
    os.makedirs(dl, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           f"sglang=={version}", "-d", dl]
    if quiet:
        cmd.insert(4, "-q")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = find_wheel(version, wheels_dir)
    if proc.returncode != 0 or wheel is None:
        raise RuntimeError(
            f"could not download sglang=={version} ({' '.join(cmd)}):\n{proc.stderr.strip()[-2000:]}")
    return wheel


def ensure_unpacked(version: str, wheels_dir: Optional[str] = None) -> str:
    """Return the source root of `version`, downloading and unpacking its wheel if needed."""
    root = source_root(version, wheels_dir)
    if is_unpacked(version, wheels_dir):
        return root
    wheel = download_wheel(version, wheels_dir)
    tmp = root + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.startswith("sglang/") and n.endswith(".py")]
        if not members:
            raise RuntimeError(f"{wheel} holds no sglang/*.py files")
        zf.extractall(tmp, members)
    with open(os.path.join(tmp, _COMPLETE), "w", encoding="utf-8") as f:
        f.write(os.path.basename(wheel) + "\n")
    shutil.rmtree(root, ignore_errors=True)  # a half-unpacked tree from an interrupted run
    os.replace(tmp, root)
    return root
