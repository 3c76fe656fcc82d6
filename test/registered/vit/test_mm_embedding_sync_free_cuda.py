"""GPU: mm_utils's placeholder ids reach the device without a stream sync (patch mm_embedding_sync_free).

torch's own `as_tensor(list, device="cuda")` synchronizes the stream (the check can fail); the patched
one does not, while the stream is still busy, and returns the same tensor.
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.managers import mm_utils
from sglang.test.ci.ci_register import register_cuda_ci

from sglang_ext.registry import PATCH_NAMES

register_cuda_ci(est_time=10, stage="base-b", runner_config="1-gpu-small")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _under_sync_errors(fn):
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_placeholder_ids_reach_cuda_without_a_sync_and_equal_torchs(ext_patches):
    ext_patches(disable=",".join(n for n in PATCH_NAMES if n != "mm_embedding_sync_free"))
    ids = list(range(151655, 151671))
    torch.cuda._sleep(50_000_000)  # the stream busy for tens of ms: a wait would be a real one
    got = _under_sync_errors(lambda: mm_utils.torch.as_tensor(ids, device="cuda"))
    with pytest.raises(RuntimeError, match="synchroniz"):
        _under_sync_errors(lambda: torch.as_tensor(ids, device="cuda"))
    want = torch.as_tensor(ids, device="cuda")
    assert torch.equal(got, want) and got.dtype == want.dtype == torch.int64
    print(f"placeholder ids: {len(ids)} on {got.device} without a stream sync, equal to torch.as_tensor")
