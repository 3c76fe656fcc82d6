"""sglang's own Pi0.5, action-API and scheduler-client unit tests, run unchanged with every sglang-ext patch.

- The installed release's own (`sglang/multimodal_gen/test/unit/`; UNIT_TESTS per release): the
  patches change PiGemma's projections, the action metadata, the pipeline config and the scheduler
  client in place; these files pin sglang's behaviour of those pieces (loader key mapping, metadata
  fields, runtime helpers; on 0.5.23 also the scheduler client and its per-request array transfer).
- 0.5.19's, from its released wheel (downloaded once into sglang_ext_testkit.wheels' cache; a failed
  download fails the test in one line): conformance of the ported pieces with upstream. Only
  the tests of ported pieces are selected (UPSTREAM_0_5_19; the rest are listed with the reason
  they are left out). The 0.5.19-only modules they import are the ones the patches install
  (vla.cuda_graph, vla.prompt_bucketing, entrypoints.action.protocol, MergedReplicatedLinear);
  the import shim adds only names that 0.5.17 lacks and that only excluded tests use
  (ABSENT_IN_0_5_17), as placeholders that fail if anything touches them.

Each run is a child process, so that activation happens before the test modules import sglang,
and upstream's own `conftest.py` of that directory comes with its files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from sglang.test.ci.ci_register import register_cpu_ci

import pytest

from conftest import PATCHED_TREE
from sglang_ext import activation
from sglang_ext.knobs import load_settings
from sglang_ext.versions import installed_sglang_version

register_cpu_ci(est_time=150, suite="base-a-test-cpu")

_PI05_UNIT_TESTS = ("test_pi05_action_api.py", "test_parallel_linear_weight_loading.py", "test_pi05_runtime_helpers.py")
UNIT_TESTS = {
    "0.5.17": _PI05_UNIT_TESTS,
    "0.5.23": _PI05_UNIT_TESTS + ("test_scheduler_client.py", "test_ipc_array.py", "test_pi05_segment.py"),
}

# file -> the tests that run. Left out, and why:
#   test_pi05_runtime_helpers.py: test_vla_split_group_marks_all_action_ranks,
#     test_runai_direct_gpu_loader_does_not_reject_split_roles,
#     test_action_parallel_info_reports_single_rank_without_process_group (parallel groups and
#     the loader, not ported); test_pi05_siglip_reuses_srt_model_with_layerwise_groups,
#     test_pi05_siglip_checkpoint_names_map_to_srt_layers (0.5.18's srt SigLIP tower, not
#     ported); test_uint8_resize_rounds_before_normalization,
#     test_normalized_float_image_is_not_normalized_twice (image preprocessing, not ported).
#   test_parallel_linear_weight_loading.py: the merged-column / QKV scale tests (0.5.17's own
#     parallel layers, not ported; only MergedReplicatedLinear is).
#   test_pi05_action_api.py: test_action_metadata_reports_policy_shape_and_capabilities (also
#     asserts 0.5.18's served_model_name and kv_gather_degree, not ported; the cuda_graph block
#     it checks is covered by test_pi05_linear_config.py); the request/response/msgpack tests
#     (the action API itself, not ported).
UPSTREAM_0_5_19 = {
    "test_pi05_runtime_helpers.py": (
        "test_denoise_graph_skips_prefix_copy_for_same_digest",
        "test_denoise_graph_copies_mutable_prefix_graph_output",
        "test_denoise_graph_capacity_falls_back_without_capturing_new_signature",
        "test_zero_denoise_graph_capacity_disables_runner",
        "test_graph_cache_evicts_lru_and_releases_graph",
        "test_graph_cache_releases_lru_before_new_capture",
        "test_non_evicting_graph_cache_rejects_new_signature_at_capacity",
        "test_graph_cache_info_tracks_hits_misses_and_failures",
        "test_zero_graph_capacity_disables_both_runners",
        "test_prefix_prompt_bucket_preserves_tokens_and_masks",
        "test_prefix_prompt_bucket_preserves_mask_holes",
        "test_prompt_bucket_selection_and_exact_tail",
        "test_effective_token_length_uses_last_visible_position",
        "test_pi05_graph_config_validation",
        "test_prefix_cache_key_distinguishes_bucket_layouts_and_mask_holes",
        "test_bucket_miss_keeps_action_denoise_eager",
        "test_default_prefix_graph_keeps_exact_prompt_signatures",
        "test_prefix_prompt_lengths_share_bucket_graph_signature",
        "test_prefix_graph_rejects_tensor_parallel_prefix",
        "test_prefix_graph_rejects_partial_language_offload",
        "test_pi05_loader_maps_unfused_prefix_weights_to_parallel_targets",
        "test_prefix_language_embedding_matches_openpi_scale",
        "test_cached_pi05_sinusoidal_scaling_is_bit_exact",
        "test_prepare_denoise_layout_matches_per_step_construction",
        "test_sample_actions_only_hoists_denoise_layout_for_eager",
    ),
    "test_parallel_linear_weight_loading.py": (
        "test_merged_replicated_linear_loads_independent_weight_shards",
        "test_merged_replicated_linear_loads_independent_scalar_shards",
    ),
    "test_pi05_action_api.py": (
        "test_action_metadata_reports_effective_graph_availability",
    ),
}

# Imported at module level by the selected files, used only by tests left out ("module:name" for a
# name, a plain dotted name for a whole module): the siglip tests, the action sampling-params tests.
ABSENT_IN_0_5_17 = (
    "sglang.multimodal_gen.runtime.models.vlas.pi05_core:Pi05SiglipVisionModel",
    "sglang.multimodal_gen.configs.sample.action",
)

_CHILD = """
import importlib, json, os, sys
import pytest
spec = json.loads(sys.argv[1])
# the plugin, or on the patched tree the copy the fork series vendors (sglang.ext)
patched = os.environ.get("EXT_TEST_TREE", "plugin") == "patched"
activation = importlib.import_module("sglang.ext.activation" if patched else "sglang_ext.activation")
statuses = activation.activate(eager=True)
for name in spec["applied"]:
    assert statuses[name].state == "applied", statuses[name]

