"""`sglang-ext doctor`: the console script on the installed sglang 0.5.17, another tree, records,
and `sglang_ext.tools.doctor.report()` inside a process that runs patched code."""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import shutil
import subprocess
import sys
from contextlib import redirect_stdout

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from conftest import plugin_only
from activation_env import clean_activation  # noqa: F401  (autouse fixture)
from sglang_ext import activation
from sglang_ext.tools import cli, doctor
from sglang_ext.registry import PATCH_NAMES, PATCHES
from sglang_ext.knobs import load_settings
from sglang_ext.versions import SUPPORTED_SGLANG, at_least
from sglang_ext_testkit import internals

register_cpu_ci(est_time=45, suite="base-a-test-cpu")

pytestmark = plugin_only

STATES = {"applied", "armed", "disabled", "not needed", "skipped", "failed"}


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not (k == "SGLANG_EXT" or k.startswith("SGLANG_EXT_"))}
    env.update(extra)
    return env


def run_cli(*args):
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli.main(list(args))
    return rc, buf.getvalue()


def test_console_script_json_on_installed_sglang_proves_every_patch():
    """The default doctor run: activate strictly-reported in its own process, import every target."""
    exe = shutil.which("sglang-ext", path=os.path.dirname(sys.executable))
    assert exe, "console script sglang-ext is not installed next to this interpreter"
    proc = subprocess.run([exe, "doctor", "--json"], env=clean_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.stderr == ""  # what sglang and torch print on import is held back ...
    rep = json.loads(proc.stdout)
    assert isinstance(rep["import_messages"], list)  # ... into the report
    assert not any("sglang_ext" in line for line in rep["import_messages"])
    version = importlib.metadata.version("sglang")
    assert rep["sglang"]["version"] == version and version in SUPPORTED_SGLANG
    assert rep["sglang"]["path"].endswith(os.path.join("site-packages", "sglang"))
    assert rep["sglang"]["supported"] is True
    assert rep["torch"] == importlib.metadata.version("torch")
    assert rep["python"] == sys.version.split()[0]
    assert rep["mode"] == doctor.MODE_IMPORT
    assert [p["name"] for p in rep["patches"]] == list(PATCH_NAMES)
    unported = []
    for p in rep["patches"]:
        spec = next(s for s in PATCHES if s.name == p["name"])
        assert p["state"] in STATES and p["status"].startswith(p["state"])
        assert p["upstream"]["pr"] and p["supported"] == list(spec.supported)
        assert {t["target"] for t in p["targets"]} == {t.key for t in spec.targets}
        if spec.upstream_equivalent and at_least(version, spec.upstream_since or "99"):
            assert p["status"] == f"not needed (upstream has it since {spec.upstream_since})"
        elif version not in spec.supported:  # declared per release in the registry
            assert p["status"] == f"skipped (not ported to sglang {version} yet; it applies on sglang 0.5.17)"
            unported.append(p["name"])
        else:
            assert p["state"] == "applied", p["status"]
            assert all(t["match"] and version in t["same_as_releases"] for t in p["targets"]), p["targets"]
    assert rep["problems"] == [] and proc.returncode == 0, proc.stderr[-3000:]  # a declared skip is no problem


def test_other_tree_is_only_fingerprinted_and_its_problems_exit_1(released_tree, monkeypatch):
    tree = released_tree("0.5.12")
    rc, out = run_cli("doctor", "--json", "--source-root", tree)
    rep = json.loads(out)
    assert rc == 1
    assert rep["mode"] == doctor.MODE_FINGERPRINTS
    assert rep["sglang"]["version"] == "0.5.12" and rep["sglang"]["supported"] is False
    assert rep["sglang"]["path"] == os.path.join(tree, "sglang")
    states = {p["name"]: p["state"] for p in rep["patches"]}
    assert set(states.values()) <= {"skipped", "not needed"} and "skipped" in states.values()
    assert len(rep["problems"]) == list(states.values()).count("skipped")
    assert activation.statuses() == {}  # the doctor's look at another tree activated nothing here
    rc, out = run_cli("doctor", "--source-root", tree)  # the same problems in one line
    assert rc == 1 and out.count("\n") == 1
    assert out.startswith("sglang-ext: PROBLEM \u2014 sglang 0.5.12 is not supported; supported: 0.5.17, 0.5.23 (")
    assert out.endswith(" (details: sglang-ext doctor --verbose)\n")


def test_assumed_version_reports_changed_fingerprints_per_target(released_tree):
    tree = released_tree("0.5.12")
    rc, out = run_cli("doctor", "--verbose", "--source-root", tree, "--assume-version", "0.5.17")
    assert rc == 1
    assert out.startswith("sglang-ext: PROBLEM \u2014 vit_cuda_graph: skipped (")
    assert "CHANGED" in out or "ABSENT" in out
    for name in PATCH_NAMES:
        assert f"\n{name}" in out and "skipped (" in out


def test_python_dash_m_route_and_a_tree_without_version(tmp_path):
    (tmp_path / "sglang").mkdir()  # a source tree without sglang/_version.py
    proc = subprocess.run([sys.executable, "-m", "sglang_ext", "doctor", "--json", "--source-root", str(tmp_path)],
                          env=clean_env(SGLANG_EXT_STRICT="1"), capture_output=True, text=True, timeout=120)
    rep = json.loads(proc.stdout)
    assert proc.returncode == 1, proc.stderr
    expected = (f"skipped (no sglang version found in {tmp_path}/sglang/_version.py; "
                "give one with SGLANG_EXT_ASSUME_SGLANG)")
    assert {p["status"] for p in rep["patches"]} == {expected}


@pytest.mark.parametrize("argv, message", [
    (["doctor", "--source-root", "{tmp}/nothing-here"], "--source-root '{tmp}/nothing-here' is not a folder"),
    (["doctor", "--source-root", "{tmp}"], "--source-root '{tmp}' has no sglang/ folder"),
    (["doctor", "--records", "{tmp}/nothing-here"], "--records '{tmp}/nothing-here' is not a folder"),
])
def test_bad_folder_options_exit_2_in_one_line(tmp_path, capsys, argv, message):
    rc = cli.main([a.format(tmp=tmp_path) for a in argv])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("sglang-ext doctor: error: ")
    assert message.format(tmp=tmp_path) in captured.err and "; allowed: " in captured.err


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: command"),
    (["doctor", "--strict"], "unrecognized arguments: --strict"),
    (["make-tiny-model"], "invalid choice: 'make-tiny-model'"),  # moved to the test kit (sglang_ext_testkit)
])
def test_usage_errors_of_the_real_cli_are_one_line(argv, message):
    proc = subprocess.run([sys.executable, "-m", "sglang_ext", *argv], env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert proc.stderr.startswith("sglang-ext") and proc.stderr.endswith(" --help)\n")


def test_a_problem_exits_1_without_strict(monkeypatch):
    monkeypatch.delenv("SGLANG_EXT_STRICT", raising=False)
    rc, out = run_cli("doctor", "--no-import", "--assume-version", "0.5.12")
    assert rc == 1 and out.count("\n") == 1
    assert out.startswith("sglang-ext: PROBLEM \u2014 sglang 0.5.12 is not supported")


CONFIG_ERROR = "sglang-ext: PROBLEM \u2014 configuration error: "


@pytest.mark.parametrize("env, line", [
    ({"SGLANG_EXT": "2"}, "SGLANG_EXT: '2' is not allowed; allowed: 1 or 0"),
    ({"SGLANG_EXT": "yes"}, "SGLANG_EXT: 'yes' is not allowed; allowed: 1 or 0"),
    ({"SGLANG_EXT_VIT_GRAPH_MODE": "class", "SGLANG_EXT_VIT_GRAPH_ABOVE_LADDER": "split"},
     "--ext-vit-graph-above-ladder / SGLANG_EXT_VIT_GRAPH_ABOVE_LADDER: only used with --ext-vit-graph-mode bucket "
     "(mode is 'class'); allowed: leave it at eager, or set the mode to bucket"),
])
def test_configuration_error_is_one_line_on_stderr_and_exits_2(monkeypatch, capsys, env, line):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    rc = cli.main(["doctor", "--no-import"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert captured.err == CONFIG_ERROR + line + "\n"


def test_configuration_error_names_the_variable_and_verbose_details_stay_on_stdout(monkeypatch, capsys):
    monkeypatch.setenv("SGLANG_EXT_VIT_GRAPH_MAX_ENTRYS", "2")
    rc = cli.main(["doctor", "--no-import"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(CONFIG_ERROR + "unknown sglang-ext environment variable(s) "
                                   "SGLANG_EXT_VIT_GRAPH_MAX_ENTRYS; allowed: ")
    rc = cli.main(["doctor", "--no-import", "--verbose"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.err.count("\n") == 1 and captured.err.startswith(CONFIG_ERROR)
    assert "CONFIG ERROR: unknown sglang-ext environment variable(s) SGLANG_EXT_VIT_GRAPH_MAX_ENTRYS" in captured.out
    rc = cli.main(["doctor", "--no-import", "--json"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.err.count("\n") == 1 and captured.err.startswith(CONFIG_ERROR)
    assert json.loads(captured.out)["config_error"].startswith("unknown sglang-ext environment variable(s) ")


def test_real_cli_configuration_error_is_one_line_on_stderr_without_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "sglang_ext", "doctor", "--no-import"],
                          env=clean_env(SGLANG_EXT_VIT_GRAPH_MODE="class", SGLANG_EXT_VIT_GRAPH_ABOVE_LADDER="split"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr == (CONFIG_ERROR + "--ext-vit-graph-above-ladder / SGLANG_EXT_VIT_GRAPH_ABOVE_LADDER: only used "
                           "with --ext-vit-graph-mode bucket (mode is 'class'); allowed: leave it at eager, or set "
                           "the mode to bucket\n")


def test_report_inside_a_patched_process_shows_live_statuses_and_graph_caches(ext_patches):
    from sglang_ext.graphs import stats

    statuses = ext_patches()
    owner = type("Runner", (), {})()
    name = stats.register("doctor-test-cache", lambda: {"hits": 3, "misses": 1, "captures": 1}, owner=owner)
    try:
        rep = doctor.report()
    finally:
        internals.unregister(name)
    assert rep["mode"] == doctor.MODE_LIVE
    assert {p["name"]: p["status"] for p in rep["patches"]} == {k: str(v) for k, v in statuses.items()}
    assert rep["graph_caches"][name]["hits"] == 3
    assert all(p["verified_live"] for p in rep["patches"] if p["state"] == "applied")


def test_report_notices_a_target_rebound_after_applying(ext_patches):
    """Something (another plugin, sglang's HookRegistry) rebinds a patched attribute later."""
    from sglang_ext.patching import _ItemOwner

    ext_patches()
    ctx = activation._state.contexts["prefill_cp_bucket"]
    swap = next(s for s in ctx.swaps if not isinstance(s.owner, _ItemOwner))
    setattr(swap.owner, swap.name, "rebound by someone else")
    try:
        rep = doctor.report()
    finally:
        setattr(swap.owner, swap.name, swap.replacement)
    entry = next(p for p in rep["patches"] if p["name"] == "prefill_cp_bucket")
    assert entry["verified_live"] is False
    assert f"{swap.describe()} is not the patched object" in entry["live_problems"][0]
    assert any(line.startswith("prefill_cp_bucket: applied, but now: ") for line in doctor.problems(rep))


def test_records_of_a_server_are_read_back(tmp_path, ext_patches, monkeypatch):
    records = tmp_path / "records"
    monkeypatch.setenv("SGLANG_EXT_ACTIVATION_DIR", str(records))
    statuses = ext_patches()
    (records / "broken-1.json").write_text("{not json")
    rc, out = run_cli("doctor", "--json", "--no-import", "--records", str(records))
    rep = json.loads(out)
    by_file = {r["file"]: r for r in rep["records"]}
    mine = next(r for r in rep["records"] if r.get("pid") == os.getpid())
    assert {k: v["status"] for k, v in mine["patches"].items()} == {k: str(v) for k, v in statuses.items()}
    assert by_file["broken-1.json"]["error"].startswith("unreadable")
    assert rc == 0


def test_default_text_is_one_verdict_line_and_verbose_adds_every_patch():
    proc = subprocess.run([sys.executable, "-m", "sglang_ext", "doctor", "--no-import"],
                          env=clean_env(SGLANG_EXT_DISABLE="pi05_config"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == ""
    version = importlib.metadata.version("sglang")
    plan = activation.plan(load_settings({"SGLANG_EXT": "1"}), version=version)  # what the registry declares here
    not_needed = [n for n, st in plan.items() if st.state == "not needed"]
    unported = [n for n, st in plan.items() if st.unported]
    armed = len(PATCH_NAMES) - 1 - len(not_needed) - len(unported)
    notes = "; 1 disabled" + (f"; {len(not_needed)} not needed" if not_needed else "") + (
        f"; not ported to sglang {version} yet: {', '.join(unported)}" if unported else "")
    assert proc.stdout == (f"sglang-ext: OK \u2014 {armed}/{armed} patches armed on sglang {version} (fingerprints "
                           f"match; each applies when sglang imports its module{notes})\n")
    rc, verbose = run_cli("doctor", "--no-import", "--verbose")
    lines = verbose.splitlines()
    assert rc == 0 and lines[0].startswith("sglang-ext: OK \u2014 ") and f"matches {version}" in verbose
    assert [line.split()[0] for line in lines if line.split() and line.split()[0] in PATCH_NAMES] == list(PATCH_NAMES)
    assert len(lines) > 4 * len(PATCH_NAMES)


def test_verdict_counts_applied_patches_and_names_the_first_problem(ext_patches):
    statuses = ext_patches()  # every patch that applies to this release applied (eager)
    assert all(st.state in ("applied", "not needed") or st.unported for st in statuses.values())
    rep = doctor.report()
    n = sum(st.state == "applied" for st in statuses.values())
    version = importlib.metadata.version("sglang")
    assert doctor.verdict(rep).startswith(f"sglang-ext: OK \u2014 {n}/{n} patches applied on sglang {version}")
    if version == "0.5.17":  # the line the README and docs/running.md show
        assert doctor.verdict(rep) == f"sglang-ext: OK \u2014 {n}/{n} patches applied on sglang 0.5.17"
        root = os.path.join(os.path.dirname(__file__), "..", "..", "..")
        readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
        running = open(os.path.join(root, "docs", "running.md"), encoding="utf-8").read()
        assert f"`{doctor.verdict(rep)}`" in readme.replace("\n", " ")  # the README shows today's line
        assert f"```\n{doctor.verdict(rep)}\n```" in running  # and so does the page that explains it
    rep["patches"][1] = {**rep["patches"][1], "state": "failed", "status": "failed: boom"}
    assert doctor.verdict(rep) == f"sglang-ext: PROBLEM \u2014 {rep['patches'][1]['name']}: failed: boom"
