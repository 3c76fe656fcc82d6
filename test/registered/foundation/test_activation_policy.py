"""Activation policy: switch, idempotence, all-or-nothing parts, verification, strict mode, bad input.

Mechanics tests use a synthetic patch (a temporary package with two target modules and an
adapter) registered in place of the real registry, so a failing part can be provoked on
purpose. The switch, bad-input and refusal tests run the real registry against the real
installed sglang 0.5.17, and against the real 0.5.12 / 0.5.23 wheels.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import sys
import textwrap

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from conftest import plugin_only, where_part_runs
from activation_env import clean_activation  # noqa: F401  (autouse fixture)
from sglang_ext import activation, plugin, registry
from sglang_ext.tools import doctor
from sglang_ext.errors import SglangExtActivationError
from sglang_ext.registry import PATCH_NAMES, PATCHES, Part, PatchSpec, resolve
from sglang_ext.versions import at_least, installed_sglang_version
from sglang_ext_testkit import internals

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

pytestmark = plugin_only

STATUS_WORDS = ("applied", "armed", "disabled", "not needed", "skipped", "failed")
_counter = itertools.count()


# --------------------------------------------------------------------------
# A synthetic patch: package <pkg> with target_a (class Engine), target_b (def helper)
# --------------------------------------------------------------------------

ADAPTER = '''
calls = []


def run(self):
    return "patched " + self.name


def _ext_patched_helper():
    return "patched helper"


def patch_a(ctx, module):
    calls.append("a")
    ctx.setattr(module.Engine, "run", run)


def patch_b(ctx, module):
    calls.append("b")
    ctx.setattr(module, "helper", _ext_patched_helper)


def patch_b_raises(ctx, module):
    calls.append("b")
    ctx.setattr(module, "helper", _ext_patched_helper)
    raise RuntimeError("boom in part b")


def patch_b_clobbered(ctx, module):
    # someone else rebinds the attribute after us: verification must notice
    calls.append("b")
    ctx.setattr(module, "helper", _ext_patched_helper)
    module.helper = lambda: "someone else"


def patch_b_noop(ctx, module):
    calls.append("b")


def patch_b_reenters(ctx, module):
    from sglang_ext import activation
    calls.append(("reentered", sorted(activation.activate())))
    ctx.setattr(module, "helper", _ext_patched_helper)
'''


class FakePatch:
    def __init__(self, tmp_path, monkeypatch, part_b="patch_b"):
        self.pkg = f"ext_fake_{next(_counter)}"
        root = tmp_path / self.pkg
        root.mkdir()
        (root / "__init__.py").write_text("")
        (root / "target_a.py").write_text(textwrap.dedent('''
            class Engine:
                def __init__(self, name="e"):
                    self.name = name

                def run(self):
                    return "original " + self.name
            '''))
        (root / "target_b.py").write_text("def helper():\n    return 'original helper'\n")
        (root / "adapter.py").write_text(ADAPTER)
        monkeypatch.syspath_prepend(str(tmp_path))
        self.spec = PatchSpec(
            name="fake_patch", summary="synthetic two-part patch", targets=(),
            parts=(Part(f"{self.pkg}.target_a", f"{self.pkg}.adapter:patch_a"),
                   Part(f"{self.pkg}.target_b", f"{self.pkg}.adapter:{part_b}")),
            upstream_pr="-", retire_when="-", supported=("0.5.17",))
        monkeypatch.setattr(activation, "PATCHES", (self.spec,))
        monkeypatch.setattr(registry, "PATCHES", (self.spec,))  # the disable-list check reads it

    def module(self, name):
        return importlib.import_module(f"{self.pkg}.{name}")

    @property
    def calls(self):
        return self.module("adapter").calls

    def activate(self, strict=True, **env):
        environ = {"SGLANG_EXT": "1", "SGLANG_EXT_STRICT": "1" if strict else "0", **env}
        return activation.activate(environ=environ, version="0.5.17")

    def assert_original(self):
        a, b = sys.modules.get(f"{self.pkg}.target_a"), sys.modules.get(f"{self.pkg}.target_b")
        if a is not None:
            assert a.Engine().run() == "original e"
            assert "_ext_patched_helper" not in vars(a)
        if b is not None:
            assert b.helper() == "original helper"


@pytest.fixture
def fake(tmp_path, monkeypatch):
    return lambda **kw: FakePatch(tmp_path, monkeypatch, **kw)


def test_parts_apply_when_their_modules_are_imported_then_verify(fake):
    f = fake()
    st = f.activate()["fake_patch"]
    assert st.state == "armed" and f"{f.pkg}.target_a" in st.detail
    f.module("target_a")
    st = activation.statuses()["fake_patch"]
    assert st.state == "armed" and st.parts_applied == [f"{f.pkg}.target_a"]
    assert st.detail == f"applies when {f.pkg}.target_b is imported"
    f.module("target_b")
    st = activation.statuses()["fake_patch"]
    assert (st.state, str(st)) == ("applied", "applied")
    assert f.module("target_a").Engine("x").run() == "patched x"
    assert f.module("target_b").helper() == "patched helper"
    assert activation.statuses()["fake_patch"].state == activation.APPLIED


def test_activation_is_idempotent(fake):
    f = fake()
    f.module("target_a"), f.module("target_b")
    first = f.activate()
    second = f.activate()
    third = activation.activate(environ={"SGLANG_EXT": "1"})
    assert {k: str(v) for k, v in first.items()} == {k: str(v) for k, v in second.items()} == \
        {k: str(v) for k, v in third.items()} == {"fake_patch": "applied"}
    assert f.calls == ["a", "b"]  # each part ran once


def test_activation_is_reentrant_from_inside_a_part(fake):
    f = fake(part_b="patch_b_reenters")
    f.activate()
    f.module("target_a"), f.module("target_b")
    assert f.calls[1] == ("reentered", ["fake_patch"])
    assert str(activation.statuses()["fake_patch"]) == "applied"


def test_installed_but_not_enabled_changes_nothing(fake):
    f = fake()
    pending_before = internals.pending_triggers()
    assert activation.activate(environ={}) == {}
    assert activation.activate(environ={"SGLANG_EXT": "0", "SGLANG_EXT_DISABLE": "no_such_patch"}) == {}
    assert activation.statuses() == {}
    assert internals.pending_triggers() == pending_before
    f.module("target_a"), f.module("target_b")
    assert f.calls == []
    f.assert_original()


def test_part_that_raises_rolls_back_the_whole_patch(fake, caplog):
    f = fake(part_b="patch_b_raises")
    f.activate(strict=False)
    f.module("target_a")
    assert f.module("target_a").Engine().run() == "patched e"  # part a is live until b fails
    with caplog.at_level(logging.ERROR, logger="sglang_ext"):
        f.module("target_b")
    st = activation.statuses()["fake_patch"]
    assert st.state == "failed"
    assert str(st).startswith(f"failed: {f.pkg}.adapter:patch_b_raises on {f.pkg}.target_b: RuntimeError: boom in part b")
    assert st.parts_applied == [] and st.parts_pending == []
    f.assert_original()
    assert "rolled back" in caplog.text and "boom in part b" in caplog.text


def test_part_that_raises_aborts_in_strict_mode(fake):
    f = fake(part_b="patch_b_raises")
    f.activate(strict=True)
    f.module("target_a")
    with pytest.raises(SglangExtActivationError, match="strict mode: patch fake_patch failed: .*boom in part b"):
        f.module("target_b")
    assert not isinstance(SglangExtActivationError("x"), Exception)  # sglang's `except Exception` cannot catch it
    f.assert_original()
    assert activation.statuses()["fake_patch"].state == "failed"


def test_part_whose_swap_does_not_verify_rolls_back(fake):
    f = fake(part_b="patch_b_clobbered")
    f.activate(strict=False)
    f.module("target_a"), f.module("target_b")
    st = activation.statuses()["fake_patch"]
    assert st.state == "failed"
    assert "verification failed" in st.detail and "helper is not the patched object" in st.detail
    f.assert_original()


def test_part_that_changes_nothing_fails(fake):
    f = fake(part_b="patch_b_noop")
    f.activate(strict=False)
    f.module("target_a"), f.module("target_b")
    st = activation.statuses()["fake_patch"]
    assert st.state == "failed" and "patch_b_noop changed nothing" in st.detail
    f.assert_original()


def test_deactivate_restores_and_cancels_pending_parts(fake):
    f = fake()
    f.activate()
    f.module("target_a")
    assert f.module("target_a").Engine().run() == "patched e"
    activation.deactivate()
    assert f.module("target_a").Engine().run() == "original e"
    assert f"{f.pkg}.target_b" not in internals.pending_triggers()
    f.module("target_b")  # the cancelled part must not run
    assert f.calls == ["a"]
    f.assert_original()


def test_disabled_patch_is_left_alone(fake):
    f = fake()
    st = f.activate(SGLANG_EXT_DISABLE="fake_patch")["fake_patch"]
    assert (st.state, str(st)) == ("disabled", "disabled")
    f.module("target_a"), f.module("target_b")
    assert f.calls == []
    f.assert_original()


def test_activation_record_is_written_per_process(fake, tmp_path):
    f = fake()
    records = tmp_path / "records"
    f.activate(SGLANG_EXT_ACTIVATION_DIR=str(records))
    f.module("target_a"), f.module("target_b")
    [rec] = doctor.read_records(str(records))
    assert rec["pid"] == os.getpid()
    assert rec["patches"]["fake_patch"]["status"] == "applied"
    assert rec["sglang"] == "0.5.17" and rec["strict"] is True


# --------------------------------------------------------------------------
# Bad input: clear errors naming what is wrong and what is allowed
# --------------------------------------------------------------------------

def test_unknown_patch_in_disable_list_names_the_allowed_names():
    with pytest.raises(SglangExtActivationError) as err:
        activation.activate(environ={"SGLANG_EXT": "1", "SGLANG_EXT_DISABLE": "vit_cuda_graph,vit_graphs"})
    text = str(err.value)
    assert "SGLANG_EXT_DISABLE" in text and "vit_graphs" in text
    assert "allowed: " + ", ".join(PATCH_NAMES) in text
    assert activation.statuses() == {}


def test_valid_disable_list_on_real_registry(monkeypatch):
    monkeypatch.setattr(activation, "_arm", lambda spec, settings: None)  # decide only; nothing armed
    got = activation.activate(environ={"SGLANG_EXT": "1", "SGLANG_EXT_DISABLE": ",".join(PATCH_NAMES)})
    assert {k: str(v) for k, v in got.items()} == {n: "disabled" for n in PATCH_NAMES}


_BUCKETS_WITHOUT_CONFIG = {"SGLANG_EXT": "1", "SGLANG_EXT_DISABLE": "pi05_config",
                           "SGLANG_EXT_PI05_PROMPT_TOKEN_BUCKETS": "32,64"}


@where_part_runs("sglang_ext.pi05.policy_graphs:patch_policy")  # pi05_graphs needs pi05_config
def test_a_patch_whose_requirement_is_off_is_left_off_with_a_warning(monkeypatch, caplog):
    """pi05_graphs' prompt buckets need pi05_config's module: never 'applied' and then ImportError per request."""
    armed = []
    monkeypatch.setattr(activation, "_arm", lambda spec, settings: armed.append(spec.name))
    with caplog.at_level(logging.WARNING, logger="sglang_ext"):
        got = activation.activate(environ={**_BUCKETS_WITHOUT_CONFIG, "SGLANG_EXT_STRICT": "0"})
    assert got["pi05_config"].state == "disabled"
    assert got["pi05_graphs"].state == "skipped" and "pi05_graphs" not in armed
    assert got["pi05_graphs"].detail == (
        "requires patch pi05_config while SGLANG_EXT_PI05_PROMPT_TOKEN_BUCKETS is set, which is disabled; "
        "allowed: enable pi05_config, or list pi05_graphs in SGLANG_EXT_DISABLE too, or unset "
        "SGLANG_EXT_PI05_PROMPT_TOKEN_BUCKETS")
    assert "pi05_fused_norms" in armed  # unrelated patches go ahead (one that applies on every supported release)
    [warning] = [r.getMessage() for r in caplog.records if "pi05_graphs" in r.getMessage()]
    assert "\n" not in warning and "requires patch pi05_config" in warning


@where_part_runs("sglang_ext.pi05.policy_graphs:patch_policy")  # pi05_graphs needs pi05_config
def test_a_patch_whose_requirement_is_off_stops_start_up_in_strict_mode(monkeypatch):
    monkeypatch.setattr(activation, "_arm", lambda spec, settings: None)
    with pytest.raises(SglangExtActivationError) as err:
        activation.activate(environ={**_BUCKETS_WITHOUT_CONFIG, "SGLANG_EXT_STRICT": "1"})
    text = str(err.value)
    assert "\n" not in text and "patch pi05_graphs skipped: requires patch pi05_config" in text


@where_part_runs("sglang_ext.pi05.policy_graphs:patch_policy")  # pi05_graphs needs pi05_config
def test_a_conditional_requirement_without_its_knob_does_not_apply(monkeypatch):
    monkeypatch.setattr(activation, "_arm", lambda spec, settings: None)
    got = activation.activate(environ={"SGLANG_EXT": "1", "SGLANG_EXT_DISABLE": "pi05_config",
                                       "SGLANG_EXT_STRICT": "1"})
    assert got["pi05_graphs"].state == "armed"  # without prompt buckets it never imports prompt_bucketing


def test_unknown_environment_variable_is_an_error():
    with pytest.raises(SglangExtActivationError) as err:
        activation.activate(environ={"SGLANG_EXT": "1", "SGLANG_EXT_VIT_GRAPH_MAX_ENTRYS": "4"})
    text = str(err.value)
    assert "unknown sglang-ext environment variable(s) SGLANG_EXT_VIT_GRAPH_MAX_ENTRYS" in text
    assert "SGLANG_EXT_VIT_GRAPH_MAX_ENTRIES" in text  # the allowed spelling is listed


def test_bad_master_switch_value_is_an_error():
    with pytest.raises(SglangExtActivationError, match=r"SGLANG_EXT: 'maybe' is not allowed; allowed: 1 or 0"):
        activation.activate(environ={"SGLANG_EXT": "maybe"})


# --------------------------------------------------------------------------
# Refusals on the real registry: unsupported sglang, changed fingerprints (real wheels)
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def live_sglang():
    """Snapshot of every real target module (and its classes) to prove nothing was touched."""
    version = installed_sglang_version()
    names = sorted({resolve(p.trigger_module, version) for spec in PATCHES for p in spec.parts}
                   | {t.key_in(version).split(":")[0] for spec in PATCHES for t in spec.targets})
    modules = [importlib.import_module(n) for n in names]

    def snapshot():
        out = {}
        for m in modules:
            out[m.__name__] = dict(vars(m))
            for name, obj in vars(m).items():
                if isinstance(obj, type) and obj.__module__ == m.__name__:
                    out[f"{m.__name__}:{name}"] = dict(vars(obj))
        return out

    return snapshot


def assert_same(before, after):
    assert before.keys() == after.keys()
    for owner in before:
        changed = [k for k in before[owner].keys() | after[owner].keys()
                   if before[owner].get(k, "<missing>") is not after[owner].get(k, "<missing>")]
        assert not changed, f"{owner}: {changed} changed"


def test_unsupported_sglang_applies_nothing_with_one_clear_warning(released_tree, live_sglang, caplog):
    tree = released_tree("0.5.12")
    before, pending = live_sglang(), internals.pending_triggers()
    with caplog.at_level(logging.WARNING, logger="sglang_ext"):
        got = activation.activate(environ={"SGLANG_EXT": "1"}, source_root=tree)
    assert activation.activated_version() == "0.5.12"  # read from the tree's sglang/_version.py
    for spec in PATCHES:
        assert str(got[spec.name]) == "skipped (sglang 0.5.12 is not supported; supported: 0.5.17, 0.5.23)"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "sglang 0.5.12" in warnings[0] and "is not supported" in warnings[0]
    assert "supported: 0.5.17, 0.5.23" in warnings[0] and "Nothing was applied" in warnings[0]
    assert internals.pending_triggers() == pending
    assert_same(before, live_sglang())


def test_unsupported_sglang_aborts_in_strict_mode(released_tree, live_sglang):
    before = live_sglang()
    with pytest.raises(SglangExtActivationError, match=r"strict mode .*sglang 0\.5\.12 .* is not supported; "
                       r"supported: 0\.5\.17, 0\.5\.23"):
        activation.activate(environ={"SGLANG_EXT": "1", "SGLANG_EXT_STRICT": "1"},
                            source_root=released_tree("0.5.12"))
    assert_same(before, live_sglang())


@pytest.mark.parametrize("release", ["0.5.12", "0.5.23"])
def test_changed_fingerprints_apply_nothing(release, released_tree, live_sglang, caplog):
    """The tree claims to be 0.5.17 (as a source build with SGLANG_EXT_ASSUME_SGLANG would), but its
    code is another release's: every patch is refused by its fingerprints, the live sglang untouched."""
    tree = released_tree(release)
    before, pending = live_sglang(), internals.pending_triggers()
    with caplog.at_level(logging.WARNING, logger="sglang_ext"):
        got = activation.activate(environ={"SGLANG_EXT": "1", "SGLANG_EXT_ASSUME_SGLANG": "0.5.17"},
                                  source_root=tree)
    for spec in PATCHES:
        st = got[spec.name]
        assert st.state == "skipped", (spec.name, str(st))
        assert ("fingerprint changed: " in st.detail) or ("target absent: " in st.detail)
        assert f"checked sglang 0.5.17 at {tree} against the reference of sglang 0.5.17" in st.detail
        assert not all(st.fingerprints.values())
        bad = [k for k, ok in st.fingerprints.items() if not ok]
        assert all(k in st.detail for k in bad)
        assert f"patch {spec.name} skipped, nothing of it applied" in caplog.text
    assert internals.pending_triggers() == pending
    assert_same(before, live_sglang())