class Absent:
    def __init__(self, name):
        self.name = name
    def __call__(self, *args, **kwargs):
        raise AssertionError(f"{self.name} is not in sglang 0.5.17: a selected test uses it")
    __getattr__ = __call__

for dotted in spec["absent"]:
    module, _, name = dotted.partition(":")
    if name:
        module = importlib.import_module(module)
        assert not hasattr(module, name), f"{dotted} exists in 0.5.17: take it out of the shim"
        setattr(module, name, Absent(dotted))
        continue
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        assert exc.name == module, exc
    else:
        raise AssertionError(f"{module} exists in 0.5.17: take it out of the shim")
    placeholder = type(sys)(module)
    placeholder.__getattr__ = lambda name, module=module: Absent(f"{module}:{name}")
    sys.modules[module] = placeholder

class Outcomes:
    seen = {}
    def pytest_runtest_logreport(self, report):
        name = report.nodeid.rpartition("::")[2]
        if report.outcome != "passed":  # a failed or skipped phase wins
            Outcomes.seen[name] = report.outcome
        elif report.when == "call":
            Outcomes.seen.setdefault(name, "passed")

code = pytest.main(["-q", "-p", "no:cacheprovider", "--import-mode=importlib", "--rootdir", spec["dir"]]
                   + spec["args"], plugins=[Outcomes()])
with open(spec["result"], "w") as f:
    json.dump(Outcomes.seen, f)
sys.exit(code)
"""


def _run_unit_tests(tmp_path, unit_dir, args, applied, absent=()):
    """Run pytest on `args` (paths / node ids under `unit_dir`) in a child with the patches active;
    returns ({test name: outcome}, output)."""
    result_path = tmp_path / "outcomes.json"
    spec = {"dir": str(unit_dir), "args": args, "applied": list(applied), "absent": list(absent),
            "result": str(result_path)}
    env = dict(os.environ, SGLANG_EXT="1", SGLANG_EXT_STRICT="1")
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert result_path.exists(), output
    outcomes = json.loads(result_path.read_text())
    assert proc.returncode == 0, output
    return outcomes, output


def test_installed_sglang_pi05_unit_tests_pass_with_patches(tmp_path):
    import sglang

    version = installed_sglang_version()
    unit = os.path.join(os.path.dirname(sglang.__file__), "multimodal_gen", "test", "unit")
    # every patch that applies to this release, applied (the child checks)
    plan = activation.plan(load_settings({"SGLANG_EXT": "1"}), version=version)
    applied = () if PATCHED_TREE else tuple(n for n, st in plan.items() if st.state == activation.ARMED)
    outcomes, output = _run_unit_tests(tmp_path, unit, [os.path.join(unit, n) for n in UNIT_TESTS[version]], applied)
    # upstream's own CUDA-only tests skip themselves on the CPU; everything else passes
    assert outcomes and set(outcomes.values()) <= {"passed", "skipped"}, (outcomes, output)
    assert list(outcomes.values()).count("passed") > 10 * list(outcomes.values()).count("skipped"), outcomes


@pytest.mark.skipif(installed_sglang_version() != "0.5.17", reason="0.5.19's tests of what 0.5.17 gets backported")
def test_sglang_0_5_19_pi05_unit_tests_pass_on_patched_0_5_17(tmp_path, released_tree):
    wheel_unit = os.path.join(released_tree("0.5.19"), "sglang", "multimodal_gen", "test", "unit")
    unit = tmp_path / "unit"  # upstream's files outside the wheel's tree: its `sglang/` never on sys.path
    unit.mkdir()
    for name in ("conftest.py", *UPSTREAM_0_5_19):
        shutil.copy(os.path.join(wheel_unit, name), unit / name)
    node_ids = [f"{unit / file}::{test}" for file, tests in UPSTREAM_0_5_19.items() for test in tests]
    applied = () if PATCHED_TREE else ("pi05_graphs", "pi05_merged_linear", "pi05_config")
    outcomes, output = _run_unit_tests(tmp_path, unit, node_ids, applied, ABSENT_IN_0_5_17)
    want = {test: "passed" for tests in UPSTREAM_0_5_19.values() for test in tests}
    assert outcomes == want, (sorted(set(outcomes.items()) ^ set(want.items())), output)
