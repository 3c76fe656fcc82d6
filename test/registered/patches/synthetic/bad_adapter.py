"""Adapter code the patch generator must refuse (tests of scripts/gen_patches.py only)."""

import cmath as math
import functools


def make_closure(scale):
    def run(self, x):
        return ("closure", scale * len(x))

    return run


def _ext_trace(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


@_ext_trace
def describe(self):
    return "decorated"


# Evaluated with the adapter's `math` (cmath) in the plugin, the target's `math` in a fork.
_EXT_PI = math.pi


def key(self, x):
    return _EXT_PI * len(x)


def _ext_describe_twice(self):
    return _ext_describe_twice.__name__
