"""Every adapter module opens with a short header that agrees with its registry entry.

The registry (`sglang_ext.registry.PATCHES`) is the one source of patch metadata; a header
names its patch and repeats the target symbols, upstream PR and retire-when condition for the
reader, and this test keeps the two from drifting. Headers are read from source (no import).
"""

from __future__ import annotations

import ast
import os
import re

import pytest

from sglang.test.ci.ci_register import register_cpu_ci

from sglang_ext.registry import PATCHES

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

PACKAGE_ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "python")
FIELDS = ("Patch", "Targets", "Upstream PR", "Retire when", "Why", "How")
MAX_HEADER_LINES = 40
_FIELD_LINE = re.compile(r"^(%s):\s*(.*)$" % "|".join(re.escape(f) for f in FIELDS))


def header_fields(doc: str) -> dict:
    """Field -> its text (continuation lines joined) from a module docstring."""
    fields, current = {}, None
    for line in doc.splitlines()[1:]:
        match = _FIELD_LINE.match(line)
        if match:
            current = match.group(1)
            fields[current] = match.group(2).strip()
        elif current and line.strip():
            fields[current] += " " + line.strip()
        else:
            current = None
    return fields


def part_modules():
    """(adapter module, its PatchSpec) for every module a registry part names."""
    seen = {}
    for spec in PATCHES:
        for part in spec.parts:
            seen.setdefault(part.function.split(":")[0], spec)
    return sorted(seen.items())


@pytest.mark.parametrize("module,spec", part_modules(), ids=[m for m, _ in part_modules()])
def test_header_agrees_with_the_registry(module, spec):
    path = os.path.join(PACKAGE_ROOT, *module.split(".")) + ".py"
    with open(path, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    assert doc, f"{module}: no module docstring"
    assert len(doc.splitlines()) <= MAX_HEADER_LINES, f"{module}: header over {MAX_HEADER_LINES} lines"
    fields = header_fields(doc)
    missing = [f for f in FIELDS if not fields.get(f)]
    assert not missing, f"{module}: header lacks {', '.join(missing)}"
    assert fields["Patch"] == spec.name
    assert fields["Upstream PR"] == spec.upstream_pr
    assert fields["Retire when"] == " ".join(spec.retire_when.split())
    # dotted names: a fingerprinted target, or a name of a target's module (a module global it rebinds)
    names = {t.key.replace(":", ".") for t in spec.targets} | {t.module for t in spec.targets}
    for target in (t.strip() for t in fields["Targets"].split(",")):
        dotted = target.replace(":", ".")
        assert any(dotted == name or dotted.startswith(name + ".") for name in names), (
            f"{module}: target {target} is not among patch {spec.name}'s registry targets or in their modules")


def test_every_patch_has_an_adapter_module_with_a_header():
    assert {spec.name for _, spec in part_modules()} == {spec.name for spec in PATCHES}
