"""Activation: decide, apply, verify, record. Explicit, never an import side effect.

`activate()` is idempotent per process. It decides every patch's status before touching anything
(applied, armed, disabled, not needed, skipped, failed). A patch is applied whole or not at all:
its parts run when their trigger module is imported, and a part that raises or does not verify
rolls back the whole patch. Strict mode turns every skip or failure into
`SglangExtActivationError`; bad configuration raises it in every mode.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import os
import sys
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from sglang_ext import fingerprint as fp, knobs
from sglang_ext.errors import ExtConfigError, SglangExtActivationError
from sglang_ext.knobs import MASTER_ENV, Settings, knob, knob_enabled, load_settings
from sglang_ext.patching import PatchContext, cancel_trigger, when_imported
from sglang_ext.registry import PATCHES, PatchSpec, Target, resolve
from sglang_ext.versions import (SUPPORTED_RANGE, SUPPORTED_SGLANG, at_least, installed_sglang_path,
                                 installed_sglang_version, release as _release, source_tree_version,
                                 unsupported_message, version_key, within_supported_range)

logger = logging.getLogger("sglang_ext")

APPLIED, ARMED, DISABLED, NOT_NEEDED, SKIPPED, FAILED = (
    "applied", "armed", "disabled", "not needed", "skipped", "failed")
NOT_PORTED = "not ported to sglang"  # a skip the registry declares (not a problem, even in strict mode)


@dataclass
class PatchStatus:
    name: str
    state: str
    detail: str = ""
    fingerprints: Dict[str, bool] = field(default_factory=dict)  # target -> matches reference
    parts_applied: List[str] = field(default_factory=list)
    parts_pending: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        if self.state in (APPLIED, DISABLED):
            return self.state
        if self.state == FAILED:
            return f"failed: {self.detail}"
        return f"{self.state} ({self.detail})"

    @property
    def unported(self) -> bool:
        return self.state == SKIPPED and self.detail.startswith(NOT_PORTED)


class _ProcessState:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.generation = 0  # bumped by deactivate(): callbacks of an older activation do nothing
        self.reset()

    def reset(self) -> None:
        self.settings: Optional[Settings] = None  # None: not activated
        self.version: Optional[str] = None
        self.strict = False
        self.statuses: Dict[str, PatchStatus] = {}
        self.contexts: Dict[str, PatchContext] = {}
        self.triggers: List[Tuple[str, Callable[[Any], None]]] = []  # (module, callback) not yet fired


_state = _ProcessState()


def statuses() -> Dict[str, PatchStatus]:
    return dict(_state.statuses)


def current_settings() -> Optional[Settings]:
    return _state.settings


def is_strict() -> bool:
    return _state.strict


def activated_version() -> Optional[str]:
    return _state.version


def activate(*, environ: Optional[Mapping[str, str]] = None, force: bool = False, strict: Optional[bool] = None,
             eager: bool = False, source_root: Optional[str] = None, version: Optional[str] = None
             ) -> Dict[str, PatchStatus]:
    """Apply every enabled patch in this process (idempotent). force: even if SGLANG_EXT is off;
    strict: override the knob; eager: import every trigger module now; source_root / version: check
    another sglang tree."""
    with _state.lock:
        if _state.settings is not None:  # activated already
            if eager:
                _import_triggers()
            return statuses()
        env = os.environ if environ is None else environ
        if carried := sglang_carries_sglang_ext():
            logger.info("sglang-ext: %s is patched with the fork series and activates its own copy; "
                        "the installed plugin stands aside", carried)
            return {}
        try:
            if not (force or knob_enabled(env)):
                return {}  # installed but not enabled: touch nothing, validate nothing else
            settings = load_settings(env)
        except ExtConfigError as exc:
            # Bad input stops start-up whatever the mode: sglang would swallow a ValueError.
            raise SglangExtActivationError(f"sglang-ext configuration error: {exc}") from exc
        _state.settings = settings
        knobs.use(settings)
        _state.strict = settings.strict if strict is None else strict
        _state.version = resolve_version(settings, source_root, version)
        _state.statuses = plan(settings, version=_state.version, source_root=source_root)
        try:
            _report_refusals(source_root)
        finally:
            _write_record()
        for spec in PATCHES:
            if _state.statuses[spec.name].state == ARMED:
                _arm(spec, settings)
        if eager:
            _import_triggers()
        _write_record()
        _log_startup()
        return statuses()


def sglang_carries_sglang_ext() -> Optional[str]:
    """The importable sglang's directory when it vendors sglang-ext (the fork series), unless this is that copy."""
    if __name__.startswith("sglang."):
        return None
    path = installed_sglang_path()
    return path if path and os.path.exists(os.path.join(path, "ext", "activation.py")) else None


