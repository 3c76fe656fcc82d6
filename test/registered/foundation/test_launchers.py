"""`python -m sglang_ext.launch_server` / `python -m sglang_ext.serve`: --ext-* flags are split off,
validated before sglang starts, exported to the environment, and sglang gets the rest unchanged."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from sglang_ext import activation
from sglang_ext.tools import launcher
from sglang_ext.knobs import KNOBS, MASTER_ENV, load_settings
from sglang_ext.tools.launcher import interpreter
from sglang_ext.registry import PATCH_NAMES

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

from conftest import plugin_only  # noqa: E402

ALL_PATCHES = ",".join(PATCH_NAMES)


@pytest.fixture
def clean_env():
    """No sglang-ext variables before the test; the environment is restored after it."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n == MASTER_ENV or n.startswith("SGLANG_EXT_")]:
        del os.environ[name]
    activation.deactivate()
    yield os.environ
    activation.deactivate()
    os.environ.clear()
    os.environ.update(saved)


def main_without_gpu_check(argv, prog, handover):
    """The launcher's argument handling on this CPU machine (the CUDA check is tested below)."""
    return launcher.main(argv, prog, handover, require_cuda=False)


class Handover:
    """Records the argv the launcher hands to sglang's entry point."""

    def __init__(self):
        self.calls = []

    def __call__(self, argv):
        self.calls.append(list(argv))


def test_split_keeps_sglang_arguments_in_order():
    values, rest = launcher.split_ext_args([
        "--model-path", "Qwen/Qwen2.5-VL-7B-Instruct", "--ext-strict", "--tp", "2",
        "--ext-vit-graph-max-entries", "4", "--ext-vit-graph-policy=exact",
        "--ext-pi05-prefix-graph-max-entries", "-1", "--enable-multimodal",
    ])
    assert rest == ["--model-path", "Qwen/Qwen2.5-VL-7B-Instruct", "--tp", "2", "--enable-multimodal"]
    assert values == {"strict": "1", "vit_graph_max_entries": "4", "vit_graph_policy": "exact",
                      "pi05_prefix_graph_max_entries": "-1"}


def test_bare_boolean_flag_never_swallows_the_next_argument():
    values, rest = launcher.split_ext_args(["--ext-strict", "Qwen/Qwen2.5-VL-7B-Instruct", "--ext-pi05-fast=0"])
    assert values == {"strict": "1", "pi05_fast": "0"}
    assert rest == ["Qwen/Qwen2.5-VL-7B-Instruct"]  # `sglang serve <model>` positional survives


@pytest.mark.parametrize("argv, names", [
    (["--ext-strit"], ["--ext-strit", "did you mean --ext-strict", "allowed: --ext-strict"]),
    (["--ext-vit-graph-max-entries"], ["--ext-vit-graph-max-entries needs a value", "integers >= 0"]),
    (["--ext-vit-graph-max-entries", "--tp", "2"], ["--ext-vit-graph-max-entries needs a value"]),
    (["--ext-strict", "--ext-strict=0"], ["--ext-strict given more than once"]),
    (["--ext-vit-graph-max-entries=many"], ["--ext-vit-graph-max-entries", "SGLANG_EXT_VIT_GRAPH_MAX_ENTRIES",
                                            "'many' is not an integer", "allowed"]),
    (["--ext-vit-graph-min-hits=0"], ["--ext-vit-graph-min-hits", "below the minimum", ">= 1"]),
    (["--ext-vit-graph-policy", "fifo"], ["--ext-vit-graph-policy", "'fifo'", "allowed: lru, exact"]),
    (["--ext-strict=maybe"], ["--ext-strict", "allowed: 1/0"]),
    (["--ext-disable=vit_cuda_graph,no_such_patch"], ["--ext-disable", "no_such_patch",
                                                       "allowed: " + ", ".join(PATCH_NAMES)]),
    (["--ext-pi05-prompt-token-buckets=64,32"], ["--ext-pi05-prompt-token-buckets", "strictly increasing"]),
    (["--ext-pi05-prompt-token-buckets=32,64,64"], ["--ext-pi05-prompt-token-buckets", "'32,64,64'",
                                                    "strictly increasing and unique"]),
    (["--ext-vit-graph-mode=bucket", "--ext-vit-graph-token-buckets=512,512"],
     ["--ext-vit-graph-token-buckets", "'512,512'", "strictly increasing and unique"]),
    (["--ext-vit-graph-mode=bucket", "--ext-vit-graph-token-buckets=256,1001"],
     ["--ext-vit-graph-token-buckets", "1001 not a multiple of 4", "allowed: comma-separated positive multiples"]),
    (["--ext-vit-graph-mode=layout", "--ext-vit-graph-token-buckets=256,512"],
     ["--ext-vit-graph-token-buckets", "only used with", "--ext-vit-graph-mode bucket", "'layout'"]),
    (["--ext-vit-graph-mode=class", "--ext-vit-graph-replay-max-tokens=4096"],
     ["--ext-vit-graph-replay-max-tokens", "only used with", "--ext-vit-graph-mode bucket", "'class'"]),
    (["--ext-vit-graph-mode=layout", "--ext-vit-graph-above-ladder=split"],
     ["--ext-vit-graph-above-ladder", "only used with", "--ext-vit-graph-mode bucket", "'layout'"]),
])
def test_bad_flags_exit_2_naming_the_flag_and_what_is_allowed(clean_env, capsys, argv, names):
    handover = Handover()
    status = main_without_gpu_check(["--model-path", "m", *argv], "prog", handover)
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("prog: error: ")
    for text in names:
        assert text in err
    assert handover.calls == []  # sglang never started
    assert MASTER_ENV not in os.environ and activation.statuses() == {}


