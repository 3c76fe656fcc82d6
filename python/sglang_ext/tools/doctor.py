"""`sglang-ext doctor`: what is installed, what each patch does in this process, and why.

`report()` reads this process's activation and graph caches (usable inside a server);
`run_checks()` is what the console script does: activate in its own process and, by default,
import every target module so that "applied" is proven rather than "armed".
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import tempfile
from typing import Any, Dict, Iterator, List, Optional

from sglang_ext import activation, fingerprint
from sglang_ext.graphs import stats
from sglang_ext.errors import ExtConfigError
from sglang_ext.knobs import MASTER_ENV, Settings, knob, knob_enabled, load_settings
from sglang_ext.tools.launcher import USAGE_EXIT, missing_message, missing_modules
from sglang_ext.registry import PATCHES, PatchSpec
from sglang_ext.versions import (SUPPORTED_RANGE, SUPPORTED_SGLANG, dist_version, installed_sglang_path,
                                 installed_sglang_version, unsupported_message, within_supported_range)

# How each mode came to its statuses (shown in the report).
MODE_LIVE = "live: statuses of this process's activation"
MODE_IMPORT = "applied here: every target module imported and patched in the doctor's own process"
MODE_FINGERPRINTS = "fingerprints only: nothing imported or patched ('armed' = would apply when imported)"


def environment(source_root: Optional[str], sglang_version: Optional[str]) -> Dict[str, Any]:
    """Versions and paths (no import of torch or sglang)."""
    sglang_path = os.path.join(source_root, "sglang") if source_root is not None else installed_sglang_path()
    return {"sglang_ext": dist_version("sglang-ext"),
            "sglang": {"version": sglang_version, "path": sglang_path, "installed_version": installed_sglang_version(),
                       "supported": sglang_version is not None and within_supported_range(sglang_version),
                       "supported_versions": list(SUPPORTED_SGLANG), "supported_range": SUPPORTED_RANGE},
            "torch": dist_version("torch"), "python": sys.version.split()[0], "executable": sys.executable}


def _fingerprint_rows(spec: PatchSpec, source_root: Optional[str], version: Optional[str]) -> List[Dict[str, Any]]:
    tables = {v: fingerprint.reference_table(v) for v in fingerprint.recorded_versions()}
    rows = []
    for target in spec.targets:
        name, live, reference = activation.check_target(spec, target, version, source_root)
        same = [v for v in tables if live is not None and tables[v].get(target.key) == live]
        rows.append({"target": target.key, "as_named_here": name, "fingerprint": live,
                     "reference": reference, "match": live is not None and live in set(reference.values()),
                     "same_as_releases": same})
    return rows


def _patch_entry(spec: PatchSpec, status: Optional[activation.PatchStatus], source_root: Optional[str],
                 version: Optional[str], live_problems: Optional[List[str]]) -> Dict[str, Any]:
    st = status or activation.PatchStatus(spec.name, state=None)  # state None: not activated
    return {"name": spec.name, "summary": spec.summary,
            "status": str(status) if status is not None else "not activated",
            "state": st.state, "detail": st.detail,
            "parts_applied": list(st.parts_applied), "parts_pending": list(st.parts_pending),
            # applied parts re-checked now: None = nothing applied in this process to check
            "verified_live": None if live_problems is None else not live_problems,
            "live_problems": list(live_problems or []), "process": spec.process, "supported": list(spec.supported),
            "targets": _fingerprint_rows(spec, source_root, version), "unported": st.unported,
            "upstream": {"pr": spec.upstream_pr, "since": spec.upstream_since,
                         "equivalent": spec.upstream_equivalent, "retire_when": spec.retire_when}}


def read_records(directory: str) -> List[Dict[str, Any]]:
    """Activation records written by each process of a server (`SGLANG_EXT_ACTIVATION_DIR`)."""
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        try:
            with open(path, "r", encoding="utf-8") as f:
                rec = json.load(f)
        except (OSError, ValueError) as exc:
            rec = {"error": f"unreadable: {exc}"}
        rec["file"] = os.path.basename(path)
        out.append(rec)
    return out


def report(*, source_root: Optional[str] = None, version: Optional[str] = None,
           environ: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """The doctor report of this process: live statuses, else statuses planned from the fingerprints."""
    env = os.environ if environ is None else environ
    live = activation.statuses() if source_root is None else {}
    config_error = None
    try:
        settings: Optional[Settings] = activation.current_settings() if live else load_settings(env)
    except ExtConfigError as exc:
        settings, config_error = None, str(exc)
    if live:
        statuses, mode, checked_version = live, MODE_LIVE, activation.activated_version()
    else:
        checked_version, mode = activation.resolve_version(settings, source_root, version), MODE_FINGERPRINTS
        statuses = activation.plan(settings, version=checked_version, source_root=source_root) if settings else {}
    verified = activation.verify_applied() if live else {}
    out = environment(source_root, checked_version)
    try:
        enabled = knob_enabled(env)
    except ExtConfigError:
        enabled = False
    out.update(mode=mode, enabled_in_environment=enabled,
               strict=activation.is_strict() if live else bool(settings and settings.strict), config_error=config_error,
               patches=[_patch_entry(spec, statuses.get(spec.name), source_root, checked_version,
                                     verified.get(spec.name))
                        for spec in PATCHES],
               graph_caches=stats.snapshot())
    return out


@contextlib.contextmanager
def held_stderr(lines: List[str]) -> Iterator[None]:
    """Hold back everything written to file descriptor 2 into `lines` (written back if the block raises)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = held.read().decode("utf-8", "replace")
            if failed:
                sys.stderr.write(text)
            lines.extend(text.splitlines())


