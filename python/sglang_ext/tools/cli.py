"""`sglang-ext` console script (also `python -m sglang_ext`): `sglang-ext doctor`, whose --help gives its
options and exit statuses. Every usage error is one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import List, NoReturn, Optional

from sglang_ext.tools.launcher import USAGE_EXIT, fail


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the problem and where help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_EXIT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _folder_error(option: str, path: Optional[str], needs: str, inner: str = "") -> Optional[str]:
    if path is not None and not os.path.isdir(path):
        return f"{option} {path!r} is not a folder; allowed: {needs}"
    if path is not None and inner and not os.path.isdir(os.path.join(path, inner)):
        return f"{option} {path!r} has no {inner}/ folder; allowed: {needs}"
    return None


def doctor_main(args: argparse.Namespace) -> int:
    from sglang_ext.tools import doctor

    for problem in (_folder_error("--source-root", args.source_root, "a folder that contains the sglang/ package",
                                  "sglang"),
                    _folder_error("--records", args.records, "the folder a server wrote with --ext-activation-dir")):
        if problem:
            return fail("sglang-ext doctor", problem)
    logging.basicConfig(level=logging.ERROR, format="%(message)s")  # statuses are in the report itself
    rep = doctor.run_checks(import_targets=args.import_targets, source_root=args.source_root,
                            version=args.assume_version)
    if args.records:
        rep["records"] = doctor.read_records(args.records)
    rep["problems"] = doctor.problems(rep)
    rep["verdict"] = doctor.verdict(rep)
    status = doctor.exit_status(rep)
    report = (json.dumps(rep, indent=1, sort_keys=True) + "\n" if args.json
              else doctor.render_text(rep, verbose=args.verbose))
    if status == USAGE_EXIT:
        # A bad setting or a missing sglang / torch is a usage error: its one line goes to stderr, like
        # every usage error here; the report (JSON, --verbose details) stays on stdout.
        sys.stderr.write(rep["verdict"] + "\n")
        if not args.json:
            report = report.partition("\n")[2]  # render_text's first line is the verdict
    sys.stdout.write(report)
    return status


def main(argv: Optional[List[str]] = None) -> int:
    ap = OneLineParser(prog="sglang-ext", description="sglang-ext tools")
    p = ap.add_subparsers(dest="command", required=True).add_parser(
        "doctor", help="one line: does every sglang-ext patch apply to this sglang (--verbose: why)",
        description="Check which sglang-ext patches apply to this sglang, and why. By default the "
        "doctor activates every patch in its own process and imports every target module, so "
        "'applied' is proven (10-25 s). Settings (SGLANG_EXT_DISABLE, ...) come from the environment. "
        "Exit status: 0 OK, 1 a problem reported, 2 a configuration error or sglang / torch missing.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="after the verdict: every patch's status, versions, fingerprints per target, upstream, "
                        "graph caches, and what sglang and torch printed while being imported")
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
    return doctor_main(ap.parse_args(argv))  # the only subcommand: argparse has already refused anything else


if __name__ == "__main__":
    sys.exit(main())