@pytest.mark.parametrize("release", ["0.5.12", "0.5.23"])
def test_changed_fingerprints_abort_in_strict_mode(release, released_tree, live_sglang):
    before = live_sglang()
    with pytest.raises(SglangExtActivationError) as err:
        activation.activate(environ={"SGLANG_EXT": "1", "SGLANG_EXT_STRICT": "1",
                                     "SGLANG_EXT_ASSUME_SGLANG": "0.5.17"},
                            source_root=released_tree(release))
    for name in PATCH_NAMES:
        assert f"patch {name} skipped: " in str(err.value)
    assert_same(before, live_sglang())


def test_matching_fingerprints_arm_every_patch(released_tree, monkeypatch):
    """Control for the two tests above: the real 0.5.17 wheel passes the same check."""
    monkeypatch.setattr(activation, "_arm", lambda spec, settings: None)  # decide only; apply nothing
    got = activation.activate(environ={"SGLANG_EXT": "1", "SGLANG_EXT_STRICT": "1"},
                              source_root=released_tree("0.5.17"))
    for spec in PATCHES:
        assert got[spec.name].state == "armed", str(got[spec.name])
        assert all(got[spec.name].fingerprints.values())


@pytest.mark.parametrize("release", ["0.5.21", "0.5.22"])
def test_a_target_reviewed_on_a_release_between_accepts_that_release(release, released_tree):
    """sglang 0.5.21/0.5.22 (unsupported, between 0.5.17 and 0.5.23): vit_cuda_graph's targets all match 0.5.23's
    but ModelRunner.init_cuda_graphs, which the registry names as reviewed there (Target.also): the patch is
    armed. Targets without that declaration are checked against the supported releases only, so prefill_cp_bucket
    stays skipped, naming its changed targets and the references checked."""
    from sglang_ext.knobs import load_settings
    from sglang_ext.registry import Target

    got = activation.plan(load_settings({"SGLANG_EXT": "1"}), version=release, source_root=released_tree(release))
    assert got["vit_cuda_graph"].state == "armed" and all(got["vit_cuda_graph"].fingerprints.values())
    assert got["prefill_cp_bucket"].state == "skipped"
    assert "fingerprint changed: " in got["prefill_cp_bucket"].detail
    assert "against the reference of sglang 0.5.17, 0.5.23" in got["prefill_cp_bucket"].detail
    reviewed, plain = Target("m", "f", also=(release,)), Target("m", "f")
    assert reviewed.reference_releases(("0.5.17", "0.5.23"), release) == ("0.5.17", "0.5.23", release)
    assert plain.reference_releases(("0.5.17", "0.5.23"), release) == ("0.5.17", "0.5.23")
    assert reviewed.reference_releases(("0.5.17", "0.5.23"), "0.5.23") == ("0.5.23",)  # a supported one: its own


