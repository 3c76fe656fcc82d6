"""Synthetic adapter following the adapter rules (tests of scripts/gen_patches.py only)."""

import importlib.util
import logging
import os
import sys
from dataclasses import dataclass, fields

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
    ctx.transplant_function(module, ExtRunner)  # also in fakesg.models: one class, defined once


def patch_models(ctx, module):
    ctx.transplant_function(module, ExtRunner)
    ctx.setitem(module.runners, "ext", ExtRunner)


# ---- a dataclass gains fields and a wrapped __init__ (changed after its decorator ran) ----


@dataclass
class _ExtConfigFields:
    buckets: tuple = (4, 8)


_EXT_CONFIG_FIELDS = fields(_ExtConfigFields)
_EXT_LOGGER = logging.getLogger("fakesg.ext")


def __init__(self, *args, **kwargs):
    for graph_field in _EXT_CONFIG_FIELDS:
        setattr(self, graph_field.name, kwargs.pop(graph_field.name, graph_field.default))
    self._ext_orig___init__(*args, **kwargs)
    self.__post_init__()


def __post_init__(self):
    _EXT_LOGGER.debug("checked %s", self.buckets)
    if list(self.buckets) != sorted(self.buckets):
        raise ValueError("buckets must increase")
    self.checked = getattr(self, "checked", 0) + 1


def _ext_describe_config(self):
    return f"size={self.size} buckets={tuple(self.buckets)}"


def patch_config(ctx, module):
    cls = module.Config
    for graph_field in _EXT_CONFIG_FIELDS:
        ctx.setitem(cls.__dataclass_fields__, graph_field.name, graph_field)
    ctx.setattr(cls, "_ext_orig___init__", cls.__dict__["__init__"])
    ctx.transplant_method(cls, __init__)
    ctx.transplant_method(cls, __post_init__)
    ctx.transplant_method(cls, _ext_describe_config, name="describe")
    # the same module under a second (older) name
    install_module(ctx, "fakesg.legacy_bucketing", sys.modules["fakesg.bucketing"])
