"""Shared logic of `python -m sglang_ext.launch_server` and `python -m sglang_ext.serve`, and the one line
that says which of sglang / torch this interpreter lacks (sglang-ext declares no dependencies).

The steps are in docs/how-it-works.md ("The launchers"). This module imports no sglang code, so
spawned children that re-import the launcher as `__mp_main__` pay nothing for it.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from sglang_ext.errors import ExtConfigError, SglangExtActivationError
from sglang_ext.knobs import FLAG_PREFIX, KNOBS, MASTER_ENV, Knob, knob, knob_enabled, load_settings

USAGE_EXIT = 2  # argparse's exit status for bad command lines
PLUGIN_NAME = "sglang_ext"  # entry-point name in setup.py; what SGLANG_PLUGINS filters on
NO_GPU_EXIT = 1  # the command line is fine; this machine cannot serve
SERVING_MODULES = ("sglang", "torch")  # what every launcher hands over to
# How to get an environment that has sglang and torch (README, Quick start).
HOW_TO_INSTALL = ("install sglang-ext into the environment that has sglang 0.5.17 and its torch "
                  "(pip install --no-deps .), or build the test environment from the sglang-ext clone: "
                  "bash scripts/install_cpu_env.sh")

_BY_FLAG: Dict[str, Knob] = {k.flag: k for k in KNOBS}


def missing_modules(names: Sequence[str]) -> List[str]:
    """The top-level modules of `names` that this interpreter cannot import (found, never imported)."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def interpreter() -> str:
    """This interpreter as a user would type it: relative to the working directory when below it."""
    exe = sys.executable or "python"
    try:
        rel = os.path.relpath(exe)
    except ValueError:  # another drive (Windows)
        return exe
    return exe if rel.startswith("..") else rel


def missing_message(missing: Sequence[str]) -> Optional[str]:
    """One line: which packages this interpreter lacks, and what to do (None: it lacks none)."""
    if not missing:
        return None
    names = " and ".join(missing) if len(missing) <= 2 else ", ".join(missing[:-1]) + " and " + missing[-1]
    return f"{names} {'is' if len(missing) == 1 else 'are'} not installed in {interpreter()}; {HOW_TO_INSTALL}"


