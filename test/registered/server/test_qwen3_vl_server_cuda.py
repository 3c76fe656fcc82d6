"""Real server, tiny qwen3_vl: sglang-ext ViT graphs vs graphs off vs unpatched 0.5.17 (issue 13 item 3).

Six real `launch_server` processes (fa3 default and triton_attn ViT backends) run concurrently on one
GPU; see vl_server_kit.py for the stream and what each test asserts. Prints one line per claim.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=480, stage="base-b", runner_config="1-gpu-small")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vl_server_kit as kit  # noqa: E402
from vl_server_kit import (  # noqa: E402,F401
    make_run_all_fixture, test_a_signature_depends_on_image, test_b_activation_records,
    test_c_vit_graph_counters, test_f_unpatched_sglang_same_stream, test_g_reserved_memory_flat_after_warmup)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

run_all = make_run_all_fixture("qwen3_vl")


@pytest.fixture(scope="module")
def kind():
    return "qwen3_vl"


# Measured on the H200 (2026-12-01): 0.5.17's own Qwen3-VL graph path (forward_with_cuda_graph) and its
# eager forward differ (tower outputs up to 0.127 apart in bf16, unpatched), so "graphs on equals
# graphs off" does not hold for Qwen3-VL on 0.5.17 whatever the runner does. What sglang-ext owes is
# 0.5.17's graph math, and test_vit_cuda_graph_cuda.py::
# test_qwen3_tower_graph_output_equals_unpatched_0_5_17_graph_output shows it bit for bit. strict:
# once the two upstream paths agree, these pass and must be turned back into plain tests.
upstream_paths_differ = pytest.mark.xfail(strict=True, reason=(
    "sglang 0.5.17's Qwen3-VL graph path differs from its eager forward (measured 0.127 on the tower)"))


@upstream_paths_differ
def test_d_graphs_on_equal_graphs_off(kind, run_all):
    kit.test_d_graphs_on_equal_graphs_off(kind, run_all)


@upstream_paths_differ
def test_e_equal_patch_count_boundaries(kind, run_all):
    kit.test_e_equal_patch_count_boundaries(kind, run_all)


@upstream_paths_differ
def test_h_concurrent_requests_with_mm_embedding_cache(kind, run_all):
    kit.check_concurrent_with_mm_cache(kind, run_all)
