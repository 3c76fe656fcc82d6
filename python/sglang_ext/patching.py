"""How a patch touches sglang: recorded attribute swaps (verified, rolled back whole), applied on import.
Parts run when their trigger module is imported, so an LLM-only server never imports the VL stacks.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
from dataclasses import dataclass, field
from types import FunctionType, ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple

_MISSING = object()


@dataclass(eq=False)
class AttrSwap:
    owner: Any
    name: str
    original: Any  # _MISSING if the attribute did not exist
    replacement: Any
    # swaps of names bound from this module swap's replacement, settled at its rollback (see _unpatched)
    dependents: List["AttrSwap"] = field(default_factory=list)

    def describe(self) -> str:
        if isinstance(self.owner, _ItemOwner):
            return f"{self.owner!r}[{self.name!r}]"
        owner = getattr(self.owner, "__qualname__", None) or getattr(self.owner, "__name__", repr(self.owner))
        return f"{owner}.{self.name}"


@dataclass
class PatchContext:
    """Handed to every adapter part. Adapters never assign to sglang objects directly."""

    patch_name: str
    settings: Any
    swaps: List[AttrSwap] = field(default_factory=list)

    def setattr(self, owner: Any, name: str, value: Any) -> None:
        original = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)
        setattr(owner, name, value)
        self._record(AttrSwap(owner, name, original, value))

    def setitem(self, mapping: Any, key: Any, value: Any) -> None:
        """Replace a dict entry (e.g. qwen3_vl.graph_runners_dict['cuda'])."""
        original = mapping.get(key, _MISSING)
        mapping[key] = value
        self._record(AttrSwap(_ItemOwner(mapping), key, original, value))

    def _record(self, swap: AttrSwap) -> None:
        swap.original = _unpatched(swap)
        self.swaps.append(swap)
        _live_swaps.setdefault(id(swap.replacement), []).append(swap)

    def problems(self) -> List[str]:
        """Verify: every recorded swap is still what is live."""
        return [f"{s.describe()} is not the patched object after applying" for s in self.swaps
                if _live_attr(s.owner, s.name) is not s.replacement]

    def rollback(self) -> None:
        for s in reversed(self.swaps):
            if isinstance(s.owner, _ItemOwner):
                if s.original is _MISSING:
                    s.owner.mapping.pop(s.name, None)
                else:
                    s.owner.mapping[s.name] = s.original
            elif s.original is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(s.owner, s.name)
            else:
                setattr(s.owner, s.name, s.original)
            _forget(s)
        self.swaps.clear()


# Swaps not yet rolled back, by id of their replacement (which the swap holds, so the id is not reused).
_live_swaps: Dict[int, List[AttrSwap]] = {}


def _location(owner: Any, name: Any) -> Tuple[int, Any]:
    return (id(owner.mapping) if isinstance(owner, _ItemOwner) else id(owner)), name


def _unpatched(swap: AttrSwap) -> Any:
    """What `swap`'s attribute held before sglang-ext, given that it holds `swap.original` now.

    A name bound from patched code holds our object, which rollback must not restore: another swap's
    replacement maps to that swap's original; a name from a module installed whole maps to the same name
    in the module it replaced (resolved at that swap's rollback if never imported)."""
    current = swap.original
    if not isinstance(current, (FunctionType, type)):
        return current
    here = _location(swap.owner, swap.name)
    sources = _live_swaps.get(id(current), [])
    if any(_location(s.owner, s.name) == here for s in sources):
        return current
    for s in sources:  # not a swap that only keeps sglang's object under a new name (`_ext_orig_*`)
        if s.original is not _MISSING and s.original is not current:
            return s.original
    modules = [s for swaps in _live_swaps.values() for s in swaps
               if isinstance(s.owner, _ItemOwner) and s.owner.mapping is sys.modules
               and isinstance(s.replacement, ModuleType) and vars(s.replacement).get(swap.name) is current]
    for s in modules:
        if isinstance(s.original, ModuleType) and hasattr(s.original, swap.name):
            return getattr(s.original, swap.name)
    for s in modules:  # one module may be installed under several names (upstream's and 0.5.17's)
        if s.original is _MISSING:
            s.dependents.append(swap)
    return current


def _forget(swap: AttrSwap) -> None:
    """`swap` was rolled back: drop it from the live swaps, settle its dependents."""
    live = _live_swaps.get(id(swap.replacement), [])
    if swap in live:
        live.remove(swap)
    if not live:
        _live_swaps.pop(id(swap.replacement), None)
    if not swap.dependents:
        return
    dependents, swap.dependents = swap.dependents, []
    try:
        module = importlib.import_module(swap.name)  # sglang's module, now that the swap is undone
    except Exception:  # noqa: BLE001 - not sglang's (a name only sglang-ext provides): nothing to restore
        return
    for dep in dependents:
        original = getattr(module, dep.name, _MISSING)
        if original is _MISSING:
            continue
        if any(dep in swaps for swaps in _live_swaps.values()):
            dep.original = original  # restored when its own patch rolls back
        elif _live_attr(dep.owner, dep.name) is dep.original:
            setattr(dep.owner, dep.name, original)  # rolled back already, to the replaced module's object


class _ItemOwner:
    def __init__(self, mapping: Any):
        self.mapping = mapping

    def __repr__(self) -> str:  # for describe()
        return f"<dict {type(self.mapping).__name__}>"


def _live_attr(owner: Any, name: Any) -> Any:
    if isinstance(owner, _ItemOwner):
        return owner.mapping.get(name, _MISSING)
    d = getattr(owner, "__dict__", None)
    if d is not None and name in d:
        return d[name]
    return getattr(owner, name, _MISSING)


_lock = threading.RLock()
_pending: Dict[str, List[Callable[[ModuleType], None]]] = {}
_finder_installed = False


def when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Run `callback(module)` once `module_name` has finished importing (now, if it has)."""
    global _finder_installed
    with _lock:
        mod = sys.modules.get(module_name)
        if mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing", False):
            callback(mod)
            return
        _pending.setdefault(module_name, []).append(callback)
        if not _finder_installed:
            sys.meta_path.insert(0, _PostImportFinder())
            _finder_installed = True


def cancel_trigger(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Forget a callback registered with `when_imported` that has not run yet (deactivation)."""
    with _lock:
        callbacks = _pending.get(module_name, [])
        if callback in callbacks:
            callbacks.remove(callback)
        if not callbacks:
            _pending.pop(module_name, None)


def _fire(module_name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _pending.pop(module_name, [])
    first_error: Optional[BaseException] = None
    for cb in callbacks:  # one failing patch must not keep the others of this module from running
        try:
            cb(module)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the rest ran
            first_error = first_error or exc
    if first_error is not None:
        raise first_error


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of watched modules so callbacks run after exec_module."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _TriggeringLoader(spec.loader)
                return spec
        return None


class _TriggeringLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _fire(module.__name__, module)

    def __getattr__(self, name):  # get_source, get_code, is_package, ...
        return getattr(self._inner, name)


def install_module(ctx: PatchContext, name: str, source_module: ModuleType) -> None:
    """Make `source_module` importable as `name` (and an attribute of its parent package)."""
    parent_name, _, child = name.rpartition(".")
    ctx.setitem(sys.modules, name, source_module)
    parent = sys.modules.get(parent_name)
    if parent is not None:
        ctx.setattr(parent, child, source_module)
