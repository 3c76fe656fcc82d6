"""pi05_fused_norms on the GPU: numerics and CUDA kernel counts of the PiGemma adaRMS norm.

Real 0.5.17 `PiGemmaRMSNorm` modules at Pi0.5's widths (1024: action expert, 2048:
PaliGemma), bf16, random non-zero weights; x is [1, 50, D] (one request, horizon 50),
the condition [1, D]. The patched forward is compared with 0.5.17's math
(0.5.17's own functions, from pi05_pristine.py) and its CUDA kernels are counted with torch.profiler.

Tolerance: both compute in float32 and round to bf16 once; the fused rms_norm
reduces in another order, so results may differ by one bf16 ulp (2^-7 relative)
where the float32 values straddle a rounding boundary. Gates must be identical.
Kernel bound: x.float(), rms_norm, addcmul, add-into-bf16 (4) plus the dense GEMM,
which is 1 kernel with cuBLASLt's bias epilogue, or 2 (bias copy + GEMM) where torch
does not use cuBLASLt for a one-row input: at most 6.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from sglang.test.ci.ci_register import register_cuda_ci

from pi05_pristine import reference_forward, reference_gated_residual

register_cuda_ci(est_time=60, stage="base-b", runner_config="1-gpu-small")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

THIS_PATCH = "pi05_fused_norms"
PATCHED_TREE = os.environ.get("EXT_TEST_TREE", "plugin") == "patched"
TOKENS = 50
BF16_ULP = 2.0**-7
MAX_PATCHED_KERNELS = 6


@pytest.fixture(scope="module")
def pi05_core():
    from sglang.multimodal_gen.runtime.models.vlas import pi05_core

    import importlib

    from sglang_ext.registry import PATCH_NAMES
    from sglang_ext.versions import installed_sglang_version, source_tree_version

    # the plugin, or on the patched tree the copy the fork series vendors (sglang.ext)
    activation = importlib.import_module("sglang.ext.activation" if PATCHED_TREE else "sglang_ext.activation")
    patch = pytest.MonkeyPatch()
    patch.setenv("SGLANG_EXT", "1")
    patch.setenv("SGLANG_EXT_STRICT", "1")
    patch.setenv("SGLANG_EXT_DISABLE", ",".join(n for n in PATCH_NAMES if n != THIS_PATCH))
    if installed_sglang_version() is None:  # unpacked source tree (GPU machine)
        import sglang

        version = source_tree_version(os.path.dirname(os.path.dirname(sglang.__file__)))
        if version:
            patch.setenv("SGLANG_EXT_ASSUME_SGLANG", version)
    activation.deactivate()
    statuses = activation.activate(eager=True)
    assert statuses[THIS_PATCH].state == "applied", statuses[THIS_PATCH]
    print("torch", torch.__version__, torch.cuda.get_device_name())
    yield pi05_core
    activation.deactivate()
    patch.undo()


def _norm(pi05_core, dim: int, adaptive: bool = True):
    gen = torch.Generator().manual_seed(dim)
    norm = pi05_core.PiGemmaRMSNorm(dim, eps=1e-6, cond_dim=dim if adaptive else None)
    with torch.no_grad():
        for param in norm.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return norm.to(device="cuda", dtype=torch.bfloat16)


def _inputs(dim: int):
    gen = torch.Generator().manual_seed(dim + 1)
    x = torch.randn(1, TOKENS, dim, generator=gen) * (1.0 + 4.0 * torch.rand(1, TOKENS, 1, generator=gen))
    cond = torch.randn(1, dim, generator=gen)
    return x.to("cuda", torch.bfloat16), cond.to("cuda", torch.bfloat16)


def _cuda_kernels(fn) -> list:
    """Names of the CUDA kernels (and memcpy/memset) one call of `fn` runs."""
    fn()  # warm-up: cuBLAS handles and workspaces are created outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("dim", [1024, 2048])
def test_adaptive_norm_matches_0_5_17_on_cuda(pi05_core, dim):
    norm = _norm(pi05_core, dim)
    x, cond = _inputs(dim)
    with torch.inference_mode():
        out, gate = norm(x, cond=cond)
        want, want_gate = reference_forward(norm, x, cond)
    diff = (out.float() - want.float()).abs()
    ulps = diff / (BF16_ULP * want.float().abs() + 1e-6)
    print(f"D={dim} cond: max abs diff {diff.max().item():.3g}, max {ulps.max().item():.2f} bf16 ulp, "
          f"{int((diff > 0).sum())} of {diff.numel()} elements differ")
    assert out.dtype == torch.bfloat16 and out.shape == want.shape
    assert ulps.max().item() <= 1.0
    assert torch.equal(gate, want_gate)

    plain = _norm(pi05_core, dim, adaptive=False)
    with torch.inference_mode():
        out, gate = plain(x)
        want, _ = reference_forward(plain, x)
    diff = (out.float() - want.float()).abs()
    print(f"D={dim} weight: max abs diff {diff.max().item():.3g}")
    assert gate is None and bool((diff <= BF16_ULP * want.float().abs() + 1e-6).all())


@pytest.mark.parametrize("dim", [1024, 2048])
def test_adaptive_norm_runs_fewer_cuda_kernels(pi05_core, dim):
    norm = _norm(pi05_core, dim)
    x, cond = _inputs(dim)
    with torch.inference_mode():
        patched = _cuda_kernels(lambda: norm(x, cond=cond))
        original = _cuda_kernels(lambda: reference_forward(norm, x, cond))
        dense = _cuda_kernels(lambda: norm.dense(cond))  # the GEMM both versions run
    print(f"D={dim} cond-path CUDA kernels: patched {len(patched)}, 0.5.17 {len(original)}, "
          f"of which the dense GEMM {len(dense)}")
    print("  patched:", patched)
    print("  0.5.17: ", original)
    # the patch's own kernels: x.float(), rms_norm, addcmul, add into bf16
    assert len(patched) - len(dense) <= 4, patched
    assert len(patched) <= MAX_PATCHED_KERNELS, f"{patched} (the GEMM alone runs {dense})"
    assert len(patched) < len(original)


def test_gated_residual_is_one_kernel(pi05_core):
    gen = torch.Generator().manual_seed(7)
    x, y = (torch.randn(1, TOKENS, 1024, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    gate = torch.randn(1, 1, 1024, generator=gen).to("cuda", torch.bfloat16)
    with torch.inference_mode():
        got = pi05_core.gated_residual(x, y, gate)
        want = reference_gated_residual(x, y, gate)
        patched = _cuda_kernels(lambda: pi05_core.gated_residual(x, y, gate))
        original = _cuda_kernels(lambda: reference_gated_residual(x, y, gate))
    diff = (got.float() - want.float()).abs()
    magnitude = x.float().abs() + (y.float() * gate.float()).abs()
    print(f"gated_residual: max abs diff {diff.max().item():.3g}; kernels patched {len(patched)}, "
          f"0.5.17 {len(original)}")
    assert bool((diff <= BF16_ULP * magnitude + 1e-6).all())
    assert len(patched) == 1 and len(original) == 2, (patched, original)