def split_ext_args(argv: Sequence[str]) -> Tuple[Dict[str, str], List[str]]:
    """({knob name: raw value}, sglang's argv in order). `--ext-name value` or `--ext-name=value`; a
    bare boolean flag means true (a value only with `=`, so no sglang argument is swallowed).
    Raises ExtConfigError for unknown, valueless and repeated flags."""
    values: Dict[str, str] = {}
    rest: List[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith(FLAG_PREFIX):
            rest.append(arg)
            continue
        flag, has_value, inline = arg.partition("=")
        knob = _BY_FLAG.get(flag)
        if knob is None:
            close = difflib.get_close_matches(flag, list(_BY_FLAG), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ExtConfigError(f"unknown flag {flag}{hint}; allowed: {', '.join(_BY_FLAG)}")
        if knob.name in values:
            raise ExtConfigError(f"{flag} given more than once")
        if has_value:
            raw = inline
        elif knob.kind == "bool":
            raw = "1"
        elif i < len(argv) and not argv[i].startswith("--"):
            raw = argv[i]
            i += 1
        else:
            raise ExtConfigError(f"{flag} needs a value; {knob.allowed}")
        values[knob.name] = raw
    return values, rest


def env_text(knob: Knob, value) -> str:
    """Canonical environment spelling of a parsed value."""
    if knob.kind == "bool":
        return "1" if value else "0"
    if knob.kind in ("int_list", "name_list"):
        return ",".join(str(v) for v in value)
    return str(value)


def ext_environment(values: Mapping[str, str]) -> Dict[str, str]:
    """Environment entries to export for these flag values, validated with the inherited environment; creates
    the activation-record folder."""
    base = dict(os.environ)
    # The launcher sets SGLANG_EXT=1 itself; an inherited value it would overwrite must still be
    # one the children's plugin loader accepts, or it hides a typo (SGLANG_EXT=2).
    knob_enabled(base)
    updates = {MASTER_ENV: "1"}
    for name, raw in values.items():
        k = knob(name)
        updates[k.env] = env_text(k, k.parse(raw))
    settings = load_settings({**base, **updates})
    # sglang's loader runs only the entry points SGLANG_PLUGINS lists, when it is set: without
    # sglang_ext there, the srt scheduler processes would run unpatched.
    raw = base.get("SGLANG_PLUGINS", "")
    names = [n.strip() for n in raw.split(",") if n.strip()]
    if names and PLUGIN_NAME not in names:
        raise ExtConfigError(f"SGLANG_PLUGINS={raw!r} leaves out {PLUGIN_NAME}, so sglang would not load it in its "
                             f"scheduler processes; allowed: unset/empty, or a list that includes {PLUGIN_NAME}")
    if settings.activation_dir:
        prepare_activation_dir(settings.activation_dir)
    return updates


def prepare_activation_dir(directory: str) -> None:
    """Create the activation-record folder now, or raise ExtConfigError (the servers would only warn)."""
    k, allowed = knob("activation_dir"), "allowed: a folder this user can write"
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise k.error(f"{directory!r} is a file, not a folder; {allowed}")
    try:
        os.makedirs(directory, exist_ok=True)
        writable = os.access(directory, os.W_OK | os.X_OK)
    except OSError as exc:
        raise k.error(f"cannot create folder {directory!r} ({exc.strerror}); {allowed}") from None
    if not writable:
        raise k.error(f"folder {directory!r} is not writable; {allowed}")


def ext_help(prog: str) -> str:
    """The `--ext-*` section of `--help`, generated from KNOBS."""
    lines = [f"usage: {prog} <sglang arguments> [--ext-* flags]", "",
             "sglang-ext flags (each also settable as an environment variable, inherited by child",
             f"processes; the launcher sets {MASTER_ENV}=1). Boolean flags: bare = true, or =0/=1.", ""]
    for k in KNOBS:
        default = env_text(k, k.default) if k.default not in ((), "") else '""'
        allowed = "allowed: bare flag (true) or =1/0, =true/false, =yes/no, =on/off" if k.kind == "bool" else k.allowed
        lines += [f"  {k.flag}  (env {k.env}, default {default})", f"      {k.help}", f"      {allowed}"]
    lines.append("")
    return "\n".join(lines)


def no_cuda_message() -> Optional[str]:
    """Why this machine cannot serve (None when torch sees a CUDA GPU; no CUDA context is created)."""
    import torch

    if torch.cuda.is_available():
        return None
    build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return (f"no CUDA GPU visible (torch {torch.__version__}, {build}: torch.cuda.is_available() is False); "
            "sglang-ext serves on NVIDIA GPUs only. Without one you can run the CPU tests, in the "
            f"sglang-ext clone: {interpreter()} scripts/run_suite.py --suite base-a-test-cpu")


def fail(prog: str, problem: str, status: int = USAGE_EXIT) -> int:
    print(f"{prog}: error: {problem}", file=sys.stderr)
    return status


def _help(argv: Sequence[str], prog: str, handover: Callable[[List[str]], Optional[int]]) -> int:
    try:
        print(ext_help(prog))
        if missing := missing_message(missing_modules(SERVING_MODULES)):
            return fail(prog, missing)
        print("sglang's own arguments follow.\n", flush=True)
        return handover([a for a in argv if not a.startswith(FLAG_PREFIX)]) or 0
    except BrokenPipeError:
        # `--help | head`: the reader left. Point stdout at /dev/null so the flush at exit
        # does not raise again, and exit like other tools cut off by a closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def main(argv: Sequence[str], prog: str, handover: Callable[[List[str]], Optional[int]],
         *, require_cuda: bool = True) -> int:
    """Check, export, activate, then `handover(sglang_argv)`. Exit status: 2 for a bad flag or value
    or missing sglang / torch, 1 without a CUDA GPU (`require_cuda`), otherwise sglang's."""
    if any(a in ("-h", "--help") for a in argv):
        return _help(argv, prog, handover)
    try:  # every configuration check before the GPU check: a machine without one still hears about them
        values, rest = split_ext_args(argv)
        updates = ext_environment(values)
    except ExtConfigError as exc:
        return fail(prog, str(exc))
    if missing := missing_message(missing_modules(SERVING_MODULES)):
        return fail(prog, missing)
    if require_cuda and (problem := no_cuda_message()) is not None:
        return fail(prog, problem, NO_GPU_EXIT)
    os.environ.update(updates)
    from sglang_ext.activation import activate

    try:
        activate()
    except SglangExtActivationError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    return handover(rest) or 0