def deactivate() -> None:
    """Roll every applied patch back and forget the activation (tests, A/B benchmarks)."""
    with _state.lock:
        _state.generation += 1
        for module_name, callback in _state.triggers:
            cancel_trigger(module_name, callback)
        for ctx in reversed(list(_state.contexts.values())):
            ctx.rollback()
        _state.reset()
        knobs.use(None)


def verify_applied() -> Dict[str, List[str]]:
    """Re-check that every swap of every (partly) applied patch is still live (for `doctor`)."""
    return {name: _state.contexts[name].problems() for name, st in _state.statuses.items()
            if name in _state.contexts and st.parts_applied}


def resolve_version(settings: Optional[Settings], source_root: Optional[str] = None,
                    version: Optional[str] = None) -> Optional[str]:
    """The sglang version to check against: explicit > SGLANG_EXT_ASSUME_SGLANG > tree > installed."""
    if version:
        return version
    if settings is not None and settings.assume_sglang:
        return settings.assume_sglang
    if source_root is not None:
        return source_tree_version(source_root)
    installed = installed_sglang_version()
    if installed is None and (path := installed_sglang_path()) is not None:
        # an sglang without dist metadata (an unpacked wheel): its _version.py says which release
        return source_tree_version(os.path.dirname(path))
    return installed


def plan(settings: Settings, *, version: Optional[str], source_root: Optional[str] = None
         ) -> Dict[str, PatchStatus]:
    """Decide every patch's status without touching anything (doctor uses this too)."""
    decided = {spec.name: _decide(spec, settings, version, source_root) for spec in PATCHES}
    _check_requirements(decided, settings)
    return decided


_GOING = (ARMED, APPLIED, NOT_NEEDED)


def _check_requirements(decided: Dict[str, PatchStatus], settings: Settings) -> None:
    """Skip every going patch whose requirement is not going (transitively: registry order is not relied on)."""
    changed = True
    while changed:
        changed = False
        for spec in PATCHES:
            st = decided[spec.name]
            for req in spec.requires:
                needed = decided[req.patch]
                knobs_set = [knob(k) for k in req.when_knobs if settings.values[k] != knob(k).default]
                if st.state not in _GOING or needed.state in _GOING or (req.when_knobs and not knobs_set):
                    continue
                envs = ", ".join(k.env for k in knobs_set)
                st.state = SKIPPED
                st.detail = (f"requires patch {req.patch}{f' while {envs} is set' if envs else ''}, which is "
                             f"{needed.state}; allowed: enable {req.patch}, or list {spec.name} in "
                             f"{knob('disable').env} too{f', or unset {envs}' if envs else ''}")
                st.parts_pending, st.parts_applied = [], []
                changed = True


def _decide(spec: PatchSpec, settings: Settings, version: Optional[str], source_root: Optional[str]) -> PatchStatus:
    if spec.name in settings.disable:
        return PatchStatus(spec.name, DISABLED, f"listed in {knob('disable').env}")
    if version is None:
        return PatchStatus(spec.name, SKIPPED, f"no sglang version found in {source_root}/sglang/_version.py; give "
                           f"one with {knob('assume_sglang').env}" if source_root else "sglang is not installed")
    if spec.upstream_equivalent and spec.upstream_since and at_least(version, spec.upstream_since):
        return PatchStatus(spec.name, NOT_NEEDED, f"upstream has it since {spec.upstream_since}")
    if not within_supported_range(version):
        return PatchStatus(spec.name, SKIPPED, unsupported_message(version))
    if _release(version) in SUPPORTED_SGLANG and _release(version) not in spec.supported:
        return PatchStatus(spec.name, SKIPPED, f"{NOT_PORTED} {_release(version)} yet; it applies on "
                           f"sglang {', '.join(spec.supported)}")
    st = PatchStatus(spec.name, ARMED)
    unrecorded = "no reference fingerprint recorded for "
    failing: Dict[str, List[str]] = {"fingerprint changed: ": [], "target absent: ": [], unrecorded: []}
    checked = set()
    for target in spec.targets:
        name, live, references = check_target(spec, target, version, source_root)
        checked.update(references)
        expected = set(references.values()) - {None}
        st.fingerprints[name] = ok = live is not None and live in expected
        if not ok:
            why = "target absent: " if live is None else "fingerprint changed: " if expected else unrecorded
            failing[why].append(name)
    reasons = [what + ", ".join(keys) for what, keys in failing.items() if keys]
    if reasons:
        st.state = SKIPPED
        st.detail = ("; ".join(reasons) + f" -- checked sglang {version}"
                     + (f" at {source_root}" if source_root else "")
                     + f" against the reference of sglang {', '.join(sorted(checked, key=version_key))}")
        if failing[unrecorded]:
            st.detail += "; regenerate the tables: python scripts/gen_fingerprints.py"
        return st
    st.parts_pending = [resolve(p.trigger_module, version) for p in spec.parts_on(version)]
    st.detail = _pending_detail(st)
    return st


