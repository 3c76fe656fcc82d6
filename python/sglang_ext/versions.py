"""The sglang releases sglang-ext supports, and how the installed one is found."""

from __future__ import annotations

import importlib.metadata
from typing import Optional, Tuple

# The adapters are written against this release; fingerprints gate everything else.
SUPPORTED_SGLANG: Tuple[str, ...] = ("0.5.17",)
SUPPORTED_RANGE = ">=0.5.17,<0.5.18"


def version_key(version: str) -> Tuple[int, ...]:
    out = []
    for part in version.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def installed_sglang_version() -> Optional[str]:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def at_least(version: str, since: str) -> bool:
    return version_key(version) >= version_key(since)
