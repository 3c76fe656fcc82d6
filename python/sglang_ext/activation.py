"""Activation: decide, apply, verify, record. Explicit, never an import side effect.

`activate()` is re-entrant and idempotent per process. For every patch in the
registry it decides a status before touching anything:

    applied | armed (applies when <module> is imported) | disabled
    not needed (upstream has it since X) | skipped (<reason>) | failed: <reason>

A patch is applied whole or not at all: its parts run when their trigger module
is imported, each through a `PatchContext`; a part that raises or does not
verify rolls back every part of that patch. In strict mode every skip or
failure of a requested patch raises `SglangExtActivationError` (a
BaseException, so sglang's `except Exception` plugin loader cannot swallow it).
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from sglang_ext import fingerprint as fp
from sglang_ext.errors import ExtConfigError, SglangExtActivationError
from sglang_ext.knobs import Settings, load_settings
from sglang_ext.patching import PatchContext, when_imported
from sglang_ext.registry import PATCHES, PatchSpec
from sglang_ext.versions import SUPPORTED_SGLANG, at_least, installed_sglang_version

logger = logging.getLogger("sglang_ext")

APPLIED, ARMED, DISABLED, NOT_NEEDED, SKIPPED, FAILED = (
    "applied", "armed", "disabled", "not needed", "skipped", "failed")


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

    def as_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "status": str(self), "state": self.state, "detail": self.detail,
                "fingerprints": dict(self.fingerprints), "parts_applied": list(self.parts_applied),
                "parts_pending": list(self.parts_pending)}


class _ProcessState:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.activated = False
        self.settings: Optional[Settings] = None
        self.version: Optional[str] = None
        self.strict = False
        self.statuses: Dict[str, PatchStatus] = {}
        self.contexts: Dict[str, PatchContext] = {}


_state = _ProcessState()


def statuses() -> Dict[str, PatchStatus]:
    return dict(_state.statuses)


def is_active(name: str) -> bool:
    st = _state.statuses.get(name)
    return st is not None and st.state == APPLIED


def current_settings() -> Optional[Settings]:
    return _state.settings


def activate(
    *,
    environ: Optional[Mapping[str, str]] = None,
    force: bool = False,
    strict: Optional[bool] = None,
    eager: bool = False,
    source_root: Optional[str] = None,
    version: Optional[str] = None,
) -> Dict[str, PatchStatus]:
    """Apply every enabled patch in this process (idempotent).

    force: apply even if the master switch (SGLANG_EXT=1) is off (explicit API use).
    eager: import every trigger module now instead of waiting for sglang to import it.
    source_root / version: check fingerprints against another sglang tree (tests, doctor).
    """
    with _state.lock:
        if _state.activated:
            if eager:
                _import_triggers()
            return statuses()
        try:
            settings = load_settings(environ)
        except ExtConfigError as exc:
            # Bad input stops start-up whatever the mode: sglang would swallow a ValueError.
            raise SglangExtActivationError(f"sglang-ext configuration error: {exc}") from exc
        if not (settings.enabled or force):
            return {}
        _state.settings = settings
        _state.strict = settings.strict if strict is None else strict
        _state.activated = True
        _state.version = version or settings.assume_sglang or installed_sglang_version()
        for spec in PATCHES:
            _state.statuses[spec.name] = _decide(spec, settings, source_root)
        _report_skips()
        for spec in PATCHES:
            if _state.statuses[spec.name].state == ARMED:
                _arm(spec, settings)
        if eager:
            _import_triggers()
        _write_record()
        return statuses()


def deactivate() -> None:
    """Roll every applied patch back and forget the activation (tests, A/B benchmarks)."""
    with _state.lock:
        for ctx in _state.contexts.values():
            ctx.rollback()
        _state.contexts.clear()
        _state.statuses.clear()
        _state.activated = False
        _state.settings = None


def _decide(spec: PatchSpec, settings: Settings, source_root: Optional[str]) -> PatchStatus:
    st = PatchStatus(spec.name, ARMED)
    if spec.name in settings.disable:
        st.state = DISABLED
        return st
    version = _state.version
    if version is None:
        st.state, st.detail = SKIPPED, "sglang is not installed"
        return st
    if spec.upstream_equivalent and spec.upstream_since and at_least(version, spec.upstream_since):
        st.state, st.detail = NOT_NEEDED, f"upstream has it since {spec.upstream_since}"
        return st
    if version not in spec.supported and version not in SUPPORTED_SGLANG:
        st.state = SKIPPED
        st.detail = f"sglang {version} is not supported; supported: {', '.join(spec.supported)}"
        return st
    mismatched = []
    for target in spec.targets:
        live = fp.fingerprint(target.module, target.qualname, source_root)
        expected = {fp.reference_table(v).get(target.key) for v in spec.supported}
        ok = live is not None and live in expected
        st.fingerprints[target.key] = ok
        if not ok:
            mismatched.append(target.key + (" (absent)" if live is None else ""))
    if mismatched:
        st.state = SKIPPED
        st.detail = (f"fingerprint mismatch on sglang {version}: {', '.join(mismatched)}; "
                     f"written for {', '.join(spec.supported)}")
        return st
    st.parts_pending = [p.trigger_module for p in spec.parts]
    st.detail = "applies when " + ", ".join(st.parts_pending) + " is imported"
    return st


def _report_skips() -> None:
    problems = []
    for st in _state.statuses.values():
        if st.state == SKIPPED:
            logger.warning("sglang-ext: patch %s skipped: %s", st.name, st.detail)
            problems.append(f"{st.name}: {st.detail}")
    if problems and _state.strict:
        raise SglangExtActivationError("sglang-ext strict mode: " + "; ".join(problems))


def _arm(spec: PatchSpec, settings: Settings) -> None:
    ctx = PatchContext(spec.name, settings)
    _state.contexts[spec.name] = ctx
    for part in spec.parts:
        when_imported(part.trigger_module, _part_runner(spec, part, ctx))


def _part_runner(spec: PatchSpec, part, ctx: PatchContext):
    def run(module: Any) -> None:
        st = _state.statuses[spec.name]
        if st.state not in (ARMED,):
            return  # an earlier part failed: the patch stays off whole
        before = len(ctx.swaps)
        try:
            mod_name, fn_name = part.function.split(":")
            fn = getattr(importlib.import_module(mod_name), fn_name)
            fn(ctx, module)
            problems = ctx.problems()
            if len(ctx.swaps) == before:
                problems.append(f"{part.function} changed nothing")
            if problems:
                raise RuntimeError("; ".join(problems))
        except Exception as exc:  # noqa: BLE001 - we re-raise as BaseException in strict mode
            ctx.rollback()
            st.state, st.detail = FAILED, f"{part.function}: {type(exc).__name__}: {exc}"
            st.parts_applied.clear()
            logger.error("sglang-ext: patch %s failed and was rolled back: %s", spec.name, st.detail)
            _write_record()
            if _state.strict:
                raise SglangExtActivationError(f"sglang-ext strict mode: patch {spec.name} {st}") from exc
            return
        st.parts_pending.remove(part.trigger_module)
        st.parts_applied.append(part.trigger_module)
        if not st.parts_pending:
            st.state, st.detail = APPLIED, ""
        else:
            st.detail = "applies when " + ", ".join(st.parts_pending) + " is imported"
        _write_record()

    return run


def _import_triggers() -> None:
    for st in list(_state.statuses.values()):
        for module in list(st.parts_pending):
            importlib.import_module(module)


def process_role() -> str:
    name = multiprocessing.current_process().name
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name) or "process"


def _write_record() -> None:
    settings = _state.settings
    directory = settings.activation_dir if settings is not None else ""
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{process_role()}-{os.getpid()}.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"pid": os.getpid(), "role": process_role(), "argv0": sys.argv[0] if sys.argv else "",
                   "sglang": _state.version, "patches": {k: v.as_dict() for k, v in _state.statuses.items()}},
                  f, indent=1, sort_keys=True)
    os.replace(tmp, path)