def test_plugin_register_without_switch_touches_no_sglang_attribute(live_sglang):
    before, pending = live_sglang(), internals.pending_triggers()
    meta_path = list(sys.meta_path)
    plugin.register()
    plugin.register()
    assert activation.statuses() == {}
    assert internals.pending_triggers() == pending and sys.meta_path == meta_path
    assert_same(before, live_sglang())


def test_sglang_without_dist_metadata_is_identified_by_its_version_file(monkeypatch):
    """An unpacked sglang on sys.path (no dist-info, e.g. a build tree) reports the release
    in its own sglang/_version.py; activation checks fingerprints against that release."""
    from sglang_ext import activation

    monkeypatch.setattr(activation, "installed_sglang_version", lambda: None)
    assert activation.resolve_version(None) == installed_sglang_version()
    monkeypatch.setattr(activation, "installed_sglang_path", lambda: None)
    assert activation.resolve_version(None) is None  # no sglang at all: "sglang is not installed"


# --------------------------------------------------------------------------
# Names a module binds from patched code while the patch is applied (`from .source import work`
# run after activation) are sglang's objects again after deactivation
# --------------------------------------------------------------------------

BOUND_ADAPTER = '''
import sys

from sglang_ext.patching import install_module


def _ext_suffix():
    return "!"


def patched_work():
    return "patched work" + _ext_suffix()


def patch_source(ctx, module):
    ctx.setattr(module, "_ext_orig_work", module.work)  # sglang's object kept under a new name
    ctx.setattr(module, "work", patched_work)


def patch_user(ctx, module):
    ctx.setattr(module, "work", sys.modules[module.__package__ + ".source"].work)  # rebinds the copy


def wrap_source(ctx, module):
    inner = module.work

    def work():
        return "[" + inner() + "]"

    ctx.setattr(module, "work", work)


def install_runner(ctx, module):
    from . import ext_runner

    install_module(ctx, module.__name__ + ".legacy", ext_runner)


def patch_runner_user(ctx, module):
    ctx.setattr(module, "Runner", sys.modules[module.__package__ + ".legacy"].Runner)
'''