def check_target(spec: PatchSpec, target: Target, version: Optional[str], source_root: Optional[str]) -> tuple:
    """(`target` as `version` names it, its fingerprint there or None, {release: the fingerprint it may have})."""
    name = target.key_in(version)
    releases = target.reference_releases(spec.supported, _release(version) if version else None)
    return name, fp.fingerprint_key(name, source_root), {v: fp.reference_table(v).get(target.key) for v in releases}


def _pending_detail(st: PatchStatus) -> str:
    verb = "is" if len(st.parts_pending) == 1 else "are"
    return f"applies when {', '.join(st.parts_pending)} {verb} imported"


def _report_refusals(source_root: Optional[str]) -> None:
    """One warning per skipped patch (one for an unsupported sglang); strict mode raises the same text."""
    # a declared skip (not ported to this release) is in the start-up line and the doctor, not a warning
    skipped = [st for st in _state.statuses.values() if st.state == SKIPPED and not st.unported]
    if not skipped:
        return
    version = _state.version
    unsupported = version is not None and not within_supported_range(version)
    if unsupported:
        where = source_root or installed_sglang_path() or "?"
        assume = knob("assume_sglang").env
        if _state.settings is not None and _state.settings.assume_sglang == version:
            advice = (f"{assume}={version} is set and names that release: unset it, or set it to a "
                      f"supported release only for a source build of that release.")
        else:
            advice = (f"Install a supported sglang, set {assume}=<version> for a source build of a "
                      f"supported release (fingerprints are still checked), or unset {MASTER_ENV}.")
        problems = [f"{unsupported_message(version, where)} ({SUPPORTED_RANGE}). Nothing was applied "
                    f"(skipped: {', '.join(st.name for st in skipped)}). {advice}"]
    else:
        problems = [f"patch {st.name} skipped: {st.detail}" for st in skipped]
    if _state.strict:
        raise SglangExtActivationError("sglang-ext strict mode (" + knob("strict").env + "=1): " + "; ".join(problems))
    if unsupported:  # one message covers every patch
        logger.warning("sglang-ext: %s", problems[0])
        return
    for st in skipped:
        logger.warning("sglang-ext: patch %s skipped, nothing of it applied: %s", st.name, st.detail)


def startup_line() -> str:
    """This process's activation in one line: role, pid, sglang version, patches by state."""
    groups = []
    for state in (APPLIED, ARMED, NOT_NEEDED, DISABLED, SKIPPED, FAILED):
        names = [st.name for st in _state.statuses.values() if st.state == state]
        if names:
            groups.append(f"{state} {', '.join(names)}"
                          + (" (each applies when sglang imports its module)" if state == ARMED else ""))
    return (f"sglang-ext: on in {process_role()} pid {os.getpid()}, sglang {_state.version or '?'}"
            f"{', strict' if _state.strict else ''}: " + "; ".join(groups))


def _log_startup() -> None:
    # sglang configures logging only after load_plugins(): without a handler yet, go to stderr.
    if logger.hasHandlers():
        logger.info("%s", startup_line())
    else:
        logging.StreamHandler(sys.stderr).handle(
            logger.makeRecord(logger.name, logging.INFO, __file__, 0, "%s", (startup_line(),), None))


