#!/usr/bin/env python3
"""Write the fingerprint tables `python/sglang_ext/fingerprints/sglang-<v>.json`.

For every sglang release in `sglang_ext_testkit.wheels.RECORDED_RELEASES` the real wheel is
downloaded (`pip download --no-deps`, cached in `--wheels-dir`, default
~/.cache/sglang-ext/wheels), its `sglang/**.py` files are unpacked, and every
registry target (`PATCHES[*].targets`) is fingerprinted from that tree. These
tables are never edited by hand: rerun this script after changing registry targets.

    python scripts/gen_fingerprints.py            # regenerate the tables (and the support matrix)
    python scripts/gen_fingerprints.py --check    # CI: exit 1 if the tables or the matrix are stale

The support matrix (docs/support-matrix.md, README.md) is derived from these tables, so
this script runs `scripts/gen_support_matrix.py` after them (same mode).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from sglang_ext import fingerprint
from sglang_ext_testkit import wheels  # noqa: E402
from sglang_ext.registry import PATCHES  # noqa: E402

TABLE_DIR = os.path.join(REPO, "python", "sglang_ext", "fingerprints")
GENERATED_BY = "scripts/gen_fingerprints.py"
REGENERATE = "python scripts/gen_fingerprints.py && git add python/sglang_ext/fingerprints docs/support-matrix.md docs/settings.md"


def registry_targets() -> List[object]:
    seen = {}
    for spec in PATCHES:
        for t in spec.targets:
            seen[t.key] = t
    return [seen[k] for k in sorted(seen)]


def build_table(version: str, root: str) -> Dict[str, object]:
    """Keyed by the registry's (newest-shape) names; each fingerprint is of the name `version` uses."""
    prints: Dict[str, Optional[str]] = {}
    for target in registry_targets():
        prints[target.key] = fingerprint.fingerprint_key(target.key_in(version), source_root=root)
    return {"sglang": version, "generated_by": GENERATED_BY, "fingerprints": prints}


def render(table: Dict[str, object]) -> str:
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def table_path(version: str) -> str:
    return os.path.join(TABLE_DIR, f"sglang-{version}.json")


def describe_difference(path: str, expected: Dict[str, object]) -> str:
    name = os.path.relpath(path, REPO)
    if not os.path.exists(path):
        return f"{name}: missing"
    try:
        with open(path, "r", encoding="utf-8") as f:
            committed = json.load(f)
    except ValueError as exc:
        return f"{name}: not valid JSON ({exc})"
    old, new = committed.get("fingerprints", {}), expected["fingerprints"]
    parts = []
    added = sorted(set(new) - set(old))
    removed = sorted(set(old) - set(new))
    changed = sorted(k for k in set(old) & set(new) if old[k] != new[k])
    if added:
        parts.append("targets not recorded: " + ", ".join(added))
    if removed:
        parts.append("targets no longer in the registry: " + ", ".join(removed))
    if changed:
        parts.append("fingerprints differ: " + ", ".join(changed))
    return f"{name}: " + ("; ".join(parts) or "formatting differs from the generator's output")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 if a committed table differs from what would be generated")
    ap.add_argument("--wheels-dir", default=wheels.default_wheels_dir(),
                    help="cache of downloaded/unpacked wheels (default: %(default)s)")
    ap.add_argument("--versions", default=",".join(wheels.RECORDED_RELEASES),
                    help="comma-separated sglang releases (default: all recorded releases)")
    args = ap.parse_args(argv)

    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    stale = []
    for version in versions:
        root = wheels.ensure_unpacked(version, args.wheels_dir)
        table = build_table(version, root)
        path = table_path(version)
        text = render(table)
        current = open(path, "r", encoding="utf-8").read() if os.path.exists(path) else None
        if current == text:
            continue
        if args.check:
            stale.append(describe_difference(path, table))
        else:
            os.makedirs(TABLE_DIR, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"wrote {os.path.relpath(path, REPO)}")
    if stale:
        print("fingerprint tables are out of date (registry targets changed?):", file=sys.stderr)
        for line in stale:
            print("  " + line, file=sys.stderr)
        print(f"regenerate with: {REGENERATE}", file=sys.stderr)
        return 1
    if args.check:
        print(f"fingerprint tables up to date ({len(versions)} releases, {len(registry_targets())} targets)")
    return support_matrix_main(["--check"] if args.check else [])


def support_matrix_main(argv: List[str]) -> int:
    path = os.path.join(REPO, "scripts", "gen_support_matrix.py")
    spec = importlib.util.spec_from_file_location("gen_support_matrix", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


if __name__ == "__main__":
    sys.exit(main())