def bound_by_name(tmp_path, monkeypatch, *parts):
    """A package whose `user` binds `work` from `source` and `runner_user` binds `Runner` from
    `legacy` by name; one patch per (trigger, adapter function) in `parts`, activated eagerly."""
    pkg = f"ext_bound_{next(_counter)}"
    root = tmp_path / pkg
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "source.py").write_text("def work():\n    return 'original work'\n")
    (root / "user.py").write_text("from .source import work\n")
    (root / "legacy.py").write_text("class Runner:\n    kind = 'legacy'\n")
    (root / "ext_runner.py").write_text("class Runner:\n    kind = 'ext'\n")
    (root / "runner_user.py").write_text("from .legacy import Runner\n")
    (root / "adapter.py").write_text(BOUND_ADAPTER)
    monkeypatch.syspath_prepend(str(tmp_path))
    specs = tuple(PatchSpec(name=f"p{i}", summary="-", targets=(), upstream_pr="-", retire_when="-",
                            parts=(Part(f"{pkg}{trigger}", f"{pkg}.adapter:{fn}"),))
                  for i, (trigger, fn) in enumerate(parts))
    monkeypatch.setattr(activation, "PATCHES", specs)
    monkeypatch.setattr(registry, "PATCHES", specs)
    got = activation.activate(environ={"SGLANG_EXT": "1", "SGLANG_EXT_STRICT": "1"}, version="0.5.17", eager=True)
    assert {str(st) for st in got.values()} == {"applied"}, got
    return lambda name: importlib.import_module(f"{pkg}.{name}")


