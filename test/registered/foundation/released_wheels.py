"""Unpacked real sglang release wheels for the foundation tests (downloaded once, then cached).

The cache is the one `scripts/gen_fingerprints.py` fills (`.ci/run` calls it with
`--check` before the tests), so in CI nothing is downloaded here.
"""

from __future__ import annotations

import pytest

from sglang_ext import wheels


@pytest.fixture(scope="session")
def released_tree():
    """`released_tree("0.5.23")` -> source root (the directory holding that release's `sglang/`)."""

    def get(version: str) -> str:
        try:
            return wheels.ensure_unpacked(version)
        except RuntimeError as exc:  # no network and no cache: say so instead of a bare failure
            pytest.fail(f"sglang {version} wheel unavailable: {exc}; run python scripts/gen_fingerprints.py")

    return get
