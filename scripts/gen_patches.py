#!/usr/bin/env python3
"""Generate the fork patch series `patches/sglang-<release>/` (one per supported release) from the plugin itself.

The fork carries the plugin rather than re-telling it. The series vendors, as `sglang/ext/`,
every sglang_ext module that activation can reach: `sglang_ext.activation`, the adapter
modules the registry names, and whatever those import (found statically, module-name
strings included). `sglang_ext` is renamed `sglang.ext` in them. The series also adds a few
lines to `sglang.srt.plugins.load_plugins()` that activate that copy:

    sglang-ext-core.patch    vendored modules that no registry part names (activation, graphs, ...)
    <entry>.patch            the adapter modules that registry entry's parts name
    sglang-ext-hook.patch    load_plugins() first calls sglang.ext.activation.activate(force=True)

`load_plugins()` runs in the processes where sglang loads plugins. The vendored
`mg_worker_activation` patch reaches the spawned multimodal_gen workers, as the plugin does.
A patched tree therefore runs the same adapters, fingerprint gate, knobs, strict mode and
rollback in the same processes. It is always on: `SGLANG_EXT_DISABLE` turns patches off. An
installed plugin stands aside on such a tree (`sglang_ext.activation.activate`), so nothing
is patched twice.

Why this design: the generator reads files, imports no sglang, runs in about a second, and is
generic (a new kind of adapter code needs no generator code): after an adapter change, re-run
it. The patched-tree suite tests the adapters themselves, vendored. The price: a reader of the
series sees the adapters and their runtime swaps, not edited sglang functions.

    python scripts/gen_patches.py            # rewrite every series and the matrix in patches/README.md
    python scripts/gen_patches.py --check    # exit 1 when any of them is stale
    python scripts/gen_patches.py --release 0.5.23 [--check]   # one series

Patch paths are `a/python/sglang/...` (an sglang checkout: `git apply -p1`, quilt).
`scripts/apply_patches.sh` checks the version first, and also applies the series to an
unpacked wheel or a site-packages copy (`-p2`).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import re
import sys
from typing import Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PYTHON_DIR = os.path.join(REPO, "python")

from sglang_ext.versions import SUPPORTED_SGLANG  # noqa: E402

SERIES_VERSIONS = SUPPORTED_SGLANG  # one series per supported release; _select() makes one current
SERIES_VERSION = SERIES_VERSIONS[0]
PATCH_DIR = os.path.join(REPO, "patches", f"sglang-{SERIES_VERSION}")
READMES = (os.path.join(REPO, "patches", "README.md"),)
REGENERATE = "python scripts/gen_patches.py && git add patches/"
PACKAGE, VENDORED_AS = "sglang_ext", "sglang.ext"
ROOTS = ("sglang_ext.activation",)  # plus the adapter modules the registry names
TEST_ONLY = ("sglang_ext_testkit",)  # never vendored: importing it from shipped code is an error
DATA = (f"sglang_ext/fingerprints/sglang-{SERIES_VERSION}.json",)  # read by the vendored fingerprint.py
CORE_PATCH, HOOK_PATCH = "sglang-ext-core.patch", "sglang-ext-hook.patch"
HOOK_FILE = "sglang/srt/plugins/__init__.py"
HOOK_FUNCTION, HOOK_AFTER = "load_plugins", "_plugins_loaded"  # insert after `_plugins_loaded = True`
HOOK_LINES = (
    f"# sglang-ext fork series (patches/sglang-{SERIES_VERSION}): activate the vendored sglang/ext/ in every",
    "# process that loads plugins, before the plugins themselves.",
    "from sglang.ext.activation import activate as _activate_sglang_ext",
    "",
    "_activate_sglang_ext(force=True)",
)


def _select(version: str) -> None:
    """Make `version`'s series the current one (its directory, fingerprint table and hook comment)."""
    global SERIES_VERSION, PATCH_DIR, DATA, HOOK_LINES
    SERIES_VERSION = version
    PATCH_DIR = os.path.join(REPO, "patches", f"sglang-{version}")
    DATA = (f"sglang_ext/fingerprints/sglang-{version}.json",)
    HOOK_LINES = (f"# sglang-ext fork series (patches/sglang-{version}): activate the vendored sglang/ext/ in every",
                  *HOOK_LINES[1:])


