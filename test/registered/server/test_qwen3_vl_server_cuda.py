"""Real server, tiny qwen3_vl: sglang-ext ViT graphs vs graphs off vs unpatched 0.5.17.

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


from vl_server_kit import (  # noqa: E402,F401
    check_concurrent_with_mm_cache, make_run_all_fixture, test_a_signature_depends_on_image,
    test_b_activation_records, test_c_vit_graph_counters, test_d_graphs_on_equal_graphs_off,
    test_e_equal_patch_count_boundaries, test_f_unpatched_sglang_same_stream,
    test_g_reserved_memory_flat_after_warmup)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

run_all = make_run_all_fixture("qwen3_vl")


@pytest.fixture(scope="module")
def kind():
    return "qwen3_vl"


# Qwen3-VL, H200 2026-12-01: our graph inputs are built as the eager forward builds them (0.5.17's
# `_prepare_graph_inputs` interpolates the position embedding otherwise), and the graph rotates
# with the float32 cos/sin the tower computes (0.5.17's bf16 buffers made every request differ):
# 8 / 8 passed on fa3 and triton_attn, (d) 200 / 200 and 40 / 40 bitwise, with dynamo off
# (vl_server_kit.MODEL_ENV).
def test_h_concurrent_requests_with_mm_embedding_cache(kind, run_all):
    check_concurrent_with_mm_cache(kind, run_all)
