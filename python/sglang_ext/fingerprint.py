"""Fingerprints of sglang definitions: sha256 of `ast.dump` of one definition (formatting, comments and
docstrings ignored; sources parsed, never imported). scripts/gen_fingerprints.py writes the reference tables.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
from functools import lru_cache
from typing import Dict, Iterable, Optional

from sglang_ext.versions import version_key

_TABLE_DIR = os.path.join(os.path.dirname(__file__), "fingerprints")


def module_source_path(module: str, source_root: Optional[str] = None) -> Optional[str]:
    """Path of a module's .py file, without importing it (parents are not imported either)."""
    if source_root is not None:
        base = os.path.join(source_root, *module.split("."))
        return next((p for p in (base + ".py", os.path.join(base, "__init__.py")) if os.path.exists(p)), None)
    top = module.split(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    return module_source_path(module, os.path.dirname(list(spec.submodule_search_locations)[0]))


def _find_definition(tree: ast.Module, qualname: str) -> Optional[ast.AST]:
    body: Iterable[ast.stmt] = tree.body
    node: Optional[ast.AST] = None
    for part in qualname.split("."):
        node = None
        for stmt in body:
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == part:
                node = stmt
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    node = stmt
        if node is None:
            return None
        body = getattr(node, "body", [])
    return node


def _canonical(node: object) -> str:
    """`ast.dump`-like text that is the same on every Python version (empty fields and docstrings dropped)."""
    if isinstance(node, ast.AST):
        fields = []
        for name, value in ast.iter_fields(node):
            if (name == "body" and isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))
                    and value and isinstance(value[0], ast.Expr) and isinstance(value[0].value, ast.Constant)
                    and isinstance(value[0].value.value, str)):
                value = value[1:]  # the docstring
            if value is None or value == []:
                continue
            fields.append(f"{name}={_canonical(value)}")
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return "[" + ", ".join(_canonical(v) for v in node) + "]"
    return repr(node)


def digest(node: ast.AST) -> str:
    return hashlib.sha256(_canonical(node).encode()).hexdigest()[:16]


@lru_cache(maxsize=None)
def _parse(path: str) -> ast.Module:
    with open(path, "r", encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def fingerprint(module: str, qualname: str, source_root: Optional[str] = None) -> Optional[str]:
    """Fingerprint of `module:qualname` in the installed (or given) sglang; None if absent."""
    path = module_source_path(module, source_root)
    node = _find_definition(_parse(path), qualname) if path is not None else None
    return None if node is None else digest(node)


def fingerprint_key(key: str, source_root: Optional[str] = None) -> Optional[str]:
    module, qualname = key.split(":")
    return fingerprint(module, qualname, source_root)


def reference_table(version: str) -> Dict[str, Optional[str]]:
    """Recorded fingerprints of one sglang release ({"module:qualname": hash|None})."""
    path = os.path.join(_TABLE_DIR, f"sglang-{version}.json")
    if not os.path.exists(path):
        return {}
    with open(path, "r", encoding="utf-8") as f:
        return json.load(f)["fingerprints"]


def recorded_versions() -> list[str]:
    names = [n[len("sglang-"):-len(".json")] for n in os.listdir(_TABLE_DIR) if n.endswith(".json")]
    return sorted(names, key=version_key)