def test_a_patched_function_bound_by_name_is_sglangs_again_after_deactivate(tmp_path, monkeypatch):
    module = bound_by_name(tmp_path, monkeypatch, (".source", "patch_source"), (".user", "patch_user"))
    source, user = module("source"), module("user")  # user imported now: it binds the patched work
    assert user.work() == source.work() == "patched work!"
    activation.deactivate()
    # before: user.work stayed sglang-ext's function after deactivation
    assert user.work is source.work and user.work() == "original work"
    assert "_ext_orig_work" not in vars(source)


def test_a_later_wrapper_of_the_same_attribute_rolled_back_alone_restores_the_first_patch(tmp_path, monkeypatch):
    module = bound_by_name(tmp_path, monkeypatch, (".source", "patch_source"), (".source", "wrap_source"))
    source = module("source")
    assert source.work() == "[patched work!]"
    activation._state.contexts["p1"].rollback()  # the wrapper alone
    assert source.work() == "patched work!"
    activation.deactivate()
    assert source.work() == "original work"


def test_a_class_bound_from_a_module_installed_whole_is_sglangs_after_deactivate(tmp_path, monkeypatch):
    module = bound_by_name(tmp_path, monkeypatch, ("", "install_runner"), (".runner_user", "patch_runner_user"))
    runner_user = module("runner_user")  # the legacy module was never imported: it binds ext_runner's class
    assert runner_user.Runner.kind == "ext" and module("legacy").__name__.endswith(".ext_runner")
    activation.deactivate()
    assert runner_user.Runner is module("legacy").Runner and runner_user.Runner.kind == "legacy"


