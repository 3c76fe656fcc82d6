"""Fallback only: import-time stand-ins for packages that a GPU-machine call does not carry.

scripts/gpu_env.sh carries the real sgl_kernel (sm90 common_ops, FA3 in parts) and flashinfer, so
normally nothing here is used. Where a package cannot be had (docs/gpu-harness.md lists what is not
carried), name it in SGX_STANDINS and run python through this module:

    SGX_STANDINS=flashinfer python3 -m sglang_ext_testkit.stand_ins -m pytest -x -q test/...
    SGX_STANDINS=sgl_kernel,flashinfer python3 -m sglang_ext_testkit.stand_ins scripts/bench_vit.py ...

Every module under a named package then imports as an empty package whose attributes raise
RuntimeError("stand-in: ...") when called (applied as a bare decorator, one gives back a stand-in that
raises when called); names in SGX_STANDINS_REFUSE (dotted submodules) raise ModuleNotFoundError
instead, so code guarded by try/except takes its fallback. Run through this module, only this process
and children started through it see the stand-ins. Every process, sglang's spawned servers and
schedulers too: scripts/gpu_env.sh puts a folder per SGX_STANDINS name first on PYTHONPATH whose
__init__ calls stand_in_package() (how a 0.5.23 server starts without the CUTLASS DSL and imageio-ffmpeg,
docs/gpu-harness.md). gpu_env.sh's summary line reports SGX_STANDINS, so a result says what was not real.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import os
import runpy
import sys
import types


def _names(var: str) -> frozenset:
    return frozenset(n.strip() for n in os.environ.get(var, "").split(",") if n.strip())


_HIDDEN_FROM = frozenset({"flashinfer"})


class _Missing:
    """Any attribute is another stand-in; calling one raises."""

    def __init__(self, qualname: str):
        self.__dict__["_qualname"] = qualname

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and (inspect.isfunction(args[0]) or isinstance(args[0], type)):
            return _Missing(f"{self._qualname}({args[0].__qualname__})")  # a bare decorator at import time
        raise RuntimeError(f"stand-in: {self._qualname} is not available on this machine (SGX_STANDINS)")

    def __getitem__(self, item):  # `Type[standin.Numeric]` in annotations (flashinfer's cute_dsl)
        return self

    def __mro_entries__(self, bases):  # `class X(standin.Base)` still defines a class
        return (object,)

    def __repr__(self):
        return f"<stand-in {self._qualname}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _Missing(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, packages: frozenset, refuse: frozenset):
        self.packages, self.refuse = packages, refuse

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in self.packages:
            return None
        if any(name == r or name.startswith(r + ".") for r in self.refuse):
            raise ModuleNotFoundError(f"No module named '{name}' (refused by SGX_STANDINS_REFUSE)", name=name)
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+stand-in"
        module.__sgl_stub__ = True  # what scripts/bench_results.kernels() reports as "stand-in"
        return module

    def exec_module(self, module):
        pass


def _finder_with(packages: frozenset) -> "StandInFinder":
    """The StandInFinder first on sys.meta_path (put there once), now also standing in for `packages`."""
    finder = next((f for f in sys.meta_path if isinstance(f, StandInFinder)), None)
    if finder is None:
        finder = StandInFinder(frozenset(), _names("SGX_STANDINS_REFUSE"))
        sys.meta_path.insert(0, finder)
    finder.packages = finder.packages | packages
    return finder


def install() -> frozenset:
    """Put the finder first on sys.meta_path for SGX_STANDINS; returns the names (empty: nothing done)."""
    packages = _names("SGX_STANDINS")
    if packages:
        _finder_with(packages)
    return packages


def stand_in_package(name: str) -> types.ModuleType:
    """The stand-in for top-level package `name`, its submodules through the finder (first on sys.meta_path).

    For a folder on PYTHONPATH: its `name/__init__.py` does `sys.modules[__name__] = stand_in_package(__name__)`,
    so every interpreter that imports `name` gets the stand-in, spawned ones included."""
    importer = sys._getframe(2)  # past the folder's __init__ that calls this
    while importer is not None and importer.f_code.co_filename.startswith("<frozen importlib"):
        importer = importer.f_back
    # flashinfer probes the real CUTLASS DSL with try/import and uses it at import time: it must see none
    if importer is not None and str(importer.f_globals.get("__name__", "")).split(".")[0] in _HIDDEN_FROM:
        raise ModuleNotFoundError(f"No module named '{name}' (a stand-in, hidden from its importer)", name=name)
    finder = _finder_with(frozenset({name}))
    spec = importlib.machinery.ModuleSpec(name, finder, is_package=True)
    module = finder.create_module(spec)
    module.__spec__, module.__loader__ = spec, finder
    return module


def main(argv: list) -> int:
    if not argv:
        print("usage: python3 -m sglang_ext_testkit.stand_ins (-m MODULE | -c CODE | SCRIPT) [ARGS...]",
              file=sys.stderr)
        return 2
    install()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c"] + argv[2:]
        exec(compile(argv[1], "<stand_ins -c>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    # Some sglang imports leave non-daemon threads behind: flush and leave with os._exit so that a
    # finished run never hangs the device call.
    code = 1
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