MATRIX_BEGIN = "<!-- BEGIN GENERATED MATRIX (scripts/gen_patches.py) -->"
MATRIX_END = "<!-- END GENERATED MATRIX -->"
MATRIX_VERSIONS = ("0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
_MODULE_PATH = re.compile(r"sglang_ext(?:\.\w+)*")


class GenerationError(Exception):
    """The series cannot be generated; the message says what and why."""


def _read(path: str) -> str:
    with open(path, "r", encoding="utf-8") as f:
        return f.read()


def source_file(module: str) -> Optional[str]:
    """The file of an sglang_ext module under python/, or None (not a module)."""
    base = os.path.join(PYTHON_DIR, *module.split("."))
    for path in (os.path.join(base, "__init__.py"), base + ".py"):
        if os.path.isfile(path):
            return path
    return None


def _as_module(dotted: str) -> Optional[str]:
    """The longest prefix of a dotted sglang_ext name that is a module (`a.b.Class` -> `a.b`)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if source_file(".".join(parts[:n])):
            return ".".join(parts[:n])
    return None


def referenced_modules(module: str) -> List[str]:
    """sglang_ext modules a module imports (anywhere, also inside functions; relative imports
    resolved) or names in a string constant (`"sglang_ext.adapters.x:fn"`, importlib names)."""
    path = source_file(module)
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    names = []
    for node in ast.walk(ast.parse(_read(path), filename=path)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) + 1 - node.level] + [node.module or ""] if node.level
                            else [node.module or ""]).strip(".")
            names += [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _MODULE_PATH.fullmatch(node.value.split(":")[0]):
                names.append(node.value.split(":")[0])
    found = {_as_module(n) for n in names if n.split(".")[0] == PACKAGE}
    found |= {n.split(".")[0] for n in names if n.split(".")[0] in TEST_ONLY}  # refused by vendored_modules
    return sorted(m for m in found if m)


def vendored_modules(specs) -> List[str]:
    """ROOTS, the registry's adapter modules, everything they reach, and their parent packages."""
    todo = [(m, "the registry") for m in ROOTS + tuple(p.function.split(":")[0] for s in specs for p in s.parts)]
    seen = set()
    while todo:
        module, reached_from = todo.pop()
        if module in seen:
            continue
        if any(module == t or module.startswith(t + ".") for t in TEST_ONLY):
            raise GenerationError(f"{reached_from} imports the test-only {module}; shipped code must not "
                                  "(the fork does not vendor test helpers)")
        if source_file(module) is None:
            raise GenerationError(f"{reached_from} names {module}, which has no source under python/")
        seen.add(module)
        parts = module.split(".")
        parents = [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += [(m, module) for m in parents + referenced_modules(module)]
    return sorted(seen)


def adapter_patches(specs) -> List[tuple]:
    """(spec, adapter modules) per registry entry: the modules its parts name (a module named by several
    entries goes to the first) and the modules of their packages that only this entry's modules import
    (e.g. vit/engine.py beside vit/runner.py); whatever several entries share stays in the core patch."""
    claimed, out = set(), []
    for spec in specs:
        mods = [m for m in dict.fromkeys(p.function.split(":")[0] for p in spec.parts) if m not in claimed]
        claimed.update(mods)
        out.append((spec, mods))
    reached: Dict[str, set] = {}
    for spec, mods in out:
        todo, seen = list(mods), set()
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo += referenced_modules(module)
        packages = {m.rpartition(".")[0] for m in mods}
        for module in seen - claimed:
            if module.rpartition(".")[0] in packages:
                reached.setdefault(module, set()).add(spec.name)
    for spec, mods in out:
        mods += sorted(m for m, names in reached.items() if names == {spec.name})
    return [(spec, mods) for spec, mods in out if mods]


def vendored_text(module_or_data: str, vendored: Sequence[str]) -> str:
    """A file as the fork carries it: sglang_ext names of vendored modules become sglang.ext."""
    is_data = module_or_data in DATA
    path = os.path.join(PYTHON_DIR, module_or_data) if is_data else source_file(module_or_data)
    vendored_set = set(vendored)

    def rename(m: "re.Match[str]") -> str:
        return VENDORED_AS + m.group(0)[len(PACKAGE):] if _as_module(m.group(0)) in vendored_set else m.group(0)

    text = _read(path)
    if is_data:
        return text if text.endswith("\n") else text + "\n"
    rel = os.path.relpath(path, REPO).replace(os.sep, "/")
    text = re.sub(r"\b" + _MODULE_PATH.pattern + r"\b", rename, text)
    ast.parse(text, filename=rel)  # still Python
    header = f"# Vendored from sglang-ext {rel} by scripts/gen_patches.py; edit the original.\n"
    return header + (text if text.endswith("\n") or not text else text + "\n")


def tree_path(module_or_data: str) -> str:
    """Where a vendored module or data file lives in the sglang tree (relative to python/)."""
    if module_or_data in DATA:
        return "sglang/ext/" + module_or_data[len(PACKAGE) + 1:]
    path = source_file(module_or_data)
    rel = os.path.relpath(path, os.path.join(PYTHON_DIR, PACKAGE)).replace(os.sep, "/")
    return "sglang/ext/" + rel


def hooked(pristine: str) -> str:
    """sglang/srt/plugins/__init__.py with the activation hook after `_plugins_loaded = True`."""
    for fn in ast.parse(pristine).body:
        if isinstance(fn, ast.FunctionDef) and fn.name == HOOK_FUNCTION:
            break
    else:
        raise GenerationError(f"{HOOK_FILE} has no {HOOK_FUNCTION}(); is this sglang {SERIES_VERSION}?")
    if "sglang.ext" in pristine:
        raise GenerationError(f"{HOOK_FILE} already mentions sglang.ext: the tree is not pristine")
    anchor = next((s for s in fn.body if isinstance(s, ast.Assign) and len(s.targets) == 1
                   and getattr(s.targets[0], "id", None) == HOOK_AFTER), None)
    if anchor is None:
        raise GenerationError(f"{HOOK_FUNCTION}() in {HOOK_FILE} never sets {HOOK_AFTER}")
    lines = pristine.splitlines(keepends=True)
    indent = " " * anchor.col_offset
    hook = ["\n"] + [(indent + line).rstrip() + "\n" for line in HOOK_LINES]
    return "".join(lines[:anchor.end_lineno] + hook + lines[anchor.end_lineno:])


def unified(rel: str, old: Optional[str], new: str) -> str:
    """A git-style diff of one file under python/ (old None: a new file)."""
    a, b = f"a/python/{rel}", f"b/python/{rel}"
    head = f"diff --git {a} {b}\n" + ("new file mode 100644\n" if old is None else "")
    body = difflib.unified_diff((old or "").splitlines(keepends=True), new.splitlines(keepends=True),
                                "/dev/null" if old is None else a, b, n=3)
    return head + "".join(body)


def header(description: Sequence[str], fields: Sequence[tuple]) -> str:
    """A DEP-3 header: the first description line is the summary, further lines are indented."""
    desc = description[0] + "".join("\n " + (line or ".") for line in description[1:])
    return "".join(f"{k}: {v}\n" for k, v in (("Description", desc), *fields)) + "---\n"


def patch_filename(name: str) -> str:
    return name.replace("_", "-") + ".patch"


def render_series(specs, pristine_root: str) -> Dict[str, str]:
    """{file name: content} of the series directory."""
    vendored = vendored_modules(specs)
    author = ("Author", "sglang-ext maintainers")
    origin = ("Origin", "vendor, sglang-ext (scripts/gen_patches.py)")
    patches = []
    for spec, mods in adapter_patches(specs):
        fields = [author, origin, ("Forwarded", "not-needed" if spec.upstream_equivalent else "no")]
        if spec.upstream_since:
            fields.append(("Applied-Upstream", f"{spec.upstream_since} ({spec.upstream_pr})"))
        fields.append(("X-Runtime-Patch", f"{spec.name} ({', '.join(mods)})"))
        desc = [spec.summary, "", f"Adapter modules of the sglang-ext runtime patch {spec.name!r}, vendored as "
                "sglang.ext.adapters; upstream: " + spec.upstream_pr + ".", "Retire when: " + spec.retire_when]
        patches.append((patch_filename(spec.name), header(desc, fields), mods))
    claimed = {m for _, _, mods in patches for m in mods}
    core = [m for m in vendored if m not in claimed] + list(DATA)
    core_desc = ["Vendor sglang-ext as sglang.ext (everything the adapters and activation import)",
                 "Generated by scripts/gen_patches.py; sglang_ext.X is sglang.ext.X here. Modules: "
                 + ", ".join(core)]
    patches.insert(0, (CORE_PATCH, header(core_desc, [author, origin, ("Forwarded", "not-needed"),
                                                      ("X-Runtime-Patch", "none (support code of the series)")]), core))
    out = {name: head + "".join(unified(tree_path(m), None, vendored_text(m, vendored))
                                for m in sorted(mods, key=tree_path))
           for name, head, mods in patches}
    pristine_hook = _read(os.path.join(pristine_root, HOOK_FILE))
    hook_desc = ["Activate the vendored sglang-ext wherever sglang loads plugins",
                 f"{HOOK_FUNCTION}() runs in the sglang serve / launch_server main process, Engine and every "
                 "srt scheduler process;", "the vendored mg_worker_activation patch carries activation into "
                 "spawned multimodal_gen workers."]
    out[HOOK_PATCH] = (header(hook_desc, [author, origin, ("Forwarded", "not-needed"),
                                          ("X-Runtime-Patch", "none (activation of the series)")])
                       + unified(HOOK_FILE, pristine_hook, hooked(pristine_hook)))
    order = [name for name, _, _ in patches] + [HOOK_PATCH]
    out["series"] = "\n".join([f"# sglang-version: {SERIES_VERSION}",
                               "# Generated by scripts/gen_patches.py from the sglang-ext package; do not edit.",
                               "# Apply: scripts/apply_patches.sh TREE, or quilt push -a / git apply -p1 in an "
                               "sglang checkout.", *order]) + "\n"
    return out


def matrix(specs, files: Dict[str, str]) -> str:
    """The patch x sglang version table of the READMEs."""
    from sglang_ext.versions import at_least

    carriers = {m: patch_filename(spec.name) for spec, mods in adapter_patches(specs) for m in mods}
    rows = ["| patch | " + " | ".join(MATRIX_VERSIONS) + " |", "|" + "---|" * (len(MATRIX_VERSIONS) + 1)]
    for spec in specs:
        cells = []
        for v in MATRIX_VERSIONS:
            upstream = spec.upstream_since and at_least(v, spec.upstream_since)
            if v in SERIES_VERSIONS and v not in spec.supported and not (upstream and spec.upstream_equivalent):
                cells.append("not ported yet")
            elif v in SERIES_VERSIONS and not (upstream and spec.upstream_equivalent):
                names = dict.fromkeys(carriers.get(p.function.split(":")[0], "**missing**") for p in spec.parts_on(v))
                cells.append(", ".join(n if n.startswith("**") else f"`{n}`" for n in names))
            elif upstream:
                cells.append("upstream" if spec.upstream_equivalent else "upstream (differs)")
            else:
                cells.append("not upstream")
        rows.append(f"| `{spec.name}` | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def readme_text(current: str, table: str) -> str:
    if MATRIX_BEGIN not in current or MATRIX_END not in current:
        raise GenerationError(f"a README lacks the markers {MATRIX_BEGIN!r} / {MATRIX_END!r}")
    before, rest = current.split(MATRIX_BEGIN, 1)
    return before + MATRIX_BEGIN + "\n" + table + MATRIX_END + rest.split(MATRIX_END, 1)[1]


def generate(sglang_tree: Optional[str] = None) -> Dict[str, str]:
    """Everything gen_patches writes: {path relative to REPO: content}."""
    from sglang_ext_testkit import wheels
    from sglang_ext.registry import PATCHES
    from sglang_ext.versions import source_tree_version

    root = sglang_tree or wheels.ensure_unpacked(SERIES_VERSION)
    if os.path.isdir(os.path.join(root, "python", "sglang")):
        root = os.path.join(root, "python")  # an sglang checkout
    version = source_tree_version(root)
    if version is not None and version.split("+")[0] != SERIES_VERSION:
        raise GenerationError(f"{root} is sglang {version}; the series is generated against {SERIES_VERSION}")
    files = render_series(PATCHES, root)
    out = {os.path.relpath(os.path.join(PATCH_DIR, name), REPO): text for name, text in files.items()}
    table = matrix(PATCHES, files)
    for readme in READMES:
        out[os.path.relpath(readme, REPO)] = readme_text(_read(readme), table)
    return out


def destinations(generated: Dict[str, str], patch_dir: str = PATCH_DIR) -> Dict[str, str]:
    """{absolute path: content}, with the series written to patch_dir."""
    series_rel = os.path.relpath(PATCH_DIR, REPO)
    return {(os.path.join(patch_dir, os.path.basename(k)) if os.path.dirname(k) == series_rel
             else os.path.join(REPO, k)): v for k, v in generated.items()}


def stale(generated: Dict[str, str], patch_dir: str = PATCH_DIR) -> List[str]:
    """What differs between the files on disk and `generated` (patch_dir: the series to compare)."""
    wanted = destinations(generated, patch_dir)
    present = {os.path.join(patch_dir, n) for n in os.listdir(patch_dir)} if os.path.isdir(patch_dir) else set()
    problems = [f"{os.path.basename(p)}: is not generated any more" for p in sorted(present - set(wanted))]
    for path, text in sorted(wanted.items()):
        name = os.path.basename(path) if os.path.dirname(path) == patch_dir else os.path.relpath(path, REPO)
        if not os.path.exists(path):
            problems.append(f"{name}: missing")
        elif _read(path) != text:
            diff = difflib.unified_diff(_read(path).splitlines(), text.splitlines(), "committed", "generated",
                                        n=1, lineterm="")
            problems.append(f"{name}: differs from what would be generated\n"
                            + "\n".join("    " + d for d in list(diff)[:30]))
    return problems


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed series is stale")
    parser.add_argument("--sglang-tree", help="pristine sglang tree of --release (unpacked wheel or checkout); "
                                              "default: the cached wheel (~/.cache/sglang-ext/wheels)")
    parser.add_argument("--release", choices=SERIES_VERSIONS, help="one series (default: every supported release)")
    parser.add_argument("--patch-dir", help=argparse.SUPPRESS)  # tests: a copy to check (one release)
    args = parser.parse_args(argv)
    status = 0
    try:
        for release in (args.release,) if args.release else SERIES_VERSIONS:
            _select(release)
            status = max(status, _main_one(args))
    finally:
        _select(SERIES_VERSIONS[0])  # importers (tests) keep seeing the first release's series
    return status


def _main_one(args) -> int:
    patch_dir = args.patch_dir or PATCH_DIR
    try:
        generated = generate(args.sglang_tree)
    except GenerationError as exc:
        print(f"gen_patches: {exc}", file=sys.stderr)
        return 2
    series_rel = os.path.relpath(PATCH_DIR, REPO)
    count = sum(k.endswith(".patch") for k in generated)
    if args.check:
        problems = stale(generated, patch_dir)
        if problems:
            print(f"{series_rel} or the README matrix is stale (generated from python/sglang_ext):\n  "
                  + "\n  ".join(problems) + f"\nRegenerate with: {REGENERATE}", file=sys.stderr)
            return 1
        print(f"{series_rel}: up to date ({count} patches)")
        return 0
    for name in os.listdir(patch_dir) if os.path.isdir(patch_dir) else ():
        if name.endswith(".patch") or name == "series":
            os.remove(os.path.join(patch_dir, name))
    os.makedirs(patch_dir, exist_ok=True)
    for path, text in destinations(generated, patch_dir).items():
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    print(f"wrote {series_rel} ({count} patches) and the matrix in {', '.join(os.path.relpath(r, REPO) for r in READMES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
