"""sglang's own plugin loader (`sglang.srt.plugins.load_plugins`) with the installed entry point.

Each scenario is a fresh interpreter, as in a real scheduler process: it calls sglang's real
`load_plugins()` (which discovers `sglang_ext.plugin:register` through the package's entry
point) and reports what it sees. The scenarios run concurrently to keep the wall time down.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from conftest import plugin_only, where_part_runs
from sglang_ext.knobs import KNOBS
from sglang_ext.registry import PATCH_NAMES

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

pytestmark = plugin_only

# Runs inside the child. After load_plugins() returns, optionally import a real target module
# (PROBE_IMPORT_TARGET=1; it costs seconds) and report statuses, pending triggers, and whether
# any sglang_ext code sits in the patched class.
PROBE = r'''
import json, os, sys
from sglang.srt.plugins import load_plugins
load_plugins()
ext_modules = sorted(m for m in sys.modules if m.startswith("sglang_ext"))
from sglang_ext import activation, patching
from sglang_ext_testkit import internals
before = {k: str(v) for k, v in activation.statuses().items()}
ext_attrs = None
if os.environ.get("PROBE_IMPORT_TARGET") == "1":
    from sglang_ext_testkit.upstream import upstream
    bcg = upstream("sglang.srt.layers.cp.bcg.bcg")  # 0.5.17: sglang.srt.layers.cp.bcg
    ext_attrs = sorted(n for n, v in vars(bcg.PrefillCPBCGInput).items()
                       if getattr(getattr(v, "__func__", v), "__module__", "").startswith("sglang_ext"))
vla = None
if os.environ.get("PROBE_IMPORT_VLA") == "1":
    policy = "sglang.multimodal_gen.runtime.models.vlas.pi05_policy"
    vla = {"policy_loaded_before": policy in sys.modules}
    try:
        import sglang.multimodal_gen.runtime.vla.cuda_graph as cg
    except ImportError as exc:
        vla["error"] = repr(exc)
    else:
        vla["runners"] = [n for n in ("VLAPrefixGraphRunner", "VLADenoiseGraphRunner") if hasattr(cg, n)]
        legacy = sys.modules.get("sglang.multimodal_gen.runtime.vla.denoise_cuda_graph")
        vla["legacy_is_alias"] = legacy is cg
    vla["pi05_graphs"] = str(activation.statuses()["pi05_graphs"])
print("PROBE " + json.dumps({
    "vla": vla,
    "after_load_plugins": before,
    "ext_modules_after_load_plugins": ext_modules,
    "after_import": {k: str(v) for k, v in activation.statuses().items()},
    "pending": internals.pending_triggers(),
    "ext_attrs_on_PrefillCPBCGInput": ext_attrs,
    "finders": [type(f).__name__ for f in sys.meta_path],
}))
'''

SCENARIOS = {
    "unset": {"PROBE_IMPORT_TARGET": "1"},
    "zero": {"SGLANG_EXT": "0"},
    "enabled_strict": {"SGLANG_EXT": "1", "SGLANG_EXT_STRICT": "1", "PROBE_IMPORT_TARGET": "1"},
    "unsupported_strict": {"SGLANG_EXT": "1", "SGLANG_EXT_STRICT": "1", "SGLANG_EXT_ASSUME_SGLANG": "0.5.12"},
    "unsupported_default": {"SGLANG_EXT": "1", "SGLANG_EXT_ASSUME_SGLANG": "0.5.12"},
    "bad_value_default": {"SGLANG_EXT": "1", "SGLANG_EXT_VIT_GRAPH_POLICY": "fifo"},
    "bucket_only_in_layout_mode": {"SGLANG_EXT": "1", "SGLANG_EXT_VIT_GRAPH_MODE": "layout",
                                   "SGLANG_EXT_VIT_GRAPH_REPLAY_MAX_TOKENS": "4096"},
    "master_switch_yes": {"SGLANG_EXT": "yes"},
    "upstream_vla_name": {"SGLANG_EXT": "1", "SGLANG_EXT_STRICT": "1", "PROBE_IMPORT_VLA": "1"},
}


@pytest.fixture(scope="module")
def runs():
    base = {k: v for k, v in os.environ.items() if not (k == "SGLANG_EXT" or k.startswith("SGLANG_EXT_"))}
    base["SGLANG_PLUGINS"] = "sglang_ext"  # only our entry point, whatever else is installed
    procs = {name: subprocess.Popen([sys.executable, "-c", PROBE], env={**base, **extra},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, extra in SCENARIOS.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        probe = next((json.loads(line[len("PROBE "):]) for line in stdout.splitlines()
                      if line.startswith("PROBE ")), None)
        out[name] = (proc.returncode, probe, stderr)
    return out


def test_entry_point_is_installed():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    assert eps["sglang_ext"].value == "sglang_ext.plugin:register"
    assert eps["sglang_ext"].dist.name == "sglang-ext"
    mg = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.multimodal_gen.plugins")}
    assert mg["sglang_ext"] == "sglang_ext.plugin:register"


def test_switch_unset_applies_nothing(runs):
    rc, probe, stderr = runs["unset"]
    assert rc == 0, stderr
    assert probe["after_load_plugins"] == {} and probe["after_import"] == {}
    assert probe["pending"] == {}
    assert probe["ext_attrs_on_PrefillCPBCGInput"] == []
    assert "_PostImportFinder" not in probe["finders"]


@pytest.mark.parametrize("scenario", ["unset", "zero"])
def test_switch_off_imports_only_the_entry_point(runs, scenario):
    # Every sglang process pays for the off path: it must not import activation, the
    # registry or fingerprints (scripts/measure_plugin_overhead.py times it).
    rc, probe, stderr = runs[scenario]
    assert rc == 0, stderr
    assert probe["ext_modules_after_load_plugins"] == ["sglang_ext", "sglang_ext.plugin"]
    assert probe["after_load_plugins"] == {}


def test_switch_on_imports_activation(runs):
    rc, probe, stderr = runs["enabled_strict"]
    assert rc == 0, stderr
    assert "sglang_ext.activation" in probe["ext_modules_after_load_plugins"]


def test_enabled_load_plugins_arms_then_applies_on_import(runs):
    rc, probe, stderr = runs["enabled_strict"]
    assert rc == 0, stderr
    assert set(probe["after_load_plugins"]) == set(PATCH_NAMES)
    assert probe["after_load_plugins"]["prefill_cp_bucket"].startswith("armed (applies when ")
    # importing bcg runs that part; the patch is applied once its runner module is imported too
    assert probe["ext_attrs_on_PrefillCPBCGInput"], "no sglang_ext code installed on PrefillCPBCGInput"
    assert not [m for m in probe["pending"] if m.startswith("sglang.srt.layers.cp.bcg")]


def test_strict_failure_aborts_instead_of_being_swallowed(runs):
    rc, probe, stderr = runs["unsupported_strict"]
    assert rc != 0 and probe is None  # load_plugins() did not return
    assert "SglangExtActivationError" in stderr
    assert "sglang 0.5.12" in stderr and "is not supported" in stderr and "supported: 0.5.17, 0.5.23" in stderr


def test_default_mode_warns_once_and_applies_nothing(runs):
    rc, probe, stderr = runs["unsupported_default"]
    assert rc == 0, stderr
    assert all(s.startswith("skipped (sglang 0.5.12 is not supported")
               for s in probe["after_import"].values()), probe["after_import"]
    assert probe["pending"] == {}  # nothing armed: nothing can apply later either
    assert stderr.count("is not supported;") == 1


@pytest.mark.parametrize("scenario, line", [
    ("bad_value_default",
     "--ext-vit-graph-policy / SGLANG_EXT_VIT_GRAPH_POLICY: 'fifo' is not allowed; allowed: lru, exact"),
    ("bucket_only_in_layout_mode",
     "--ext-vit-graph-replay-max-tokens / SGLANG_EXT_VIT_GRAPH_REPLAY_MAX_TOKENS: only used with --ext-vit-graph-mode "
     "bucket (mode is 'layout'); allowed: leave it at -1, or set the mode to bucket"),
    ("master_switch_yes", "SGLANG_EXT: 'yes' is not allowed; allowed: 1 or 0"),
])
def test_bad_setting_ends_the_process_with_one_line_and_status_2(runs, scenario, line):
    """sglang's loader swallows ordinary exceptions; a bad setting still stops the process, in one line
    (even without strict mode) and without a traceback."""
    rc, probe, stderr = runs[scenario]
    assert rc == 2 and probe is None  # load_plugins() did not return
    assert stderr == f"sglang-ext configuration error: {line}\n"


INT_KNOBS = [k for k in KNOBS if k.kind == "int"]


@pytest.mark.parametrize("k", INT_KNOBS, ids=lambda k: k.name)
def test_int_knob_below_its_minimum_stops_register_in_one_line(monkeypatch, capsys, k):
    """The entry point sglang's loader calls, in this process: status 2, one line, nothing activated."""
    from sglang_ext import activation, plugin

    for name in [n for n in os.environ if n.startswith("SGLANG_EXT_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SGLANG_EXT", "1")
    monkeypatch.setenv(k.env, str(k.minimum - 1))
    activation.deactivate()
    with pytest.raises(SystemExit) as stopped:
        plugin.register()
    assert stopped.value.code == 2 and stopped.value.__cause__ is None and stopped.value.__suppress_context__
    assert capsys.readouterr().err == (f"sglang-ext configuration error: {k.flag} / {k.env}: {k.minimum - 1} is "
                                       f"below the minimum; allowed: integers >= {k.minimum}\n")
    assert activation.statuses() == {}


@where_part_runs("sglang_ext.pi05.vla_cuda_graph:install")
def test_upstream_vla_cuda_graph_name_imports_right_after_load_plugins(runs):
    """`vla.cuda_graph` (0.5.18+'s module) resolves before any Pi0.5 model module was imported."""
    rc, probe, stderr = runs["upstream_vla_name"]
    assert rc == 0, stderr
    vla = probe["vla"]
    assert vla["policy_loaded_before"] is False
    assert "error" not in vla, vla
    assert vla["runners"] == ["VLAPrefixGraphRunner", "VLADenoiseGraphRunner"]
    assert vla["legacy_is_alias"] is True  # 0.5.17's vla.denoise_cuda_graph name is the same module
