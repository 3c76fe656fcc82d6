#!/usr/bin/env python3
"""Generate the fork-style patch series `patches/sglang-0.5.17/` from the plugin's own source.

The runtime plugin changes sglang only through recorded `PatchContext` swaps, and
every replacement is an adapter function transplanted into the target module's
namespace (`sglang_ext.patching`). This script runs the real activation (strict,
eager) in a subprocess against the pristine sglang 0.5.17 installed in the venv,
reads every recorded swap, and writes the same code into the sglang source:

    method of a class              -> the adapter's def, re-indented into the class body
                                      (replacing the def of that name, or appended)
    module function / adapter class -> its source at module end (or in place of the old def)
    constant                       -> its assignment, copied from the adapter
    imported object                -> the adapter's import line (sglang_ext.* rewritten)
    install_module(...)            -> a new file holding the module's source (a second name
                                      of the same module: a file handing out that module)
    dict item                      -> `<dict>[<key>] = <name>` at module end
    change of a decorated class    -> an assignment after the class (the plugin, too, changes
                                      it after the decorator ran)

Anything it cannot reproduce exactly (a closure, a lambda, a wrapper installed with
ctx.setattr, a decorated function, a name bound to different objects in adapter and
target, a swap it does not know) stops generation with a message naming the adapter
object: the series never carries code that behaves differently from the plugin. The sglang_ext modules that emitted code imports are
vendored as `sglang/ext/...` by the first patch. Every emitted definition is checked
afterwards: its AST in the patched file equals its AST in the adapter.

    python scripts/gen_patches.py            # rewrite patches/sglang-0.5.17/ and the matrix in patches/README.md
    python scripts/gen_patches.py --check    # exit 1 when the committed series is stale

Patch paths are `a/python/sglang/...` (an sglang git checkout, `git apply -p1` or
quilt); `scripts/apply_patches.sh` also applies them to an unpacked wheel or a
site-packages copy (`-p2`).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import datetime
import difflib
import importlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import tokenize
import types
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON_DIR = os.path.join(REPO, "python")
if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)

SERIES_VERSION = "0.5.17"
PATCHES_ROOT = os.path.join(REPO, "patches")
PATCH_DIR = os.path.join(PATCHES_ROOT, f"sglang-{SERIES_VERSION}")
README = os.path.join(PATCHES_ROOT, "README.md")
TOP_README = os.path.join(REPO, "README.md")  # carries the same matrix in its patches section
REGENERATE = "python scripts/gen_patches.py && git add patches/"
CORE_PATCH = "sglang-ext-core.patch"
MATRIX_BEGIN = "<!-- BEGIN GENERATED MATRIX (scripts/gen_patches.py) -->"
MATRIX_END = "<!-- END GENERATED MATRIX -->"
MATRIX_VERSIONS = ("0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")

# Registry entries that only deliver the plugin (a fork has the changes in its source,
# so there is nothing to activate): no patch, a row in the matrix saying why.
PLUGIN_DELIVERY_ONLY: Dict[str, str] = {
    "mg_worker_activation": "activates the plugin inside spawned multimodal_gen workers; "
                            "a patched tree has the changes in its source",
}

# Registry entries the generator cannot yet emit faithfully. Each entry is a known gap of the
# fork series (shown in the matrix); the reason says what the adapter would have to change.
NOT_EMITTABLE: Dict[str, str] = {}


class GenerationError(Exception):
    """The series cannot be generated faithfully; the message names what and why."""


def _package_ext(package: str) -> str:
    return f"{package}.ext"


def rewrite_module_name(name: str, package: str = "sglang") -> str:
    """Where an sglang_ext module lives in the patched tree."""
    if name == "sglang_ext.upstream" or name.startswith("sglang_ext.upstream."):
        rest = name[len("sglang_ext.upstream"):]
        return package + rest
    if name == "sglang_ext" or name.startswith("sglang_ext."):
        return _package_ext(package) + name[len("sglang_ext"):]
    return name


def _is_ext(name: Optional[str]) -> bool:
    return bool(name) and (name == "sglang_ext" or name.startswith("sglang_ext."))


# ===========================================================================
# Collection (runs inside the activated process): swaps -> emission items
# ===========================================================================

def _parse_file(path: str) -> ast.Module:
    with open(path, "r", encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def _top_level_bindings(tree: ast.Module) -> Set[str]:
    """Names a module binds at top level (defs, classes, assignments, imports, also inside if/try)."""
    out: Set[str] = set()

    def visit(stmts: Iterable[ast.stmt]) -> None:
        for s in stmts:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(s.name)
            elif isinstance(s, (ast.Import, ast.ImportFrom)):
                for a in s.names:
                    out.add(a.asname or a.name.split(".")[0])
            elif isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = s.targets if isinstance(s, ast.Assign) else [s.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            out.add(n.id)
            elif isinstance(s, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(s, block, []) or [])
                for h in getattr(s, "handlers", []) or []:
                    visit(h.body)
    visit(tree.body)
    return out


def _has_future_annotations(tree: ast.Module) -> bool:
    return any(isinstance(s, ast.ImportFrom) and s.module == "__future__"
               and any(a.name == "annotations" for a in s.names) for s in tree.body)


def _top_level_def(tree: ast.Module, name: str) -> Optional[ast.stmt]:
    found = None
    for s in tree.body:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and s.name == name:
            found = s
    return found


def _top_level_assign(tree: ast.Module, name: str) -> Optional[ast.stmt]:
    found = None
    for s in tree.body:
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name) \
                and s.targets[0].id == name:
            found = s
        elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id == name \
                and s.value is not None:
            found = s
    return found


def _import_binding(tree: ast.Module, name: str) -> Optional[Tuple[ast.stmt, ast.alias]]:
    """The top-level import statement (and alias) that binds `name` in a module, if any."""
    found = None
    for s in tree.body:
        if isinstance(s, (ast.Import, ast.ImportFrom)):
            for a in s.names:
                bound = a.asname or (a.name.split(".")[0] if isinstance(s, ast.Import) else a.name)
                if bound == name:
                    found = (s, a)
    return found


def _import_statement(stmt: ast.stmt, alias: ast.alias) -> str:
    if isinstance(stmt, ast.ImportFrom):
        return f"from {stmt.module} import {alias.name}" + (f" as {alias.asname}" if alias.asname else "")
    return f"import {alias.name}" + (f" as {alias.asname}" if alias.asname else "")


def _resolve_import(stmt: ast.stmt, alias: ast.alias) -> Any:
    if isinstance(stmt, ast.ImportFrom):
        mod = importlib.import_module(stmt.module)
        if hasattr(mod, alias.name):
            return getattr(mod, alias.name)
        return importlib.import_module(f"{stmt.module}.{alias.name}")
    mod = importlib.import_module(alias.name)
    if alias.asname:
        return mod
    return sys.modules[alias.name.split(".")[0]]


def _unwrap(value: Any) -> Tuple[Optional[str], Any]:
    if isinstance(value, staticmethod):
        return "staticmethod", value.__func__
    if isinstance(value, classmethod):
        return "classmethod", value.__func__
    if isinstance(value, property):
        if value.fset is not None or value.fdel is not None:
            return "property-with-setter", value.fget
        return "property", value.fget
    return None, value


def _annotation_names(node: ast.AST) -> Set[str]:
    """Names in the annotations a def evaluates when it is defined (not nested defs)."""
    out: Set[str] = set()
    anns: List[ast.AST] = []
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        for arg in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]:
            if arg is not None and arg.annotation is not None:
                anns.append(arg.annotation)
        if node.returns is not None:
            anns.append(node.returns)
    elif isinstance(node, ast.ClassDef):
        for s in node.body:
            if isinstance(s, ast.AnnAssign):
                anns.append(s.annotation)
            elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out |= _annotation_names(s)
    for ann in anns:
        for n in ast.walk(ann):
            if isinstance(n, ast.Name):
                out.add(n.id)
    return out


def _definition_time_names(node: ast.AST) -> Set[str]:
    """Names evaluated when a def/class statement runs: decorators, defaults, bases, class-body code."""
    exprs: List[ast.AST] = list(getattr(node, "decorator_list", []))
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        exprs += list(node.args.defaults) + [d for d in node.args.kw_defaults if d is not None]
    elif isinstance(node, ast.ClassDef):
        exprs += list(node.bases) + [k.value for k in node.keywords]
        for s in node.body:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                exprs += list(s.decorator_list) + list(s.args.defaults)
                exprs += [d for d in s.args.kw_defaults if d is not None]
            elif not isinstance(s, ast.ClassDef):
                exprs.append(s)
    out: Set[str] = set()
    for e in exprs:
        for n in ast.walk(e):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                out.add(n.id)
    return out


@dataclass
class _SyntheticSwap:
    """A global the emitted code needs that no swap installed (see _Collector.provide)."""
    owner: Any
    name: str
    original: Any
    replacement: Any

    def describe(self) -> str:
        return f"{self.owner.__name__}.{self.name}"


class _Collector:
    """Turns the swaps of activated PatchContexts into JSON-able emission items."""

    def __init__(self, adapters: Mapping[str, Sequence[types.ModuleType]], package: str, upstream_root: str):
        self.adapters = adapters
        self.package = package
        self.upstream_root = upstream_root
        self.errors: List[str] = []
        self.files: Dict[str, str] = {}  # module -> installed file (to compare with the pristine tree)
        self._trees: Dict[str, ast.Module] = {}
        self.import_names: Dict[str, Set[str]] = {}  # module -> names emitted as imports (top of file)
        self.end_names: Dict[str, Set[str]] = {}  # module -> names emitted at the end of the file
        self.provided: Set[Tuple[str, str]] = set()  # (module, name) synthesized for emitted code
        self.pending: List[Dict[str, Any]] = []  # synthesized items, emitted before their user
        self.installed: Dict[str, Any] = {}  # install_module targets of every patch so far

    # -- helpers ------------------------------------------------------------
    def tree(self, path: str) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = _parse_file(path)
        return self._trees[path]

    def error(self, patch: str, message: str) -> None:
        self.errors.append(f"{patch}: {message}")

    def module_rel(self, module: types.ModuleType) -> str:
        top = sys.modules[self.package]
        base = os.path.dirname(os.path.dirname(os.path.abspath(top.__file__)))
        path = os.path.abspath(module.__file__)
        self.files[module.__name__] = path
        return os.path.relpath(path, base).replace(os.sep, "/")

    def in_package(self, module_name: str) -> bool:
        return module_name == self.package or module_name.startswith(self.package + ".")

    def source_def(self, patch: str, fn: types.FunctionType, what: str, installed_as: str
                   ) -> Optional[Dict[str, Any]]:
        """Check that an adapter function can be pasted as-is; return where its source is."""
        from sglang_ext.patching import _code_names as global_names

        def_name = fn.__code__.co_name  # the name in the `def` line (__name__ may be reassigned)
        label = f"{fn.__module__}.{def_name}"
        if fn.__closure__:
            self.error(patch, f"{what}: {label} is a closure (captures "
                              f"{', '.join(fn.__code__.co_freevars)}); write it as a module-level def")
            return None
        if def_name == "<lambda>" or "<locals>" in fn.__qualname__:
            self.error(patch, f"{what}: {label} is a lambda or nested function; write it as a module-level def")
            return None
        src_file = inspect.getsourcefile(fn)
        if not src_file or not os.path.exists(src_file):
            self.error(patch, f"{what}: no source file for {label}")
            return None
        node = _top_level_def(self.tree(src_file), def_name)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.error(patch, f"{what}: {def_name} is not a top-level def in {src_file}")
            return None
        if node.decorator_list:
            self.error(patch, f"{what}: {label} is decorated; a decorated function cannot be transplanted "
                              "as written")
            return None
        if node.lineno != fn.__code__.co_firstlineno:
            self.error(patch, f"{what}: the live {def_name} (line {fn.__code__.co_firstlineno}) is not the "
                              f"def at line {node.lineno} of {src_file} (redefined?)")
            return None
        if def_name != installed_as and def_name in global_names(fn.__code__):
            self.error(patch, f"{what}: {label} refers to itself by its adapter name; installed as "
                              f"{installed_as} it would call another object in the patched tree")
            return None
        return {"src_file": src_file, "src_name": def_name, "src_line": node.lineno}

    def check_definition_names(self, patch: str, what: str, node: ast.AST, target: types.ModuleType,
                               placed_at_end: bool) -> None:
        """Names a def/class evaluates when defined must exist at that point of the patched module."""
        tree = self.tree(target.__file__)
        available = _top_level_bindings(tree) | self.import_names.get(target.__name__, set()) | set(dir(builtins))
        if placed_at_end:
            available |= self.end_names.get(target.__name__, set())
        names = _definition_time_names(node)
        if not _has_future_annotations(tree):
            names |= _annotation_names(node)
        missing = sorted(n for n in names if n not in available)
        if missing:
            self.error(patch, f"{what}: evaluates {', '.join(missing)} when defined, which "
                              f"{target.__name__} does not define before it in the patched tree "
                              "(use literal defaults / string annotations)")

    def adapter_holding(self, patch: str, name: str, value: Any) -> Optional[types.ModuleType]:
        for mod in self.adapters.get(patch, ()):
            if name in vars(mod) and vars(mod)[name] is value:
                return mod
        return None

    def provide(self, patch: str, what: str, names: Iterable[str], adapter: types.ModuleType,
                target: types.ModuleType) -> bool:
        """Code copied from `adapter` into `target` (an adapter class, a constant's expression) resolves
        `names` in the target in the patched tree but in the adapter in the plugin: each must be the
        same object in both. Names the target lacks are emitted too (imports, constants, classes);
        the patched tree then has a few globals more than the plugin installs, never other objects."""
        live = vars(target)
        ok = True
        for name in sorted(names):
            if name not in vars(adapter):
                continue  # a builtin, or a local of a comprehension
            value = vars(adapter)[name]
            if name in live:
                if live[name] is not value:
                    self.error(patch, f"{what}: uses {name}, which {target.__name__} binds to another object "
                                      f"than {adapter.__name__} does")
                    ok = False
                continue
            key = (target.__name__, name)
            if key in self.provided:
                continue
            self.provided.add(key)
            item = self._module_item(patch, _SyntheticSwap(target, name, _missing(), value), {}, needed_by=what)
            if item is None:
                ok = False
            else:
                self.pending.append(item)
        return ok

    # -- collection -----------------------------------------------------------
    def collect(self, patch: str, swaps: Sequence[Any]) -> List[Dict[str, Any]]:
        from sglang_ext.patching import _ItemOwner

        last: Dict[Tuple[int, Any], Any] = {}
        order: List[Tuple[int, Any]] = []
        for s in swaps:
            key = (id(s.owner.mapping) if isinstance(s.owner, _ItemOwner) else id(s.owner), s.name)
            if key not in last:
                order.append(key)
            last[key] = s
        swaps = [last[k] for k in order]

        installed = {s.name: s.replacement for s in swaps
                     if isinstance(s.owner, _ItemOwner) and s.owner.mapping is sys.modules}
        self.installed.update(installed)
        for s in swaps:
            if not isinstance(s.owner, types.ModuleType):
                continue
            _, inner = _unwrap(s.replacement)
            target = s.owner
            mod = self.adapter_holding(patch, s.name, s.replacement)
            if getattr(inner, "__sglang_ext_source__", None) is None and (
                    (mod is not None and _import_binding(self.tree(mod.__file__), s.name) is not None)
                    or _importable_from(s.replacement) is not None):
                self.import_names.setdefault(target.__name__, set()).add(s.name)
            elif _top_level_def(self.tree(target.__file__), s.name) is None \
                    and _top_level_assign(self.tree(target.__file__), s.name) is None:
                self.end_names.setdefault(target.__name__, set()).add(s.name)

        items: List[Dict[str, Any]] = []
        for s in swaps:
            self.pending = []
            if isinstance(s.owner, _ItemOwner):
                item = self._dict_item(patch, s, installed)
            elif isinstance(s.owner, types.ModuleType):
                item = self._module_item(patch, s, installed)
            elif isinstance(s.owner, type):
                item = self._class_item(patch, s, swaps)
            else:
                self.error(patch, f"{s.describe()}: swaps on {type(s.owner).__name__} objects are not supported")
                item = None
            items.extend(self.pending)
            if item is not None:
                items.append(item)
        return items

    def _class_item(self, patch: str, s: Any, swaps: Sequence[Any]) -> Optional[Dict[str, Any]]:
        cls = s.owner
        target = sys.modules.get(cls.__module__)
        if target is None or not self.in_package(cls.__module__):
            self.error(patch, f"{s.describe()}: class {cls.__qualname__} is not defined in {self.package}")
            return None
        where = {"module": target.__name__, "file": self.module_rel(target), "cls": cls.__qualname__,
                 "name": s.name}
        kind, inner = _unwrap(s.replacement)
        source = getattr(inner, "__sglang_ext_source__", None)
        if source is not None:
            if kind == "property-with-setter":
                self.error(patch, f"{s.describe()}: properties with a setter are not supported")
                return None
            if inner.__code__ is not source.__code__ or inner.__defaults__ != source.__defaults__:
                self.error(patch, f"{s.describe()}: installed code differs from its adapter source")
                return None
            loc = self.source_def(patch, source, s.describe(), s.name)
            if loc is None:
                return None
            node = _top_level_def(self.tree(loc["src_file"]), loc["src_name"])
            after = self.after_class(patch, cls, target, s)
            if after is None:
                return None
            if after:
                # Added after the class statement, as the plugin does (see after_class).
                if s.name in vars(target):
                    self.error(patch, f"{s.describe()}: {target.__name__} has a global {s.name}; the def "
                                      "emitted after the class would replace it")
                    return None
                self.check_definition_names(patch, s.describe(), node, target, True)
                return {"op": "post_method", "decorator": kind, **where, **loc}
            mangled = sorted({n for n in _identifiers(node) if n.startswith("__") and not n.endswith("__")})
            if mangled:
                self.error(patch, f"{s.describe()}: uses {', '.join(mangled)}; inside a class body Python "
                                  "mangles such names (to _Class__name), so the fork would differ")
                return None
            self.check_definition_names(patch, s.describe(), node, target, False)
            return {"op": "method", "decorator": kind, **where, **loc}
        # _ext_orig_<name> = <name>: the original kept under another name (adapter rule 3)
        of = None
        aliasable = isinstance(s.replacement, (types.FunctionType, staticmethod, classmethod, property))
        for other in swaps if aliasable else ():
            if other.owner is cls and other.name != s.name and other.original is s.replacement:
                of = other.name
        if of is None and aliasable:
            for other_name, value in vars(cls).items():
                if other_name != s.name and value is s.replacement:
                    of = other_name
        if of is not None:
            after = self.after_class(patch, cls, target, _SyntheticSwap(cls, of, s.replacement, None))
            if after is None:
                return None
            return {"op": "post_alias" if after else "class_alias", "of": of, **where}
        if s.original is _missing() and _is_literal_value(s.replacement):
            after = self.after_class(patch, cls, target, s)
            if after is None:
                return None
            return {"op": "post_constant" if after else "class_constant", "value_repr": repr(s.replacement),
                    **where}
        self.error(patch, f"{s.describe()}: installed with ctx.setattr ({type(s.replacement).__name__}); the "
                          "generator can only emit transplant_method defs, _ext_orig_ aliases and new literal "
                          "class attributes")
        return None

    def after_class(self, patch: str, cls: type, target: types.ModuleType, s: Any) -> Optional[bool]:
        """True if `s` must be emitted as an assignment after the class statement instead of in its body.

        The plugin changes a class after its decorators ran. In the body of a decorated class a
        new or replaced member would be seen by the decorator (a `__post_init__` makes @dataclass's
        __init__ call it), and an attribute the decorator generated (a dataclass __init__) has no
        def to replace. None (error recorded): the class has no source."""
        node = _find_class(self.tree(target.__file__), cls.__qualname__)
        if node is None:
            self.error(patch, f"{s.describe()}: class {cls.__qualname__} not found in {target.__file__}")
            return None
        if node.decorator_list:
            # @dataclass looks at annotations and dunder methods only: a plain method may stay in the body
            plain_method = isinstance(s.replacement, types.FunctionType) and not s.name.startswith("__") \
                and s.name not in getattr(cls, "__dataclass_fields__", {})
            if not (plain_method and all(_is_dataclass_decorator(d) for d in node.decorator_list)):
                return True
        if s.original is _missing():
            return False
        return not any(s.name in _class_body_names(stmt) for stmt in node.body)

    def value_expression(self, module: types.ModuleType, value: Any) -> Optional[str]:
        """An expression over `module`'s globals that evaluates to `value` itself."""
        for name, v in vars(module).items():
            if v is value and not name.startswith("__"):
                return name
        for name, v in vars(module).items():
            if isinstance(v, (tuple, list)) and not name.startswith("__"):
                for i, element in enumerate(v):
                    if element is value:
                        return f"{name}[{i}]"
        return None

    def _module_item(self, patch: str, s: Any, installed: Mapping[str, Any], needed_by: str = ""
                     ) -> Optional[Dict[str, Any]]:
        target: types.ModuleType = s.owner
        what = f"{s.describe()}" + (f" (needed by {needed_by})" if needed_by else "")
        if not self.in_package(target.__name__):
            self.error(patch, f"{what}: {target.__name__} is not part of {self.package}")
            return None
        if installed.get(f"{target.__name__}.{s.name}") is s.replacement:
            return None  # parent attribute of an installed module: importing the new file sets it
        where = {"module": target.__name__, "file": self.module_rel(target), "name": s.name}
        ttree = self.tree(target.__file__)
        if s.original is not _missing():
            binding = _import_binding(ttree, s.name)
            if binding is not None:
                stmt, alias = binding
                try:
                    source_value = _resolve_import(stmt, alias)
                except Exception as exc:  # noqa: BLE001
                    source_value = exc
                if source_value is s.replacement:
                    return None  # rebinding an imported name: the patched source module provides it
                self.error(patch, f"{what}: rebinds a name {target.__name__} imports "
                                  f"({_import_statement(stmt, alias)}) to an object that module does not "
                                  "hold; patch the source module instead")
                return None
        kind, inner = _unwrap(s.replacement)
        source = getattr(inner, "__sglang_ext_source__", None)
        if source is not None and kind is None:
            loc = self.source_def(patch, source, what, s.name)
            if loc is None:
                return None
            node = _top_level_def(self.tree(loc["src_file"]), loc["src_name"])
            at_end = _top_level_def(ttree, s.name) is None
            self.check_definition_names(patch, what, node, target, at_end)
            return {"op": "def", "what": "function", **where, **loc}
        adapter = self.adapter_holding(patch, s.name, s.replacement)
        if adapter is None:
            origin = _importable_from(s.replacement)
            adapter_modules = {m.__name__ for mods in self.adapters.values() for m in mods}
            if origin is not None and origin[0] in adapter_modules:
                self.error(patch, f"{what}: adapter function {origin[0]}.{origin[1]} is not transplanted; "
                                  "install it with ctx.transplant_function so it runs in the target module's "
                                  "namespace")
                return None
            if origin is not None and not origin[0].startswith("sglang_ext.adapters"):
                module, attr = origin
                return {"op": "import", "stmt": f"from {module} import {attr}"
                                                + (f" as {s.name}" if attr != s.name else ""), **where}
            self.error(patch, f"{what}: cannot tell where {type(s.replacement).__name__} "
                              f"{s.replacement!r:.80} comes from (not a global of the patch's adapters, "
                              "not importable by its __module__/__qualname__)")
            return None
        atree = self.tree(adapter.__file__)
        binding = _import_binding(atree, s.name)
        if binding is not None:
            stmt, alias = binding
            if isinstance(stmt, ast.ImportFrom) and stmt.level:
                self.error(patch, f"{what}: relative import in {adapter.__name__}; use an absolute one")
                return None
            if isinstance(stmt, ast.Import) and not alias.asname and "." in alias.name and _is_ext(alias.name):
                self.error(patch, f"{what}: `import {alias.name}` binds `sglang_ext`, which the patched "
                                  "tree renames; use `from ... import ...`")
                return None
            if _resolve_import(stmt, alias) is not s.replacement:
                self.error(patch, f"{what}: {_import_statement(stmt, alias)} does not give the installed object")
                return None
            self.import_names.setdefault(target.__name__, set()).add(s.name)
            return {"op": "import", "stmt": _import_statement(stmt, alias), **where}
        if isinstance(s.replacement, type) and s.replacement.__module__ == adapter.__name__:
            return self._adapter_class(patch, s, adapter, target, where, what)
        if isinstance(s.replacement, types.FunctionType):
            self.error(patch, f"{what}: adapter function {adapter.__name__}.{s.name} is not transplanted; "
                              "install it with ctx.transplant_function so it runs in the target module's "
                              "namespace")
            return None
        node = _top_level_assign(atree, s.name)
        if node is None:
            self.error(patch, f"{what}: {adapter.__name__}.{s.name} is neither a def, a class, an import "
                              "nor a simple top-level assignment")
            return None
        try:
            literal = ast.literal_eval(node.value)
        except ValueError:
            literal = _NOT_LITERAL
        if literal is _NOT_LITERAL:
            # An expression: the same code, evaluated in the target, over the same objects.
            names = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            if not self.provide(patch, f"{adapter.__name__}.{s.name}", names, adapter, target):
                return None
        elif type(literal) is not type(s.replacement) or literal != s.replacement:
            self.error(patch, f"{what}: the live value differs from the literal in {adapter.__file__}")
            return None
        if _top_level_assign(ttree, s.name) is None:
            self.end_names.setdefault(target.__name__, set()).add(s.name)
        return {"op": "constant", "src_file": adapter.__file__, "src_line": node.lineno,
                "src_end_line": node.end_lineno, **where}

    def _adapter_class(self, patch, s, adapter, target, where, what) -> Optional[Dict[str, Any]]:
        from sglang_ext.patching import _code_names as global_names  # global-name instructions only

        cls = s.replacement
        atree = self.tree(adapter.__file__)
        node = _top_level_def(atree, cls.__name__)
        if not isinstance(node, ast.ClassDef) or cls.__qualname__ != cls.__name__ or cls.__name__ != s.name:
            self.error(patch, f"{what}: {cls.__qualname__} is not a top-level class named {s.name} "
                              f"in {adapter.__file__}")
            return None
        # Methods of an adapter class keep the adapter's globals in the plugin; in the patched
        # tree they see the target module's. Both must hold the same objects.
        names: Set[str] = set()
        for value in vars(cls).values():
            _, fn = _unwrap(value)
            if isinstance(fn, types.FunctionType):
                if os.path.abspath(fn.__code__.co_filename) != os.path.abspath(adapter.__file__):
                    continue  # generated by a class decorator (dataclass), which the fork runs too
                if fn.__closure__ and fn.__code__.co_freevars != ("__class__",):
                    self.error(patch, f"{what}: method {fn.__qualname__} is a closure")
                    return None
                names |= global_names(fn.__code__)
        names |= _definition_time_names(node)
        names.discard(cls.__name__)
        if not self.provide(patch, f"class {adapter.__name__}.{cls.__name__}", names, adapter, target):
            return None
        at_end = _top_level_def(self.tree(target.__file__), s.name) is None
        if at_end:
            self.end_names.setdefault(target.__name__, set()).add(s.name)
        self.check_definition_names(patch, what, node, target, at_end)
        return {"op": "def", "what": "class", "src_file": adapter.__file__, "src_name": cls.__name__,
                "src_line": node.lineno, **where}

    def _dict_item(self, patch: str, s: Any, installed: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
        mapping = s.owner.mapping
        if mapping is sys.modules:
            return self._installed_module(patch, s, installed)
        holder, dict_name = None, None
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not self.in_package(mod_name):
                continue
            for name, value in list(vars(mod).items()):
                if value is mapping:
                    holder, dict_name = mod, name
                    break
            if holder is not None:
                break
        if holder is None:
            # a dict held by a class (e.g. a dataclass's __dataclass_fields__)
            for mod_name, mod in list(sys.modules.items()):
                if mod is None or not self.in_package(mod_name):
                    continue
                for name, value in list(vars(mod).items()):
                    if isinstance(value, type) and value.__module__ == mod_name:
                        for attr, held in vars(value).items():
                            if held is mapping:
                                holder, dict_name = mod, f"{value.__qualname__}.{attr}"
                if holder is not None:
                    break
        if holder is None:
            self.error(patch, f"{s.describe()}[{s.name!r}]: the dict is neither a global of a {self.package} "
                              "module nor an attribute of one of its classes")
            return None
        if not _is_literal_value(s.name):
            self.error(patch, f"{dict_name}[{s.name!r}]: key is not a literal")
            return None
        preferred = getattr(s.replacement, "__name__", None)
        if isinstance(preferred, str) and vars(holder).get(preferred) is s.replacement:
            value = preferred
        else:
            value = self.value_expression(holder, s.replacement)
        if value is None:
            self.error(patch, f"{holder.__name__}.{dict_name}[{s.name!r}]: the new value is not a global of "
                              f"{holder.__name__} (nor an element of one); install it there first "
                              "(ctx.transplant_function)")
            return None
        return {"op": "dict_item", "module": holder.__name__, "file": self.module_rel(holder),
                "dict": dict_name, "key_repr": repr(s.name), "value": value}

    def _installed_module(self, patch: str, s: Any, installed: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
        module = s.replacement
        if not isinstance(module, types.ModuleType) or not self.in_package(s.name):
            self.error(patch, f"sys.modules[{s.name!r}]: only install_module of a {self.package} module "
                              "is supported")
            return None
        rel = "/".join(s.name.split(".")) + ".py"
        src_file = os.path.abspath(module.__file__)
        if src_file == os.path.abspath(self.mirrored(s.name)):
            return {"op": "new_module", "module": s.name, "file": rel, "src_file": src_file}
        # The same module under a second name (0.5.17's name of a renamed upstream module, or an
        # existing sglang module under its upstream name): a file that hands out that module.
        canonical = [name for name, mod in self.installed.items()
                     if mod is module and name != s.name and src_file == os.path.abspath(self.mirrored(name))]
        if not canonical and self.in_package(module.__name__) and sys.modules.get(module.__name__) is module:
            canonical = [module.__name__]
        if not canonical:
            self.error(patch, f"install_module({s.name!r}): its source {src_file} is neither the mirrored path "
                              f"{self.mirrored(s.name)} (adapter rule 4) nor a module installed or existing "
                              "under another name")
            return None
        return {"op": "module_alias", "module": s.name, "file": rel, "of": canonical[0]}

    def mirrored(self, module_name: str) -> str:
        return os.path.join(self.upstream_root, *module_name.split(".")[1:]) + ".py"


class _NotLiteral:
    pass


_NOT_LITERAL = _NotLiteral()


def _missing() -> Any:
    from sglang_ext.patching import _MISSING

    return _MISSING


def _importable_from(value: Any) -> Optional[Tuple[str, str]]:
    """(module, name) from which `value` (a class or function) can be imported, if any."""
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "." in qualname or "<" in qualname:
        return None
    mod = sys.modules.get(module)
    if mod is None or getattr(mod, qualname, None) is not value:
        return None
    return module, qualname


def _is_literal_value(value: Any) -> bool:
    try:
        return ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError):
        return False


def _read(path: str) -> str:
    with open(path, "r", encoding="utf-8") as f:
        return f.read()


UPSTREAM_ROOT = os.path.join(PYTHON_DIR, "sglang_ext", "upstream")


def collect(contexts: Mapping[str, Any], adapters: Mapping[str, Sequence[types.ModuleType]], *,
            package: str = "sglang", upstream_root: str = UPSTREAM_ROOT) -> Dict[str, Any]:
    """Emission items of every PatchContext (in `contexts` order). Never raises for bad swaps:
    problems are listed in result["errors"]."""
    collector = _Collector(adapters, package, upstream_root)
    patches = {}
    for name, ctx in contexts.items():
        patches[name] = collector.collect(name, ctx.swaps)
    _share_adapter_classes(patches, collector)
    return {"patches": patches, "errors": collector.errors, "files": collector.files}


def _share_adapter_classes(patches: Mapping[str, List[Dict[str, Any]]], collector: _Collector) -> None:
    """One adapter class installed into several modules is one object in the plugin: define it once
    (in the module the others import from, else the first) and import it elsewhere."""
    homes: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    for items in patches.values():
        for item in items:
            if item["op"] == "def" and item["what"] == "class":
                homes.setdefault((item["src_file"], item["src_name"]), []).append(item)
    for users in homes.values():
        if len(users) < 2:
            continue
        modules = [u["module"] for u in users]

        def imported_by_others(module: str) -> bool:
            for other in users:
                if other["module"] != module:
                    tree = collector.tree(collector.files[other["module"]])
                    if not any(isinstance(n, ast.ImportFrom) and n.module == module for n in ast.walk(tree)):
                        return False
            return True

        home = next((m for m in modules if imported_by_others(m)), modules[0])
        for item in users:
            if item["module"] != home:
                for key in ("what", "src_file", "src_name", "src_line"):
                    item.pop(key)
                item["op"] = "import"
                item["stmt"] = f"from {home} import {item['name']}"


def _collect_main(out_path: str) -> int:
    """Child process: activate (strict, eager) and dump the emission items as JSON."""
    import sglang_ext
    from sglang_ext import activation
    from sglang_ext.registry import PATCHES

    result: Dict[str, Any] = {"errors": [], "patches": {}, "files": {}}
    try:
        statuses = activation.activate(eager=True)
    except BaseException as exc:  # noqa: BLE001 - report SglangExtActivationError too
        result["errors"].append(f"activation failed: {type(exc).__name__}: {exc}")
        statuses = {}
    else:
        adapters = {spec.name: [importlib.import_module(p.function.split(":")[0]) for p in spec.parts]
                    for spec in PATCHES}
        contexts = {name: ctx for name, ctx in activation._state.contexts.items()
                    if name not in PLUGIN_DELIVERY_ONLY and name not in NOT_EMITTABLE}
        result = collect(contexts, adapters)
        for spec in PATCHES:
            if spec.name in PLUGIN_DELIVERY_ONLY:
                continue
            st = statuses.get(spec.name)
            if st is None or st.state != "applied":
                result["errors"].append(f"{spec.name}: not applied on the installed sglang ({st})")
    import sglang

    result["sglang_file"] = sglang.__file__
    result["sglang_ext_file"] = sglang_ext.__file__
    result["statuses"] = {k: str(v) for k, v in statuses.items()}
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return 0


def run_collection(python: str) -> Dict[str, Any]:
    """Activate in a clean subprocess (only SGLANG_EXT, strict) and return its emission items."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SGLANG_EXT") and k not in ("PYTHONPATH", "EXT_TEST_TREE")}
    env.update({"SGLANG_EXT": "1", "SGLANG_EXT_STRICT": "1"})
    if PLUGIN_DELIVERY_ONLY:
        env["SGLANG_EXT_DISABLE"] = ",".join(PLUGIN_DELIVERY_ONLY)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "items.json")
        proc = subprocess.run([python, os.path.abspath(__file__), "--collect", out], env=env, cwd=REPO,
                              capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            raise GenerationError(f"collection subprocess failed (rc={proc.returncode}):\n"
                                  f"{proc.stderr.strip()[-4000:]}")
        with open(out, encoding="utf-8") as f:
            result = json.load(f)
    ext_file = os.path.abspath(result["sglang_ext_file"])
    if not ext_file.startswith(PYTHON_DIR + os.sep):
        raise GenerationError(f"{python} imports sglang_ext from {ext_file}, not from this checkout "
                              f"({PYTHON_DIR}); install it editable (pip install -e .)")
    return result


# ===========================================================================
# Emission: items -> patched file texts -> unified diffs
# ===========================================================================

def _docstring_positions(node: ast.AST) -> Set[Tuple[int, int]]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                out.add((first.value.lineno, first.value.col_offset))
    return out


def _string_interior_lines(text: str, docstrings: Set[Tuple[int, int]]) -> Set[int]:
    """1-based lines that continue a multi-line string (other than a docstring): their
    leading whitespace is part of the value, so re-indenting must not touch them."""
    keep: Set[int] = set()
    stack: List[Tuple[int, int]] = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        name = tokenize.tok_name[tok.type]
        if name == "FSTRING_START":
            stack.append(tok.start)
            continue
        if name == "FSTRING_END":
            start = stack.pop()
            end = tok.end
        elif tok.type == tokenize.STRING:
            start, end = tok.start, tok.end
        else:
            continue
        if end[0] > start[0] and start not in docstrings:
            keep.update(range(start[0] + 1, end[0] + 1))
    return keep


def _def_lines(lines: Sequence[str], node: ast.stmt, *, with_comments: bool = True) -> Tuple[int, int]:
    """1-based (first, last) lines of a def/class including decorators and the comment block above."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    if with_comments:
        while first > 1 and lines[first - 2].strip().startswith("#"):
            first -= 1
    return first, node.end_lineno


def _reindent(text: str, indent: str) -> str:
    tree = ast.parse(text)
    keep = _string_interior_lines(text, _docstring_positions(tree))
    out = []
    for i, line in enumerate(text.splitlines(keepends=True), start=1):
        if i in keep or not line.strip():
            out.append(line if line.strip() else "\n")
        else:
            out.append(indent + line)
    return "".join(out)


def _find_class(tree: ast.Module, qualname: str) -> Optional[ast.ClassDef]:
    body: Sequence[ast.stmt] = tree.body
    node = None
    for part in qualname.split("."):
        node = None
        for s in body:
            if isinstance(s, ast.ClassDef) and s.name == part:
                node = s
        if node is None:
            return None
        body = node.body
    return node


def _normalized_dump(node: ast.AST) -> str:
    import copy

    node = copy.deepcopy(node)
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                first.value.value = inspect.cleandoc(first.value.value)
    return ast.dump(node, include_attributes=False)


class _TextEdit:
    """Line-range replacements computed on one text, applied bottom-up."""

    def __init__(self, text: str):
        self.lines = text.splitlines(keepends=True)
        self.ops: List[Tuple[int, int, int, str]] = []  # (first, last, seq, new text); insertion: last = first-1

    def replace(self, first: int, last: int, new: str) -> None:
        self.ops.append((first, last, len(self.ops), new))

    def insert_after(self, line: int, new: str) -> None:
        self.replace(line + 1, line, new)

    def apply(self) -> str:
        ops = sorted(self.ops, key=lambda o: (o[0], o[2]))
        for a, b in zip(ops, ops[1:]):
            if b[0] <= a[1]:
                raise GenerationError(f"overlapping edits at lines {a[0]}-{a[1]} and {b[0]}-{b[1]}")
        lines = list(self.lines)
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        # insertions at the same point keep their order: apply from the last op backwards
        for first, last, _, new in sorted(ops, key=lambda o: (o[0], o[2]), reverse=True):
            lines[first - 1:last] = [new] if new else []
        return "".join(lines)


def rewrite_imports(text: str, path: str, package: str = "sglang", *, allow_relative: bool = True,
                    check_strings: bool = True) -> str:
    """Rewrite every `sglang_ext...` import of a source text for the patched tree.

    check_strings: refuse string constants naming sglang_ext modules (importlib-style uses
    would break silently); vendored sglang_ext modules skip it (their registry table is data).
    """
    tree = ast.parse(text, filename=path)
    edit = _TextEdit(text)
    lines = text.splitlines(keepends=True)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level and not allow_relative:
                raise GenerationError(f"{path}:{node.lineno}: relative import; upstream modules must import "
                                      "absolutely (their package differs between plugin and fork)")
            if node.level or not _is_ext(node.module):
                continue
            old_mod, new_mod = node.module, rewrite_module_name(node.module, package)
        elif isinstance(node, ast.Import):
            ext = [a for a in node.names if _is_ext(a.name)]
            if not ext:
                continue
            if len(node.names) != 1 or not node.names[0].asname:
                raise GenerationError(f"{path}:{node.lineno}: `import {node.names[0].name}` binds `sglang_ext`, "
                                      "which the patched tree renames; use `from ... import ...` or `as`")
            old_mod, new_mod = node.names[0].name, rewrite_module_name(node.names[0].name, package)
        else:
            continue
        segment = "".join(lines[node.lineno - 1:node.end_lineno])
        pattern = re.compile(r"(?<![\w.])" + re.escape(old_mod) + r"(?![\w])")
        new_segment, count = pattern.subn(new_mod, segment, count=1)
        if count != 1:
            raise GenerationError(f"{path}:{node.lineno}: cannot find {old_mod} in the import statement")
        edit.replace(node.lineno, node.end_lineno, new_segment)
    out = edit.apply() if edit.ops else text
    for node in ast.walk(ast.parse(out)) if check_strings else ():
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and re.fullmatch(r"sglang_ext(\.\w+)+(:\w+)?", node.value):
            raise GenerationError(f"{path}:{node.lineno}: string {node.value!r} names an sglang_ext module, "
                                  "which the patched tree renames")
    return out


def _ext_imports(text: str, path: str, module_name: str, is_package: bool) -> Set[str]:
    """sglang_ext modules a source imports (absolute and relative, at any depth)."""
    out: Set[str] = set()
    for node in ast.walk(ast.parse(text, filename=path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if _is_ext(a.name)}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module_name.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if _is_ext(mod):
                out.add(mod)
                out |= {f"{mod}.{a.name}" for a in node.names}  # submodules imported by name
    return out


def _ext_source_path(module: str) -> Optional[str]:
    base = os.path.join(PYTHON_DIR, *module.split("."))
    for cand in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(cand):
            return cand
    return None


@dataclass
class RenderedPatch:
    filename: str
    header: str
    body: str
    sources: List[str]  # files the patch is generated from (for Last-Update)

    @property
    def text(self) -> str:
        return self.header + "---\n" + self.body


def _unified(rel: str, old: Optional[str], new: str) -> str:
    a_lines = [] if old is None else old.splitlines(keepends=True)
    b_lines = new.splitlines(keepends=True)
    from_file = "/dev/null" if old is None else f"a/{rel}"
    diff = list(difflib.unified_diff(a_lines, b_lines, from_file, f"b/{rel}", n=3))
    if not diff:
        return ""
    head = f"diff --git a/{rel} b/{rel}\n" + ("new file mode 100644\n" if old is None else "")
    out = []
    for line in diff:
        out.append(line)
        if not line.endswith("\n"):
            out.append("\n\\ No newline at end of file\n")
    return head + "".join(out)


class SeriesRenderer:
    """Applies emission items patch by patch to texts of a pristine tree and renders the diffs."""

    def __init__(self, pristine_root: str, *, package: str = "sglang", path_prefix: str = "python/"):
        self.root = pristine_root
        self.package = package
        self.prefix = path_prefix
        self.current: Dict[str, Optional[str]] = {}  # rel -> text (None: absent in pristine)
        self.pristine: Dict[str, Optional[str]] = {}
        self.checks: List[Tuple[str, Dict[str, Any]]] = []  # (rel, item) verified at the end
        self.ext_modules: Set[str] = set()

    def text(self, rel: str) -> Optional[str]:
        if rel not in self.current:
            path = os.path.join(self.root, rel)
            self.current[rel] = _read(path) if os.path.exists(path) else None
            self.pristine[rel] = self.current[rel]
        return self.current[rel]

    def render(self, items: Sequence[Dict[str, Any]]) -> Tuple[str, List[str]]:
        """Apply one patch's items; return (diff body, source files used)."""
        before = {}
        sources: List[str] = []
        by_file: Dict[str, List[Dict[str, Any]]] = {}
        for item in items:
            by_file.setdefault(item["file"], []).append(item)
            if "src_file" in item:
                sources.append(item["src_file"])
        for rel, file_items in list(by_file.items()):
            if rel in before:
                continue  # a package __init__ added for a new module
            old = self.text(rel)
            before[rel] = old
            new_modules = [i for i in file_items if i["op"] in ("new_module", "module_alias")]
            if new_modules:
                item = new_modules[0]
                if len(file_items) != 1 or (old is not None and item["op"] == "new_module"):
                    raise GenerationError(f"{rel}: install_module of a module the tree already has")
                self.current[rel] = (self._new_module(item) if item["op"] == "new_module"
                                     else _alias_module(item["module"], item["of"]))
                for init in self._missing_packages(rel):
                    by_file.setdefault(init, [])
                    before[init] = None
                    self.current[init] = ('"""Package added by sglang-ext for '
                                          f'`{os.path.dirname(init).replace("/", ".")}` '
                                          '(generated by scripts/gen_patches.py)."""\n')
            else:
                if old is None:
                    raise GenerationError(f"{rel}: not in the pristine tree {self.root}")
                self.current[rel] = self._edit_module(rel, old, file_items)
            for item in file_items:
                self.checks.append((rel, item))
        body = "".join(_unified(self.prefix + rel, before[rel], self.current[rel]) for rel in sorted(by_file))
        return body, sorted(set(sources))

    def _missing_packages(self, rel: str) -> List[str]:
        """__init__.py files for the new module's parent directories that the tree lacks entirely.
        A directory that exists without __init__.py is a namespace package and stays one."""
        out = []
        parts = rel.split("/")[:-1]
        for i in range(2, len(parts) + 1):
            directory = "/".join(parts[:i])
            init = directory + "/__init__.py"
            if not os.path.isdir(os.path.join(self.root, directory)) and self.text(init) is None:
                out.append(init)
        return out

    def _new_module(self, item: Dict[str, Any]) -> str:
        text = _read(item["src_file"])
        src_rel = (os.path.relpath(item["src_file"], PYTHON_DIR).replace(os.sep, "/")
                   if item["src_file"].startswith(PYTHON_DIR + os.sep) else os.path.basename(item["src_file"]))
        self.ext_modules |= _ext_imports(text, item["src_file"], item["module"], False)
        body = rewrite_imports(text, item["src_file"], self.package, allow_relative=False)
        return (f"# Backported by sglang-ext (generated from {src_rel} by scripts/gen_patches.py).\n" + body)

    def _source_block(self, item: Dict[str, Any]) -> Tuple[str, ast.stmt]:
        text = _read(item["src_file"])
        tree = ast.parse(text)
        lines = text.splitlines(keepends=True)
        if item["op"] == "constant":
            node = _top_level_assign(tree, item["name"])
            first, last = item["src_line"], item["src_end_line"]
            while first > 1 and lines[first - 2].strip().startswith("#"):
                first -= 1
        else:
            node = _top_level_def(tree, item["src_name"])
            if node is None or node.lineno != item["src_line"]:
                raise GenerationError(f"{item['src_file']}: {item['src_name']} moved since collection")
            first, last = _def_lines(lines, node)
            if item["name"] != item["src_name"]:  # a def installed under another name
                def_line = node.lineno - 1
                renamed, count = re.subn(rf"\bdef\s+{re.escape(item['src_name'])}\b", f"def {item['name']}",
                                         lines[def_line], count=1)
                if count != 1:
                    raise GenerationError(f"{item['src_file']}:{node.lineno}: cannot rename {item['src_name']}")
                lines = lines[:def_line] + [renamed] + lines[def_line + 1:]
        block = "".join(lines[first - 1:last])
        if not block.endswith("\n"):
            block += "\n"
        return block, node

    def _edit_module(self, rel: str, text: str, items: Sequence[Dict[str, Any]]) -> str:
        tree = ast.parse(text)
        lines = text.splitlines(keepends=True)
        edit = _TextEdit(text)
        # 1. imports, after the module's import block
        stmts = []
        for item in items:
            if item["op"] == "import":
                stmt = item["stmt"]
                m = re.match(r"(from|import) ([\w.]+)", stmt)
                if _is_ext(m.group(2)):
                    self.ext_modules.add(m.group(2))
                    if m.group(1) == "from":
                        self.ext_modules.add(m.group(2) + "." + stmt.split(" import ")[1].split(" as ")[0])
                stmts.append(rewrite_imports(stmt + "\n", rel, self.package))
        if stmts:
            edit.insert_after(_import_block_end(tree), _import_lines(stmts))
        # 2. class members
        by_class: Dict[str, List[Dict[str, Any]]] = {}
        for item in items:
            if item["op"] in ("method", "class_alias", "class_constant"):
                by_class.setdefault(item["cls"], []).append(item)
        for qualname, class_items in by_class.items():
            self._edit_class(rel, tree, lines, edit, qualname, class_items)
        # 3. module-level definitions: in place, or at the end in adapter order
        end_blocks: List[Tuple[Tuple[str, int], str]] = []
        for item in items:
            if item["op"] not in ("def", "constant"):
                continue
            block, node = self._source_block(item)
            existing = (_top_level_def(tree, item["name"]) if item["op"] == "def"
                        else _top_level_assign(tree, item["name"]))
            if existing is not None:
                first, last = (_def_lines(lines, existing, with_comments=False) if item["op"] == "def"
                               else (existing.lineno, existing.end_lineno))
                edit.replace(first, last, block)
            else:
                end_blocks.append(((item["src_file"], item["src_line"]), block))
        tail = [block for _, block in sorted(end_blocks)]
        # statements that run after every class is created, in the order the plugin ran them
        after: List[str] = []
        for i in items:
            if i["op"] == "dict_item":
                after.append(f"{i['dict']}[{i['key_repr']}] = {i['value']}\n")
            elif i["op"] == "post_alias":
                after.append(f"{i['cls']}.{i['name']} = {i['cls']}.{i['of']}\n")
            elif i["op"] == "post_constant":
                after.append(f"{i['cls']}.{i['name']} = {i['value_repr']}\n")
            elif i["op"] == "post_method":
                block, _ = self._source_block(i)
                value = f"{i['decorator']}({i['name']})" if i["decorator"] else i["name"]
                after.append(f"\n{block}\n\n{i['cls']}.{i['name']} = {value}\ndel {i['name']}\n\n")
        if after:
            tail.append("".join(after).strip("\n") + "\n")
        if tail:
            edit.insert_after(len(lines), "\n\n" + "\n\n".join(tail))
        return edit.apply()

    def _edit_class(self, rel, tree, lines, edit, qualname, items) -> None:
        node = _find_class(tree, qualname)
        if node is None:
            raise GenerationError(f"{rel}: class {qualname} not found")
        indent = " " * node.body[0].col_offset
        defs = {s.name: s for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
        counts: Dict[str, int] = {}
        for s in node.body:
            for n in _class_body_names(s):
                counts[n] = counts.get(n, 0) + 1
        aliases = {i["of"]: i for i in items if i["op"] == "class_alias"}
        appended: List[str] = []
        handled_alias: Set[str] = set()
        for item in items:
            name = item["name"]
            if item["op"] == "method":
                block, _ = self._source_block(item)
                if item["decorator"]:
                    block = f"@{item['decorator']}\n" + block
                new = _reindent(block, indent)
                if counts.get(name, 0) > 1:
                    raise GenerationError(f"{rel}: {qualname}.{name} is bound more than once in the class body "
                                          "(property setter?); cannot replace it")
                if name in defs:
                    first, last = _def_lines(lines, defs[name], with_comments=False)
                    if name in aliases:  # keep the original, alias it, then the new def
                        handled_alias.add(name)
                        old = "".join(lines[first - 1:last])
                        new = old + f"\n{indent}{aliases[name]['name']} = {name}\n\n" + new
                    edit.replace(first, last, new)
                elif counts.get(name):
                    raise GenerationError(f"{rel}: {qualname}.{name} is not a def in the class body; cannot "
                                          "replace it")
                else:
                    appended.append(new)
            elif item["op"] == "class_constant":
                if counts.get(name):
                    raise GenerationError(f"{rel}: {qualname}.{name} exists; replacing class attributes with "
                                          "ctx.setattr is not supported")
                appended.append(f"{indent}{name} = {item['value_repr']}\n")
        for of, item in aliases.items():
            if of in handled_alias:
                continue
            if of not in defs:
                raise GenerationError(f"{rel}: {qualname}.{item['name']} aliases {of}, which is not a def in "
                                      "the class body")
            edit.insert_after(defs[of].end_lineno, f"\n{indent}{item['name']} = {of}\n")
        if appended:
            edit.insert_after(node.end_lineno, "".join("\n" + a for a in appended))

    def verify(self) -> None:
        """Each emitted definition's AST in the patched file equals the adapter's."""
        for rel, item in self.checks:
            text = self.current[rel]
            tree = ast.parse(text)
            if item["op"] in ("method", "def", "post_method"):
                owner = _find_class(tree, item["cls"]) if item["op"] == "method" else tree
                matches = [s for s in owner.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                   ast.ClassDef)) and s.name == item["name"]]
                if not matches:
                    raise GenerationError(f"{rel}: emitted {item['name']} not found")
                emitted = matches[-1]
                src_node = _top_level_def(ast.parse(_read(item["src_file"])), item["src_name"])
                src_node.name = item["name"]
                if item.get("decorator"):
                    emitted.decorator_list = [d for d in emitted.decorator_list
                                              if not (isinstance(d, ast.Name) and d.id == item["decorator"])]
                if _normalized_dump(emitted) != _normalized_dump(src_node):
                    raise GenerationError(f"{rel}: emitted {item['name']} differs from {item['src_file']} "
                                          "(generator bug)")


def _import_lines(stmts: Iterable[str]) -> str:
    """`import x` lines first, then one `from m import a, b` per module; sorted."""
    plain, names = set(), {}
    for stmt in stmts:
        m = re.fullmatch(r"from ([\w.]+) import (\w+(?: as \w+)?)\n?", stmt)
        if m:
            names.setdefault(m.group(1), set()).add(m.group(2))
        else:
            plain.add(stmt.rstrip("\n") + "\n")
    out = sorted(plain)
    for module in sorted(names):
        line = f"from {module} import {', '.join(sorted(names[module]))}\n"
        if len(line) > 100:
            line = f"from {module} import (\n" + "".join(f"    {n},\n" for n in sorted(names[module])) + ")\n"
        out.append(line)
    return "".join(out)


def _identifiers(node: ast.AST) -> Set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
    return out


def _is_dataclass_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return (isinstance(target, ast.Name) and target.id == "dataclass") or \
        (isinstance(target, ast.Attribute) and target.attr == "dataclass")


def _alias_module(name: str, of: str) -> str:
    return (f'"""`{name}` is `{of}` under another name (generated by scripts/gen_patches.py).\n\n'
            'The runtime plugin registers the same module object under both names; this file does the\n'
            'same, so both import paths give one module."""\n\n'
            "import importlib\n"
            "import sys\n\n"
            f'sys.modules[__name__] = importlib.import_module("{of}")\n')


def _class_body_names(stmt: ast.stmt) -> List[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        return [t.id for t in stmt.targets if isinstance(t, ast.Name)]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    return []


def _import_block_end(tree: ast.Module) -> int:
    end = 0
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        end = body[0].end_lineno
    for s in body:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            break
        if isinstance(s, (ast.Import, ast.ImportFrom)):
            end = s.end_lineno
    return end


# ===========================================================================
# Headers, series, matrix
# ===========================================================================

def _package_version() -> str:
    m = re.search(r'version="([^"]+)"', _read(os.path.join(REPO, "setup.py")))
    return m.group(1) if m else "unknown"


def last_update(paths: Sequence[str]) -> str:
    """Date (UTC) of the last commit touching `paths`; today when one of them has uncommitted changes."""
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    rels = [os.path.relpath(p, REPO) for p in paths]
    if not rels:
        return today
    try:
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *rels], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout.strip()
        if dirty:
            return today
        out = subprocess.run(["git", "log", "-1", "--format=%cd", "--date=format-local:%Y-%m-%d", "--", *rels],
                             cwd=REPO, capture_output=True, text=True, check=True,
                             env={**os.environ, "TZ": "UTC"}).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return today
    return out or today


def _pr_url(pr: str) -> Optional[str]:
    m = re.fullmatch(r"([\w.-]+/[\w.-]+)#(\d+)", pr.strip())
    return f"https://github.com/{m.group(1)}/pull/{m.group(2)}" if m else None


def patch_filename(name: str) -> str:
    return name.replace("_", "-") + ".patch"


def _header(fields: Sequence[Tuple[str, str]]) -> str:
    out = []
    for key, value in fields:
        lines = value.split("\n")
        out.append(f"{key}: {lines[0]}\n")
        out.extend(f" {line}\n" if line else " .\n" for line in lines[1:])
    return "".join(out)


def spec_header(spec: Any, items: Sequence[Dict[str, Any]], sources: Sequence[str], version: str) -> str:
    changed = []
    for i in items:
        if i["op"] in ("method", "class_alias", "class_constant", "post_method", "post_alias", "post_constant"):
            changed.append(f"{i['module']}.{i['cls']}.{i['name']}")
        elif i["op"] == "new_module":
            changed.append(f"{i['module']} (new module)")
        elif i["op"] == "module_alias":
            changed.append(f"{i['module']} (alias of {i['of']})")
        elif i["op"] == "dict_item":
            changed.append(f"{i['module']}.{i['dict']}[{i['key_repr']}]")
        elif i["op"] != "import":
            changed.append(f"{i['module']}.{i['name']}")
    url = _pr_url(spec.upstream_pr)
    desc = [spec.summary,
            (f"sglang-ext change for sglang {version} (no upstream PR), generated by scripts/gen_patches.py"
             if spec.upstream_pr.startswith("none") else
             f"Port of {spec.upstream_pr} to sglang {version}, generated by scripts/gen_patches.py"),
            f"from the sglang-ext runtime patch {spec.name!r}; edit the adapter, not this file.",
            "",
            "Changes:"]
    desc += [f"- {c}" for c in sorted(dict.fromkeys(changed))]
    desc += ["Retire when: " + spec.retire_when]
    if spec.upstream_since and not spec.upstream_equivalent:
        desc.append(f"Upstream {spec.upstream_since} has its own, different version of this change.")
    adapters = sorted({p.function.split(":")[0] for p in spec.parts})
    fields = [("Description", "\n".join(desc)),
              ("Author", "sglang-ext maintainers"),
              ("Origin", f"vendor, sglang-ext {_package_version()}"),
              ("Forwarded", "not-needed" if spec.upstream_equivalent else "no")]
    if spec.upstream_since:
        fields.append(("Applied-Upstream", spec.upstream_since + (f", {url}" if url else "")))
    fields += [("Last-Update", last_update(sources)),
               ("X-Runtime-Patch", f"{spec.name} ({', '.join(adapters)})")]
    return _header(fields)


def core_header(modules: Sequence[str], sources: Sequence[str], package: str) -> str:
    desc = ["Vendor the sglang-ext core modules the following patches import",
            "Generated by scripts/gen_patches.py: " + ", ".join(
                f"{m} -> {rewrite_module_name(m, package)}" for m in modules)]
    fields = [("Description", "\n".join(desc)),
              ("Author", "sglang-ext maintainers"),
              ("Origin", f"vendor, sglang-ext {_package_version()}"),
              ("Forwarded", "not-needed"),
              ("Last-Update", last_update(sources)),
              ("X-Runtime-Patch", "none (support code for the patches that follow in series)")]
    return _header(fields)


def _vendor_closure(roots: Iterable[str]) -> List[str]:
    """sglang_ext modules to vendor: `roots`, their parent packages and everything they import."""
    todo = [m for m in roots if not m.startswith("sglang_ext.upstream")]
    seen: Set[str] = set()
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        path = _ext_source_path(mod)
        if path is None:
            continue  # a name imported from a module, not a submodule
        if mod.split(".")[1:2] in (["adapters"], ["activation"], ["patching"], ["plugin"]):
            raise GenerationError(f"emitted code imports {mod}: the patched tree has no activation; import "
                                  "only sglang-free core modules (sglang_ext.graphs, knobs, errors)")
        seen.add(mod)
        parts = mod.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += [m for m in _ext_imports(_read(path), path, mod, path.endswith("__init__.py"))
                 if not m.startswith("sglang_ext.upstream")]
    return sorted(seen)


def render_core(modules: Sequence[str], package: str, prefix: str) -> Tuple[str, List[str]]:
    body = []
    sources = []
    for mod in modules:
        path = _ext_source_path(mod)
        sources.append(path)
        rel_src = os.path.relpath(path, PYTHON_DIR).replace(os.sep, "/")
        new_rel = "/".join(rewrite_module_name(mod, package).split("."))
        new_rel += "/__init__.py" if path.endswith("__init__.py") else ".py"
        text = (f"# Vendored from sglang-ext {rel_src} by scripts/gen_patches.py; edit the original.\n"
                + rewrite_imports(_read(path), path, package, check_strings=False))
        body.append((new_rel, text))
    return "".join(_unified(prefix + rel, None, text) for rel, text in sorted(body)), sources


def render_series(collected: Mapping[str, Any], specs: Sequence[Any], *, pristine_root: str,
                  package: str = "sglang", version: str = SERIES_VERSION, path_prefix: str = "python/"
                  ) -> Dict[str, str]:
    """{file name: content} of the series directory (series + patches)."""
    if collected.get("errors"):
        raise GenerationError("cannot generate the series faithfully:\n  " + "\n  ".join(collected["errors"]))
    renderer = SeriesRenderer(pristine_root, package=package, path_prefix=path_prefix)
    patches: List[RenderedPatch] = []
    for spec in specs:
        if spec.name in PLUGIN_DELIVERY_ONLY or spec.name in NOT_EMITTABLE:
            continue
        items = collected["patches"].get(spec.name)
        if items is None:
            raise GenerationError(f"{spec.name}: no swaps were recorded (patch not applied?)")
        if not items:
            raise GenerationError(f"{spec.name}: every swap is a no-op in a patched tree; nothing to emit")
        body, sources = renderer.render(items)
        header = spec_header(spec, items, sources, version)
        patches.append(RenderedPatch(patch_filename(spec.name), header, body, sources))
    renderer.verify()
    modules = _vendor_closure(renderer.ext_modules)
    out: Dict[str, str] = {}
    series = [f"# sglang-version: {version}",
              "# Generated by scripts/gen_patches.py from the sglang-ext runtime patches; do not edit.",
              "# Apply: scripts/apply_patches.sh TREE, or quilt push -a / git apply -p1 in an sglang checkout."]
    if modules:
        body, sources = render_core(modules, package, path_prefix)
        core = RenderedPatch(CORE_PATCH, core_header(modules, sources, package), body, sources)
        patches.insert(0, core)
    for p in patches:
        out[p.filename] = p.text
        series.append(p.filename)
    out["series"] = "\n".join(series) + "\n"
    return out


def matrix(specs: Sequence[Any], files: Mapping[str, str]) -> str:
    from sglang_ext.versions import at_least

    head = "| patch | " + " | ".join(MATRIX_VERSIONS) + " |"
    rows = [head, "|" + "---|" * (len(MATRIX_VERSIONS) + 1)]
    for spec in specs:
        cells = []
        for v in MATRIX_VERSIONS:
            if spec.name in PLUGIN_DELIVERY_ONLY:
                cell = "plugin only" if v == SERIES_VERSION else "–"
            elif spec.name in NOT_EMITTABLE and v == SERIES_VERSION:
                cell = "**not in series** (plugin only)"
            elif v == SERIES_VERSION:
                fname = patch_filename(spec.name)
                cell = f"`{fname}`" if fname in files else "**missing**"
            elif spec.upstream_since and at_least(v, spec.upstream_since):
                cell = "upstream" if spec.upstream_equivalent else "upstream (differs)"
            else:
                cell = "not upstream"
            cells.append(cell)
        rows.append(f"| `{spec.name}` | " + " | ".join(cells) + " |")
    notes = [f"- `{n}`: {why}." for n, why in {**PLUGIN_DELIVERY_ONLY, **NOT_EMITTABLE}.items()
             if any(s.name == n for s in specs)]
    return "\n".join(rows) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


def readme_text(current: str, table: str) -> str:
    if MATRIX_BEGIN not in current or MATRIX_END not in current:
        raise GenerationError(f"a README lacks the generated-matrix markers {MATRIX_BEGIN!r} / {MATRIX_END!r}")
    before, rest = current.split(MATRIX_BEGIN, 1)
    _, after = rest.split(MATRIX_END, 1)
    return before + MATRIX_BEGIN + "\n" + table + MATRIX_END + after


# ===========================================================================
# Check / write
# ===========================================================================

_VOLATILE = re.compile(r"^Last-Update: \d{4}-\d{2}-\d{2}$", re.M)


def _stable(text: str) -> str:
    return _VOLATILE.sub("Last-Update: <date>", text)


def compare(expected: Mapping[str, str], patch_dir: str) -> List[str]:
    """Problems that make `patch_dir` differ from `expected` (Last-Update dates are not compared)."""
    problems = []
    present = set(os.listdir(patch_dir)) if os.path.isdir(patch_dir) else set()
    for name in sorted(set(expected) | present):
        path = os.path.join(patch_dir, name)
        if name not in expected:
            problems.append(f"{name}: is not generated any more")
            continue
        if name not in present:
            problems.append(f"{name}: missing")
            continue
        have = _read(path)
        if _stable(have) != _stable(expected[name]):
            diff = list(difflib.unified_diff(_stable(have).splitlines(), _stable(expected[name]).splitlines(),
                                             f"committed/{name}", f"generated/{name}", n=1, lineterm=""))
            shown = "\n".join("    " + d for d in diff[:30])
            problems.append(f"{name}: differs from what would be generated\n{shown}")
    return problems


def stale_message(problems: Sequence[str], patch_dir: str) -> str:
    return (f"{os.path.relpath(patch_dir, REPO)} is stale (it must match the plugin's source):\n  "
            + "\n  ".join(problems) + f"\nRegenerate with: {REGENERATE}")


def write(expected: Mapping[str, str], patch_dir: str) -> None:
    os.makedirs(patch_dir, exist_ok=True)
    for name in os.listdir(patch_dir):
        if name not in expected and (name.endswith(".patch") or name == "series"):
            os.remove(os.path.join(patch_dir, name))
    for name, text in expected.items():
        path = os.path.join(patch_dir, name)
        if os.path.exists(path) and _stable(_read(path)) == _stable(text):
            continue  # keep the committed Last-Update when nothing else changed
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def default_python() -> str:
    """This interpreter when sglang is installed in it (CI's venv, whatever its path), else .venv."""
    import importlib.metadata

    try:
        importlib.metadata.version("sglang")
        return sys.executable
    except importlib.metadata.PackageNotFoundError:
        venv = os.path.join(REPO, ".venv", "bin", "python")
        return venv if os.path.exists(venv) else sys.executable


def check_pristine(collected: Mapping[str, Any], pristine_root: str) -> None:
    """The installed sglang the plugin was applied to must be the pristine tree we diff against."""
    base = os.path.dirname(os.path.dirname(os.path.abspath(collected["sglang_file"])))
    for module, path in sorted(collected.get("files", {}).items()):
        rel = os.path.relpath(path, base)
        pristine = os.path.join(pristine_root, rel)
        if not os.path.exists(pristine) or _read(pristine) != _read(path):
            raise GenerationError(f"installed {module} ({path}) differs from the pristine sglang {SERIES_VERSION} "
                                  f"tree ({pristine}); reinstall sglang=={SERIES_VERSION} in the venv")


_GENERATED: Dict[Tuple[Optional[str], Optional[str]], Dict[str, str]] = {}


def generate(python: Optional[str] = None, sglang_tree: Optional[str] = None, *, reuse: bool = False
             ) -> Dict[str, str]:
    """Everything gen_patches writes: {path relative to REPO: content}.

    reuse: return this process's earlier result for the same arguments (tests run --check
    several times; one activation subprocess is enough)."""
    if reuse and (python, sglang_tree) in _GENERATED:
        return dict(_GENERATED[(python, sglang_tree)])
    out = _generate(python, sglang_tree)
    _GENERATED[(python, sglang_tree)] = dict(out)
    return out


def _generate(python: Optional[str], sglang_tree: Optional[str]) -> Dict[str, str]:
    from sglang_ext.registry import PATCHES
    from sglang_ext import wheels

    root = sglang_tree or wheels.ensure_unpacked(SERIES_VERSION)
    if os.path.isdir(os.path.join(root, "python", "sglang")):
        root = os.path.join(root, "python")  # an sglang checkout
    if not os.path.isdir(os.path.join(root, "sglang")):
        raise GenerationError(f"{root} holds no sglang/ package")
    from sglang_ext.versions import source_tree_version

    tree_version = source_tree_version(root)
    if tree_version is not None and tree_version.split("+")[0] != SERIES_VERSION:
        raise GenerationError(f"{root} is sglang {tree_version}; the series is generated against a pristine "
                              f"sglang {SERIES_VERSION} tree")
    collected = run_collection(python or default_python())
    if collected.get("errors"):
        raise GenerationError("cannot generate the series faithfully:\n  " + "\n  ".join(collected["errors"]))
    check_pristine(collected, root)
    files = render_series(collected, PATCHES, pristine_root=root)
    out = {os.path.join(os.path.relpath(PATCH_DIR, REPO), name): text for name, text in files.items()}
    table = matrix(PATCHES, files)
    for readme in (README, TOP_README):
        out[os.path.relpath(readme, REPO)] = readme_text(_read(readme), table)
    return out


def main(argv: Optional[Sequence[str]] = None, *, reuse: bool = False) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed series is stale")
    parser.add_argument("--sglang-tree", help="pristine sglang 0.5.17 tree (unpacked wheel or checkout); "
                                              "default: the cached wheel (~/.cache/sglang-ext/wheels)")
    parser.add_argument("--python", help="interpreter with pristine sglang 0.5.17 and sglang-ext installed "
                                         "(default: this one if it has sglang, else .venv/bin/python)")
    parser.add_argument("--patch-dir", default=PATCH_DIR, help=argparse.SUPPRESS)  # tests: a copy to check
    parser.add_argument("--collect", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.collect:
        return _collect_main(args.collect)
    try:
        generated = generate(args.python, args.sglang_tree, reuse=reuse)
    except GenerationError as exc:
        print(f"gen_patches: {exc}", file=sys.stderr)
        return 2
    series_rel = os.path.relpath(PATCH_DIR, REPO)
    series = {os.path.basename(k): v for k, v in generated.items() if os.path.dirname(k) == series_rel}
    readmes = {os.path.relpath(r, REPO): r for r in (README, TOP_README)}
    if args.check:
        problems = compare(series, args.patch_dir)
        for rel, path in readmes.items():
            if _read(path) != generated[rel]:
                problems.append(f"{rel}: the patch x version matrix is out of date")
        if problems:
            print(stale_message(problems, args.patch_dir), file=sys.stderr)
            return 1
        print(f"{series_rel}: up to date ({len(series) - 1} patches)")
        return 0
    write(series, args.patch_dir)
    for rel, path in readmes.items():
        with open(path, "w", encoding="utf-8") as f:
            f.write(generated[rel])
    print(f"wrote {series_rel} ({len(series) - 1} patches) and the matrix in {', '.join(readmes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
