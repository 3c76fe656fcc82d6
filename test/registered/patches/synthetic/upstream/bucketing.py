"""An 'upstream' module the fake target lacks (installed with install_module)."""

from sglang_ext.errors import ExtConfigError


def pick_bucket(n, buckets):
    for b in buckets:
        if b >= n:
            return b
    raise ExtConfigError(f"{n} exceeds every bucket")