@pytest.mark.parametrize("value", ["2", "maybe", "yes", "true", "off"])
def test_master_switch_other_than_0_or_1_is_rejected_by_the_real_launcher(value):
    """The launcher sets SGLANG_EXT=1 itself; an inherited typo must not slip past it to the no-GPU line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_EXT")}
    proc = subprocess.run([sys.executable, "-m", "sglang_ext.launch_server", "--model-path", "m"],
                          env={**env, MASTER_ENV: value}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == (f"python -m sglang_ext.launch_server: error: {MASTER_ENV}: {value!r} is not allowed; "
                           "allowed: 1 or 0\n")


BUCKET_ONLY_ALLOWED = "allowed: {unset}, or set the mode to bucket"
LAUNCHER = "python -m sglang_ext.launch_server: error: "


@pytest.mark.parametrize("argv, env, line", [
    (["--ext-vit-graph-mode", "layout", "--ext-vit-graph-replay-max-tokens", "4096"], {},
     "--ext-vit-graph-replay-max-tokens / SGLANG_EXT_VIT_GRAPH_REPLAY_MAX_TOKENS: only used with "
     "--ext-vit-graph-mode bucket (mode is 'layout'); " + BUCKET_ONLY_ALLOWED.format(unset="leave it at -1")),
    (["--ext-vit-graph-mode=class", "--ext-vit-graph-above-ladder", "split"], {},
     "--ext-vit-graph-above-ladder / SGLANG_EXT_VIT_GRAPH_ABOVE_LADDER: only used with --ext-vit-graph-mode "
     "bucket (mode is 'class'); " + BUCKET_ONLY_ALLOWED.format(unset="leave it at eager")),
    ([], {"SGLANG_EXT_VIT_GRAPH_MODE": "layout", "SGLANG_EXT_VIT_GRAPH_ABOVE_LADDER": "split"},
     "--ext-vit-graph-above-ladder / SGLANG_EXT_VIT_GRAPH_ABOVE_LADDER: only used with --ext-vit-graph-mode "
     "bucket (mode is 'layout'); " + BUCKET_ONLY_ALLOWED.format(unset="leave it at eager")),
    ([], {MASTER_ENV: "yes"}, "SGLANG_EXT: 'yes' is not allowed; allowed: 1 or 0"),
    (["--ext-activation-dir", "/proc/sglang-ext-records"], {},
     "--ext-activation-dir / SGLANG_EXT_ACTIVATION_DIR: cannot create folder '/proc/sglang-ext-records' ("),
])
def test_configuration_errors_exit_2_in_one_line_before_the_gpu_check(argv, env, line):
    """The real launcher on this machine: a bad setting is reported, not hidden behind "no CUDA GPU" (exit 1)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_EXT")}
    proc = subprocess.run([sys.executable, "-m", "sglang_ext.launch_server", "--model-path", "m", *argv],
                          env={**base, **env}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith(LAUNCHER + line), proc.stderr
    if "activation-dir" not in line:
        assert proc.stderr == LAUNCHER + line + "\n"
    else:
        assert proc.stderr.endswith("); allowed: a folder this user can write\n"), proc.stderr


def test_bucket_only_knobs_at_their_defaults_are_accepted_in_every_mode(clean_env):
    for mode in ("layout", "class", "bucket"):
        argv = [f"--ext-vit-graph-mode={mode}", "--ext-vit-graph-replay-max-tokens=-1",
                "--ext-vit-graph-above-ladder=eager", "--ext-vit-graph-token-buckets=",
                "--ext-pi05-fast", f"--ext-disable={ALL_PATCHES}"]
        assert main_without_gpu_check(["--model-path", "m", *argv], "prog", Handover()) == 0, mode
        activation.deactivate()


INT_KNOBS = [k for k in KNOBS if k.kind == "int"]


def test_every_int_knob_declares_a_minimum():
    assert INT_KNOBS and [k.name for k in INT_KNOBS if k.minimum is None] == []


@pytest.mark.parametrize("k", INT_KNOBS, ids=lambda k: k.name)
def test_int_knob_below_its_minimum_exits_2_and_at_it_is_accepted(clean_env, capsys, monkeypatch, k):
    """Every int knob at its minimum - 1 (flag, then inherited variable): one line naming it, exit 2,
    before the GPU check; at its minimum it starts."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a configuration error must come first
    line = (f"prog: error: {k.flag} / {k.env}: {k.minimum - 1} is below the minimum; "
            f"allowed: integers >= {k.minimum}\n")
    handover = Handover()
    assert launcher.main(["--model-path", "m", k.flag, str(k.minimum - 1)], "prog", handover) == 2
    assert capsys.readouterr().err == line
    clean_env[k.env] = str(k.minimum - 1)
    assert launcher.main(["--model-path", "m"], "prog", handover) == 2
    assert capsys.readouterr().err == line
    assert handover.calls == [] and MASTER_ENV not in os.environ
    del clean_env[k.env]
    disable = f"--ext-disable={ALL_PATCHES}"
    assert main_without_gpu_check(["--model-path", "m", disable, k.flag, str(k.minimum)], "prog", handover) == 0
    assert clean_env[k.env] == str(k.minimum)  # exported: the next launch inherits it
    activation.deactivate()
    assert main_without_gpu_check(["--model-path", "m", disable], "prog", handover) == 0
    assert handover.calls == [["--model-path", "m"]] * 2


def test_master_switch_0_inherited_is_accepted_and_switched_on(clean_env):
    clean_env[MASTER_ENV] = "0"
    assert main_without_gpu_check(["--model-path", "m", f"--ext-disable={ALL_PATCHES}"], "prog", Handover()) == 0
    assert clean_env[MASTER_ENV] == "1"


@pytest.mark.parametrize("where, reason", [
    ("{file}", "is a file, not a folder"),
    ("{file}/records", "cannot create folder"),
    ("/proc/sglang-ext-records", "cannot create folder"),
])
def test_activation_dir_that_cannot_be_written_exits_2_before_sglang(clean_env, capsys, tmp_path, where, reason):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    path = where.format(file=a_file)
    handover = Handover()
    status = main_without_gpu_check(["--model-path", "m", "--ext-activation-dir", path], "prog", handover)
    err = capsys.readouterr().err
    assert status == 2 and handover.calls == [] and activation.statuses() == {}
    assert err.count("\n") == 1 and err.startswith("prog: error: --ext-activation-dir / SGLANG_EXT_ACTIVATION_DIR: ")
    assert repr(path) in err, err
    assert reason in err and "allowed: a folder this user can write" in err
    assert MASTER_ENV not in os.environ


def test_activation_dir_is_created_before_sglang_starts(clean_env, tmp_path):
    records = tmp_path / "new" / "records"
    handover = Handover()
    assert main_without_gpu_check(["--model-path", "m", f"--ext-disable={ALL_PATCHES}",
                                   "--ext-activation-dir", str(records)], "prog", handover) == 0
    assert records.is_dir() and handover.calls == [["--model-path", "m"]]


def test_unknown_sglang_ext_environment_variable_is_rejected(clean_env, capsys):
    clean_env["SGLANG_EXT_VIT_GRAPH_MAX_ENTRIE"] = "3"  # typo of a knob's env spelling
    status = main_without_gpu_check(["--model-path", "m"], "prog", Handover())
    err = capsys.readouterr().err
    assert status == 2 and "SGLANG_EXT_VIT_GRAPH_MAX_ENTRIE" in err and "SGLANG_EXT_VIT_GRAPH_MAX_ENTRIES" in err


@plugin_only  # activates the installed plugin, which stands aside on a patched tree
def test_flags_are_exported_canonically_and_activation_runs_here(clean_env):
    handover = Handover()
    status = main_without_gpu_check([
        "--model-path", "m", "--ext-strict", f"--ext-disable={ALL_PATCHES}",
        "--ext-vit-graph-max-entries", "4", "--ext-pi05-prompt-token-buckets", "16, 32,64",
        "--ext-pi05-fast=off", "--port", "30001",
    ], "prog", handover)
    assert status == 0
    assert handover.calls == [["--model-path", "m", "--port", "30001"]]
    env = clean_env
    assert env[MASTER_ENV] == "1"
    assert env["SGLANG_EXT_STRICT"] == "1"
    assert env["SGLANG_EXT_DISABLE"] == ALL_PATCHES
    assert env["SGLANG_EXT_VIT_GRAPH_MAX_ENTRIES"] == "4"
    assert env["SGLANG_EXT_PI05_PROMPT_TOKEN_BUCKETS"] == "16,32,64"
    assert env["SGLANG_EXT_PI05_FAST"] == "0"
    assert "SGLANG_EXT_VIT_GRAPH_POLICY" not in env  # not given: the default applies, nothing exported
    # activated in the launcher process, with the flags' values
    assert {name: str(st) for name, st in activation.statuses().items()} == {n: "disabled" for n in PATCH_NAMES}
    assert activation.current_settings().vit_graph_max_entries == 4


def test_flags_override_inherited_environment(clean_env):
    clean_env["SGLANG_EXT_VIT_GRAPH_MAX_ENTRIES"] = "9"
    clean_env["SGLANG_EXT_VIT_GRAPH_POLICY"] = "exact"
    main_without_gpu_check([f"--ext-disable={ALL_PATCHES}", "--ext-vit-graph-max-entries=2"], "prog", Handover())
    assert clean_env["SGLANG_EXT_VIT_GRAPH_MAX_ENTRIES"] == "2"
    assert clean_env["SGLANG_EXT_VIT_GRAPH_POLICY"] == "exact"


def test_help_lists_every_knob_then_hands_help_to_sglang(clean_env, capsys):
    handover = Handover()
    assert main_without_gpu_check(["--help", "--ext-strict"], "python -m sglang_ext.serve", handover) == 0
    out = capsys.readouterr().out
    for k in KNOBS:
        assert k.flag in out and k.env in out, k.name
        assert k.help in out
    assert "default 32" in out  # vit_graph_max_entries
    assert handover.calls == [["--help"]]  # sglang prints its own arguments next
    assert activation.statuses() == {}  # --help activates nothing


# Benchmark results in a help text: a GPU model, a rate, a median, a speed-up factor, a relative change.
MEASUREMENT = re.compile(r"\b[A-H]\d{3}\b|req/s|\bmedians?\b|\d(\.\d+)?x\b|\bserver run\b|"
                         r"measured (slower|faster)|% (lower|higher|faster|slower)", re.IGNORECASE)


@pytest.mark.parametrize("k", KNOBS, ids=lambda k: k.name)
def test_knob_help_says_what_it_does_in_one_or_two_sentences(k):
    assert len(re.findall(r"[.!?](?:\s|$)", k.help)) <= 2, k.help
    assert not MEASUREMENT.search(k.help), k.help


@pytest.mark.parametrize("module, extra", [
    ("sglang_ext.launch_server", []),
    ("sglang_ext.serve", ["--model-type", "llm"]),
])
def test_real_handover_strips_ext_flags_before_sglang_parses(tmp_path, module, extra):
    """Runs the real entry points: sglang's own parser must see every argument except --ext-*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_EXT")}
    entry = {"sglang_ext.launch_server": "run_sglang_launch_server", "sglang_ext.serve": "run_sglang_serve"}[module]
    code = (f"import sys; import {module} as m; "
            f"sys.exit(m.main(sys.argv[1:], m.PROG, m.{entry}, require_cuda=False))")
    proc = subprocess.run(
        [sys.executable, "-c", code, "--ext-strict", f"--ext-disable={ALL_PATCHES}",
         "--ext-activation-dir", str(tmp_path), *extra, "--model-path", "m", "--not-an-sglang-flag"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: unrecognized arguments: --not-an-sglang-flag\n" in proc.stderr, proc.stderr[-2000:]
    records = list(tmp_path.glob("MainProcess-*.json"))  # written by the launcher's own activation
    assert len(records) == 1
    patches = json.loads(records[0].read_text())["patches"]
    assert {n: p["status"] for n, p in patches.items()} == {n: "disabled" for n in PATCH_NAMES}


def test_sglang_plugin_whitelist_without_sglang_ext_is_rejected(clean_env, capsys):
    clean_env["SGLANG_PLUGINS"] = "other_plugin"
    assert main_without_gpu_check(["--model-path", "m"], "prog", Handover()) == 2
    assert "SGLANG_PLUGINS='other_plugin' leaves out sglang_ext" in capsys.readouterr().err
    clean_env["SGLANG_PLUGINS"] = f"other_plugin, {launcher.PLUGIN_NAME}"
    assert main_without_gpu_check(["--model-path", "m", f"--ext-disable={ALL_PATCHES}"], "prog", Handover()) == 0


def test_plugin_name_is_the_registered_entry_point():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names.get(launcher.PLUGIN_NAME) == "sglang_ext.plugin:register"


@pytest.mark.parametrize("visible", [False, True])
def test_no_cuda_gpu_stops_before_sglang_in_one_line(clean_env, capsys, monkeypatch, visible):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible)  # the GPU is the only fake
    handover = Handover()
    status = launcher.main(["--model-path", "m", f"--ext-disable={ALL_PATCHES}"], "prog", handover)
    err = capsys.readouterr().err
    if visible:
        assert status == 0 and handover.calls == [["--model-path", "m"]]
        return
    assert status == 1 and handover.calls == []  # sglang never started
    assert err.count("\n") == 1 and err.startswith("prog: error: no CUDA GPU visible (torch ")
    assert "NVIDIA GPUs only" in err
    # what to run instead, with the interpreter it needs (the venv's, not whatever `python` is)
    assert err.endswith(f": {interpreter()} scripts/run_suite.py --suite base-a-test-cpu\n"), err
    assert MASTER_ENV not in os.environ and activation.statuses() == {}  # nothing exported or applied


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_real_launcher_on_a_cpu_machine_says_so_and_exits_nonzero():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_EXT")}
    proc = subprocess.run([sys.executable, "-m", "sglang_ext.launch_server", "--model-path", "m"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.startswith("python -m sglang_ext.launch_server: error: no CUDA GPU visible")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_help_into_a_closed_pipe_ends_without_a_traceback():
    """`launch_server --help | head -5`: the reader is gone while the help is being written.

    The read end is closed before the launcher starts, so the broken pipe is certain (a reader
    that leaves after one line races the writer whenever the help fits the pipe buffer).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_EXT")}
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "sglang_ext.launch_server", "--help"], env=env,
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 1


def test_help_starts_with_the_launchers_usage():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_EXT")}
    proc = subprocess.run([sys.executable, "-m", "sglang_ext.launch_server", "--help"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: python -m sglang_ext.launch_server")


@plugin_only  # activates the installed plugin, which stands aside on a patched tree
def test_strict_unsupported_assumed_version_says_it_once_without_suggesting_the_same_variable(
        clean_env, capsys, caplog):
    status = main_without_gpu_check(["--model-path", "m", "--ext-strict", "--ext-assume-sglang", "0.5.12"],
                                    "prog", Handover())
    err = capsys.readouterr().err
    assert status == 1
    assert err.count("sglang 0.5.12") == 1 and err.count("is not supported") == 1, err
    assert "SGLANG_EXT_ASSUME_SGLANG=0.5.12 is set" in err
    assert "set SGLANG_EXT_ASSUME_SGLANG=<version>" not in err
    assert not [r for r in caplog.records if "not supported" in r.getMessage()]  # not logged as well


@plugin_only  # activates the installed plugin, which stands aside on a patched tree
def test_one_startup_line_with_role_pid_version_and_patches(clean_env, caplog):
    caplog.set_level("INFO", logger="sglang_ext")
    assert main_without_gpu_check(["--model-path", "m", "--ext-disable=pi05_config"], "prog", Handover()) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sglang-ext: on in ")]
    assert len(lines) == 1 and caplog.records[-1].levelname == "INFO"
    line = lines[0]
    version = importlib.metadata.version("sglang")
    head, _, groups = line.partition(f", sglang {version}: ")
    assert head == f"sglang-ext: on in MainProcess pid {os.getpid()}"
    by_state = {}
    for group in groups.replace(" (each applies when sglang imports its module)", "").split("; "):
        state = next(s for s in ("not needed", "applied", "armed", "disabled", "skipped", "failed")
                     if group.startswith(s + " "))
        by_state[state] = group[len(state) + 1:].split(", ")
    # applied where an earlier test already imported the target module, armed otherwise; what the registry
    # declares for this release (not needed, not ported yet) as such
    assert by_state.pop("disabled") == ["pi05_config"]
    plan = activation.plan(load_settings({"SGLANG_EXT": "1"}), version=version)
    declared = {state: sorted(n for n, st in plan.items() if st.state == state) for state in ("not needed", "skipped")}
    assert sorted(by_state.pop("not needed", [])) == declared["not needed"]
    assert sorted(by_state.pop("skipped", [])) == declared["skipped"]
    assert set(by_state) <= {"applied", "armed"}
    assert sorted(sum(by_state.values(), [])) == sorted(
        n for n in PATCH_NAMES if n != "pi05_config" and plan[n].state == "armed")