def _arm(spec: PatchSpec, settings: Settings) -> None:
    ctx = PatchContext(spec.name, settings)
    _state.contexts[spec.name] = ctx
    for part in spec.parts_on(_state.version):
        module = resolve(part.trigger_module, _state.version)
        callback = _part_runner(spec, part, module, ctx, _state.generation)
        _state.triggers.append((module, callback))
        when_imported(module, callback)


def _fail(spec: PatchSpec, ctx: PatchContext, st: PatchStatus, detail: str,
          cause: Optional[BaseException]) -> None:
    """Roll the whole patch back, record the failure, abort in strict mode."""
    ctx.rollback()
    st.state, st.detail = FAILED, detail
    st.parts_applied.clear()
    st.parts_pending.clear()
    logger.error("sglang-ext: patch %s failed and was rolled back (nothing of it applied): %s", spec.name, detail)
    _write_record()
    if _state.strict:
        raise SglangExtActivationError(f"sglang-ext strict mode: patch {spec.name} {st}") from cause
    # Non-strict: patches that need this one go off with it (rolled back if already applied).
    was = {name: dst.state for name, dst in _state.statuses.items()}
    _check_requirements(_state.statuses, _state.settings)
    for name, dst in _state.statuses.items():
        if was[name] in (ARMED, APPLIED) and dst.state == SKIPPED:
            if name in _state.contexts:
                _state.contexts[name].rollback()
            logger.warning("sglang-ext: patch %s skipped, nothing of it applied: %s", name, dst.detail)
    _write_record()


def _part_runner(spec: PatchSpec, part, trigger: str, ctx: PatchContext, generation: int):
    def run(module: Any) -> None:
        if generation != _state.generation:
            return  # armed by an activation that was deactivated since
        st = _state.statuses[spec.name]
        if st.state != ARMED:
            return  # an earlier part failed: the patch stays off whole
        _state.triggers = [t for t in _state.triggers if t[1] is not run]
        before = len(ctx.swaps)
        try:
            mod_name, fn_name = part.function.split(":")
            fn = getattr(importlib.import_module(mod_name), fn_name)
            fn(ctx, module)
            problems = ctx.problems()
            if len(ctx.swaps) == before:
                problems.append(f"{part.function} changed nothing")
            if problems:
                raise RuntimeError("verification failed: " + "; ".join(problems))
        except BaseException as exc:  # noqa: BLE001 - rolled back here, re-raised (strict or not ours)
            _fail(spec, ctx, st, f"{part.function} on {trigger}: {type(exc).__name__}: {exc}", exc)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit, a nested strict abort
            return
        st.parts_pending.remove(trigger)
        st.parts_applied.append(trigger)
        if not st.parts_pending:
            st.state, st.detail = APPLIED, ""
            logger.info("sglang-ext: patch %s applied", spec.name)
        else:
            st.detail = _pending_detail(st)
        _write_record()

    return run


def _import_triggers() -> None:
    """Import every pending trigger module now (doctor, tests); an import error fails its patch."""
    for spec in PATCHES:
        st = _state.statuses[spec.name]
        for module in list(st.parts_pending):
            if st.state != ARMED:
                break
            try:
                importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 - becomes a failed patch (abort in strict mode)
                _fail(spec, _state.contexts[spec.name], st, f"cannot import {module}: {type(exc).__name__}: {exc}", exc)


def process_role() -> str:
    name = multiprocessing.current_process().name
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name) or "process"


def record() -> Dict[str, Any]:
    """This process's activation record (what `SGLANG_EXT_ACTIVATION_DIR` files hold)."""
    return {"pid": os.getpid(), "role": process_role(), "argv0": sys.argv[0] if sys.argv else "",
            "sglang": _state.version, "strict": _state.strict,
            "patches": {k: {**asdict(v), "status": str(v)} for k, v in _state.statuses.items()}}


def _write_record() -> None:
    directory = _state.settings.activation_dir if _state.settings is not None else ""
    if not directory:
        return
    path = os.path.join(directory, f"{process_role()}-{os.getpid()}.json")
    tmp = path + ".tmp"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record(), f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:  # a diagnostics file must never stop a server
        logger.warning("sglang-ext: cannot write activation record %s: %s", path, exc)