def run_checks(*, import_targets: bool = True, source_root: Optional[str] = None,
               version: Optional[str] = None) -> Dict[str, Any]:
    """What the console script does: activate in this (throw-away) process, then report. With
    `import_targets` every trigger module is imported (what sglang and torch print meanwhile goes
    to `import_messages`); another tree is only fingerprinted."""
    env = dict(os.environ)
    # sglang (and torch, to import sglang's modules) if this Python lacks them; another tree needs neither
    missing = [] if source_root is not None else missing_modules(("sglang", "torch") if import_targets else ("sglang",))
    try:
        settings = load_settings(env)
    except ExtConfigError as exc:
        out = report(source_root=source_root, version=version, environ=env)
        out.update(config_error=str(exc), missing_prerequisites=missing, import_messages=[])
        return out
    messages: List[str] = []
    if source_root is None and import_targets and not activation.statuses() and not missing:
        with held_stderr(messages):
            # Never strict here: the doctor reports every failure instead of stopping at the first.
            activation.activate(environ=env, force=True, strict=False, eager=True, version=version)
            out = report(environ=env)
        out["mode"] = MODE_IMPORT
    else:
        out = report(source_root=source_root, version=version, environ=env)
    out.update(strict=settings.strict, missing_prerequisites=missing, import_messages=messages)
    return out


def problems(rep: Dict[str, Any]) -> List[str]:
    """Requested patches that would not be live (failed or skipped), plus configuration errors."""
    out = [f"configuration error: {rep['config_error']}"] if rep.get("config_error") else []
    for p in rep["patches"]:
        if p["state"] == activation.FAILED or (p["state"] == activation.SKIPPED and not p["unported"]):
            out.append(f"{p['name']}: {p['status']}")
        elif p["live_problems"]:
            out.append(f"{p['name']}: {p['status']}, but now: {'; '.join(p['live_problems'])}")
    return out


def _usage_problem(rep: Dict[str, Any]) -> Optional[str]:
    """A configuration error or sglang / torch missing: the whole verdict, and exit status 2."""
    if rep.get("config_error"):
        return f"configuration error: {rep['config_error']}"
    return missing_message(rep.get("missing_prerequisites", []))


def exit_status(rep: Dict[str, Any]) -> int:
    """2: a configuration error or sglang / torch missing; 1: any other problem; 0: OK."""
    if _usage_problem(rep):
        return USAGE_EXIT
    return 1 if not rep["sglang"]["supported"] or problems(rep) else 0


def verdict(rep: Dict[str, Any]) -> str:
    """The report in one line: `sglang-ext: OK — ...` or `sglang-ext: PROBLEM \u2014 ...`."""
    sg, found, usage = rep["sglang"], problems(rep), _usage_problem(rep)
    if usage:
        return f"sglang-ext: PROBLEM \u2014 {usage}"
    if not sg["supported"]:
        skipped = sum(p["state"] == activation.SKIPPED for p in rep["patches"])
        return (f"sglang-ext: PROBLEM \u2014 {unsupported_message(sg['version'])} ({skipped} patches skipped, "
                "nothing applied)")
    if found:
        more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
        return f"sglang-ext: PROBLEM \u2014 {found[0]}{more}"
    count = {state: sum(p["state"] == state for p in rep["patches"]) for state in
             (activation.APPLIED, activation.ARMED, activation.DISABLED, activation.NOT_NEEDED)}
    applied, armed = count[activation.APPLIED], count[activation.ARMED]
    notes = [f"{count[s]} {s}" for s in (activation.DISABLED, activation.NOT_NEEDED) if count[s]]
    unported = [p["name"] for p in rep["patches"] if p["unported"]]
    if unported:
        notes.append(f"not ported to sglang {sg['version']} yet: {', '.join(unported)}")
    if armed:
        done = f"{armed}/{applied + armed} patches armed" + (f", {applied} applied" if applied else "")
        notes.insert(0, "fingerprints match; each applies when sglang imports its module")
    else:
        done = f"{applied}/{applied + armed} patches applied"
    return f"sglang-ext: OK \u2014 {done} on sglang {sg['version']}" + (f" ({'; '.join(notes)})" if notes else "")


