"""Synthetic adapter following the adapter rules (tests of scripts/gen_patches.py only)."""

import importlib.util
import os

from fakesg.runner import Runner
from sglang_ext import knobs
from sglang_ext.errors import ExtConfigError
from sglang_ext.patching import install_module

# Scale of the patched result.
_EXT_SCALE = 3
_EXT_BUCKETS = (4, 8, 16)


def _ext_layout_key(x):
    return (len(x), tuple(x))


def key(self, x):
    return _ext_layout_key(x)


def run(self, x, *, tag="patched"):
    """Run with the layout key.

        Indented docstring line.
    """
    note = """first
   second (indentation is part of the value)"""
    if not x:
        raise ExtConfigError("empty input")
    from fakesg.bucketing import pick_bucket

    bucket = pick_bucket(len(x), _EXT_BUCKETS)
    entries = knobs.current("vit_graph_max_entries")
    return (tag, self.key(x), _EXT_SCALE * self.n, note, math.floor(2.5), bucket, entries,
            self._ext_orig_run(x))


def kind():
    return "ext"


def describe(self):
    return f"Runner({self.n}) via {runner_name()}"


def runner_name():
    return "ext-runner"


class ExtRunner(Runner):
    """A subclass registered in the models' dict."""

    label = "ext"

    def run(self, x, *, tag="ext-runner"):
        return Runner.run(self, x, tag=tag)


def _load_upstream():
    path = os.path.join(os.path.dirname(__file__), "upstream", "bucketing.py")
    spec = importlib.util.spec_from_file_location("sglang_ext_test_upstream_bucketing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def patch_runner(ctx, module):
    install_module(ctx, "fakesg.bucketing", _load_upstream())
    ctx.setattr(module.Runner, "_ext_orig_run", module.Runner.__dict__["run"])
    ctx.transplant_method(module.Runner, key)
    ctx.transplant_method(module.Runner, run)
    ctx.transplant_method(module.Runner, kind, kind="staticmethod")
    ctx.transplant_method(module.Runner, describe)
    ctx.transplant_function(module, runner_name)


def patch_models(ctx, module):
    ctx.transplant_function(module, ExtRunner)
    ctx.setitem(module.runners, "ext", ExtRunner)
