"""qwen_vit_kit's backend request (SGX_BACKENDS) on the CPU: the GPU suite's fa3 tests fail, never skip,
when the run asked for fa3 and FA3 does not import; they skip only when the run left fa3 out."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="base-a-test-cpu")


from sglang_ext_testkit import qwen_vit_kit as kit  # noqa: E402


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device of compute capability `major` (the request logic reads no more than that)."""

    def make(major):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))

    return make


@pytest.mark.parametrize("backends, major, requested", [
    (None, 9, True),  # the default "default,triton_attn": sglang's default on SM90 is fa3
    ("default", 10, False),  # fa4 is the default there
    ("triton_attn", 9, False),  # a call made before FA3 has arrived
    ("triton_attn,fa3", 10, True),
])
def test_fa3_is_requested_by_name_or_as_the_sm90_default(monkeypatch, gpu, backends, major, requested):
    gpu(major)
    if backends is None:
        monkeypatch.delenv("SGX_BACKENDS", raising=False)
    else:
        monkeypatch.setenv("SGX_BACKENDS", backends)
    assert kit.fa3_requested() is requested


def test_requested_fa3_that_does_not_import_fails(monkeypatch, gpu):
    gpu(9)
    monkeypatch.setattr(kit, "fa3_loaded", lambda: False)
    monkeypatch.delenv("SGX_BACKENDS", raising=False)
    with pytest.raises(pytest.fail.Exception, match="fa3 requested .*'default,triton_attn'.* does not import"):
        kit.require_fa3()
    monkeypatch.setenv("SGX_BACKENDS", "triton_attn")
    with pytest.raises(pytest.skip.Exception, match="'triton_attn' does not ask for fa3"):
        kit.require_fa3()
    monkeypatch.setenv("SGX_BACKENDS", "fa3")
    monkeypatch.setattr(kit, "fa3_loaded", lambda: True)
    kit.require_fa3()  # requested and importable: the test runs