DEACTIVATE_AFTER_IMPORT = r'''
import importlib, json, os, sys, types
import sglang_ext
from sglang_ext import activation
from sglang_ext.registry import PATCHES, resolve
from sglang_ext.versions import installed_sglang_version

version = installed_sglang_version()
names = sorted({resolve(p.trigger_module, version) for s in PATCHES for p in s.parts}
               | {t.key_in(version).split(":")[0] for s in PATCHES for t in s.targets})
assert not [n for n in names if n in sys.modules]  # nothing imported before activation
statuses = activation.activate(eager=True)
for name in names:
    importlib.import_module(name)  # every target module imported while the patches are applied
activation.deactivate()
ext_dir = os.path.dirname(sglang_ext.__file__)

def ours(value):
    code = getattr(getattr(value, "__func__", value), "__code__", None)
    module = getattr(value, "__module__", None)
    # (0.5.23's lazy module proxies answer any attribute: only real code objects count)
    return (isinstance(code, types.CodeType) and code.co_filename.startswith(ext_dir)) or (
        isinstance(value, type) and str(module).startswith("sglang_ext"))

left = []
for name, module in list(sys.modules.items()):
    if name.startswith("sglang.") and module is not None:
        for key, value in list(vars(module).items()):
            left += [f"{name}.{key}"] if ours(value) else []
            if isinstance(value, type) and value.__module__ == name:
                left += [f"{name}.{key}.{a}" for a, v in list(vars(value).items()) if ours(v)]
mg = "sglang.multimodal_gen.runtime."
m = lambda name: importlib.import_module(resolve(mg + name, version))
print(json.dumps({"statuses": {k: str(v) for k, v in statuses.items()}, "left": left, "same": [
    m("entrypoints.action.ws_utils").action_metadata is m("entrypoints.action.protocol").action_metadata,
    m("entrypoints.action.api").infer_action is m("entrypoints.action.protocol").infer_action,
    m("models.vlas.pi05_policy").VLADenoiseGraphRunner is m("vla.cuda_graph").VLADenoiseGraphRunner,
    m("vla.cuda_graph").__file__.startswith(os.path.dirname(sys.modules["sglang"].__file__))]}))
'''


def test_deactivate_after_importing_every_target_while_patched_leaves_no_sglang_ext_code():
    """Real 0.5.17, a fresh process: every target module is first imported while all patches are
    applied (what doctor's in-process report does); after deactivation no sglang module holds
    sglang-ext code and the names they bound by import are sglang's objects again. Earlier, names
    such as vla.ws_utils.action_metadata kept the patched function (its helpers removed: a
    NameError in whatever test ran next in the process)."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if not (k == "SGLANG_EXT" or k.startswith("SGLANG_EXT_"))}
    env.update(SGLANG_EXT="1", SGLANG_EXT_STRICT="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", DEACTIVATE_AFTER_IMPORT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    version = installed_sglang_version()
    assert set(out["statuses"]) == set(PATCH_NAMES)
    assert all(v == "applied" or v.startswith(f"skipped (not ported to sglang {version}") or v.startswith("not needed")
               for v in out["statuses"].values()), out
    assert out["left"] == []
    assert out["same"] == [True, True, True, True]
