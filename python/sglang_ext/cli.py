"""`sglang-ext` console script (also `python -m sglang_ext`).

    sglang-ext doctor [--verbose] [--json] [--no-import] [--source-root DIR --assume-version V]
                      [--records DIR] [--strict]
    sglang-ext make-tiny-model {qwen2,qwen2_5_vl,qwen3_vl} DIR [--seed N] [--force]

`doctor` opens with a one-line verdict (`sglang-ext: OK — ...` or `sglang-ext: PROBLEM — ...`),
then one line per patch; `--verbose` adds versions, fingerprints, upstream and graph caches.
Exit status of `doctor`: 0 when every requested patch is applied, armed, disabled or
not needed; 1 in strict mode (`--strict` or SGLANG_EXT_STRICT=1) when a requested patch
failed or was skipped; 2 for a configuration error (bad SGLANG_EXT_* value).
Exit status of `make-tiny-model`: 0 when written; 2 for a bad argument (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import List, Optional


def _doctor_parser(sub) -> None:
    p = sub.add_parser(
        "doctor", help="report the sglang/torch versions and every patch's status and fingerprints",
        description="Check which sglang-ext patches apply to this sglang, and why. By default the "
        "doctor activates every patch in its own process and imports every target module, so "
        "'applied' is proven (10-25 s). Settings (SGLANG_EXT_DISABLE, ...) come from the environment.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="after the verdict and the patch list: versions, fingerprints per target, upstream, "
                        "graph caches")
    p.add_argument("--no-import", dest="import_targets", action="store_false",
                   help="only compare fingerprints; import and patch nothing ('armed' = would apply)")
    p.add_argument("--source-root", metavar="DIR",
                   help="check another sglang tree: the directory that contains its sglang/ package "
                        "(e.g. an unpacked wheel); implies --no-import")
    p.add_argument("--assume-version", metavar="V",
                   help="treat the checked sglang as this version (default: read from the tree / installed)")
    p.add_argument("--records", metavar="DIR",
                   help="also show the per-process activation records a server wrote there "
                        "(the server's SGLANG_EXT_ACTIVATION_DIR)")
    p.add_argument("--strict", action="store_true", default=None,
                   help="exit 1 if a requested patch failed or was skipped (default: SGLANG_EXT_STRICT)")


def doctor_main(args: argparse.Namespace) -> int:
    from sglang_ext import doctor

    logging.basicConfig(level=logging.ERROR, format="%(message)s")  # statuses are in the report itself
    rep = doctor.run_checks(import_targets=args.import_targets, source_root=args.source_root,
                            version=args.assume_version, strict=args.strict)
    if args.records:
        rep["records"] = doctor.read_records(args.records)
    problems = doctor.problems(rep)
    rep["problems"] = problems
    rep["verdict"] = doctor.verdict(rep)
    if args.json:
        json.dump(rep, sys.stdout, indent=1, sort_keys=True)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(doctor.render_text(rep, verbose=args.verbose))
        if args.verbose or len(problems) > 1:  # the verdict line already names a single one
            for line in problems:
                sys.stdout.write(f"PROBLEM: {line}\n")
    if rep.get("config_error"):
        return 2
    return 1 if (problems and rep["strict"]) else 0


def _tiny_model_parser(sub) -> None:
    from sglang_ext.tiny_model import KINDS

    p = sub.add_parser(
        "make-tiny-model", help="write a tiny offline Qwen model folder with seeded random weights",
        description="Write a self-contained model folder (config, tokenizer with Qwen special tokens and "
        "a chat template, processor files, a few MB of seeded random weights) that sglang serves "
        "without a download. The same seed writes byte-identical files.")
    # kind and seed are checked by make_tiny_model itself, so a bad value gets its one-line error
    p.add_argument("kind", metavar="KIND", help="one of: " + ", ".join(KINDS))
    p.add_argument("dir", metavar="DIR", help="output folder: new or empty (or use --force)")
    p.add_argument("--seed", default="0", help="weight seed, an integer >= 0 (default 0)")
    p.add_argument("--force", action="store_true", help="write into a non-empty folder, overwriting the model files")


def tiny_model_main(args: argparse.Namespace) -> int:
    from sglang_ext.tiny_model import TinyModelError, make_tiny_model

    try:
        seed = int(args.seed)
    except ValueError:
        seed = args.seed  # make_tiny_model names the field and the allowed values
    try:
        out = make_tiny_model(args.kind, args.dir, seed, force=args.force)
    except TinyModelError as exc:
        sys.stderr.write(f"sglang-ext: {exc}\n")
        return 2
    sys.stdout.write(f"{out}\n")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="sglang-ext", description="sglang-ext tools")
    sub = ap.add_subparsers(dest="command", required=True)
    _doctor_parser(sub)
    _tiny_model_parser(sub)
    args = ap.parse_args(argv)
    if args.command == "doctor":
        return doctor_main(args)
    if args.command == "make-tiny-model":
        return tiny_model_main(args)
    ap.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
