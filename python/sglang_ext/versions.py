"""The sglang releases sglang-ext supports, and how the installed one is found."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
from typing import Optional, Tuple

# The releases sglang-ext supports (declared here only). Adapters are written against the newest;
# the registry's RENAMES give the older its names. A release between them gets every patch whose
# targets' fingerprints all match a supported release's.
SUPPORTED_SGLANG: Tuple[str, ...] = ("0.5.17", "0.5.23")
SUPPORTED_RANGE = f">={SUPPORTED_SGLANG[0]},<={SUPPORTED_SGLANG[-1]}"


def version_key(version: str) -> Tuple[int, ...]:
    digits = ("".join(ch for ch in part if ch.isdigit()) for part in release(version).split("."))
    return tuple(int(d or 0) for d in digits)


def dist_version(name: str) -> Optional[str]:
    """The installed distribution's version (None: not installed)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_sglang_version() -> Optional[str]:
    return dist_version("sglang")


def at_least(version: str, since: str) -> bool:
    return version_key(version) >= version_key(since)


def release(version: str) -> str:
    return version.split("+")[0]  # a local version label (+cu130, +gitsha) is the same release


def within_supported_range(version: str) -> bool:
    """A supported release, or one between two (decided per patch by fingerprints)."""
    key = version_key(release(version))
    return version_key(SUPPORTED_SGLANG[0]) <= key <= version_key(SUPPORTED_SGLANG[-1])


def unsupported_message(version: Optional[str], where: Optional[str] = None) -> str:
    """How every report says that this sglang release is not supported."""
    return (f"sglang {version or '(not found)'}{f' ({where})' if where else ''} is not supported; "
            f"supported: {', '.join(SUPPORTED_SGLANG)}")


def installed_sglang_path() -> Optional[str]:
    """Directory of the importable `sglang` package, found without importing it."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def source_tree_version(source_root: str) -> Optional[str]:
    """sglang version of an unpacked tree (`<source_root>/sglang/_version.py`), without importing it."""
    path = os.path.join(source_root, "sglang", "_version.py")
    if not os.path.exists(path):
        return None
    with open(path, "r", encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            if any(isinstance(t, ast.Name) and t.id == "__version__" for t in stmt.targets):
                return stmt.value.value
    return None