def render_text(rep: Dict[str, Any], *, verbose: bool = False) -> str:
    """The verdict in one line, the records a server wrote if asked for, and with `verbose` every detail."""
    lines = [verdict(rep)]
    if not verbose:
        if exit_status(rep) == 1:  # a usage problem names everything in the line already
            lines[0] += " (details: sglang-ext doctor --verbose)"
        lines.extend(_record_lines(rep))
        return "\n".join(lines) + "\n"
    sg = rep["sglang"]
    lines.append(f"sglang-ext {rep['sglang_ext'] or '(not installed as a distribution)'} doctor")
    support = "supported" if sg["supported"] else "NOT SUPPORTED"
    lines.append(f"  sglang   {sg['version'] or '(not found)'}  {sg['path'] or ''}  "
                 f"[{support}; supported: {', '.join(sg['supported_versions'])} ({sg['supported_range']})]")
    if sg["installed_version"] != sg["version"]:
        lines.append(f"           (installed sglang: {sg['installed_version'] or 'none'})")
    lines += [f"  torch    {rep['torch'] or '(not installed)'}", f"  python   {rep['python']}  {rep['executable']}",
              f"  switch   {MASTER_ENV}={'1' if rep['enabled_in_environment'] else 'unset/0'} in this environment; "
              f"strict {'on' if rep['strict'] else 'off'} ({knob('strict').env})", f"  mode     {rep['mode']}"]
    if rep.get("config_error"):
        lines.append(f"  CONFIG ERROR: {rep['config_error']}")
    if rep.get("missing_prerequisites"):
        lines.append(f"  MISSING: {', '.join(rep['missing_prerequisites'])} (nothing imported or activated)")
    lines.append("")
    width = max(len(p["name"]) for p in rep["patches"]) if rep["patches"] else 10
    for p in rep["patches"]:
        check = {None: "", True: "  [verified live]", False: f"  [NO LONGER LIVE: {'; '.join(p['live_problems'])}]"}
        lines.append(f"{p['name']:<{width}}  {p['status']}{check[p['verified_live']]}")
        lines.append(f"{'':<{width}}  {p['summary']}")
        for t in p["targets"]:
            match_text = ("matches " + ", ".join(t["reference"]) if t["match"]
                          else "ABSENT" if t["fingerprint"] is None else "CHANGED")
            same = ", ".join(t["same_as_releases"]) or "no recorded release"
            lines.append(f"{'':<{width}}    {t['target']}: {match_text} (identical in: {same})")
        up = p["upstream"]
        since = f"upstream since {up['since']}" if up["since"] else "not upstream"
        equiv = "equivalent" if up["equivalent"] else "not equivalent"
        lines.append(f"{'':<{width}}  upstream {up['pr']}; {since} ({equiv}); retire when {up['retire_when']}")
    caches = rep.get("graph_caches") or {}
    lines += ["", "graph caches:" if caches else "graph caches: none in this process (run doctor inside the server, "
              "sglang_ext.tools.doctor.report(), to see a server's counters)"]
    lines += [f"  {name}: " + ", ".join(f"{k}={v}" for k, v in info.items() if k != "name")
              for name, info in sorted(caches.items())]
    lines.extend(_record_lines(rep))
    held = rep.get("import_messages") or []
    if held:
        lines += ["", f"printed by sglang / torch while the doctor imported them ({len(held)} lines, "
                  "not sglang-ext's; left out without --verbose):", *(f"  {line}" for line in held)]
    return "\n".join(lines) + "\n"


def _record_lines(rep: Dict[str, Any]) -> List[str]:
    lines = []
    for rec in rep.get("records", []):
        if "error" in rec:
            lines.append(f"record {rec['file']}: {rec['error']}")
            continue
        lines.append(f"record {rec['file']}: role={rec.get('role')} pid={rec.get('pid')} sglang={rec.get('sglang')}")
        for name, st in sorted(rec.get("patches", {}).items()):
            lines.append(f"    {name}: {st.get('status')}")
    return lines
