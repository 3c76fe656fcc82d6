"""Build sglang's real (0.5.17, 0.5.23) Qwen2.5-VL / Qwen3-VL vision towers with random weights, outside a server.

Shared by the GPU tests (test_vit_cuda_graph_cuda.py) and scripts/bench_vit.py. Not a
test module. What a server would do first is done here: publish runtime settings (the
tower reads the vision attention backend from them). Where sgl_kernel's compiled ops are
not loaded (a machine carrying stand-ins), every sglang `MultiPlatformOp` (RMSNorm,
SiluAndMul, ...) is switched to its `forward_native` torch implementation; with the real
sgl_kernel they stay on it. Attention is sglang's real backend: triton_attn, or fa3
(FlashAttention-3 from sgl_kernel's flash_ops) where it loads. `kernel_report()` says which.
"""

from __future__ import annotations

import contextlib
import os
import random
from types import SimpleNamespace
from typing import List, Sequence, Tuple

import torch

# (patch_size 14, spatial merge 2): a grid side must be even.
SMALL_CONFIG = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=64,
                    fullatt_block_indexes=[1, 3], window_size=112, patch_size=14, spatial_merge_size=2,
                    temporal_patch_size=2, in_channels=3, hidden_act="silu")
# Qwen2.5-VL-7B-Instruct's vision tower.
QWEN2_5_VL_7B_CONFIG = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                            fullatt_block_indexes=[7, 15, 23, 31], window_size=112, patch_size=14,
                            spatial_merge_size=2, temporal_patch_size=2, in_channels=3, hidden_act="silu")


def publish_runtime(mm_attention_backend: str = "triton_attn") -> None:
    """Server settings the tower reads (fa3 then loads sgl_kernel's FlashAttention-3: 0.5.17's default,
    SGLANG_USE_SGL_FA3_KERNEL=1)."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    runtime_context.publish(
        ServerArgs(model_path="dummy", mm_attention_backend=mm_attention_backend, device="cpu"), role="test")


@contextlib.contextmanager
def world_of_one():
    """TP and PP worlds of one for a tower built and run on CPU without a parallel state: 0.5.17's layers
    call their modules' group getters, later releases read `get_parallel()`."""
    import pytest

    from sglang.srt.layers import linear, vocab_parallel_embedding
    from sglang.srt.models import qwen3_vl
    from sglang.srt.runtime_context import get_parallel

    one = SimpleNamespace(world_size=1, rank_in_group=0, is_first_rank=True, is_last_rank=True)
    if not hasattr(linear, "get_tp_group"):
        with get_parallel().override(pp_group=one, tp_group=one, attn_tp_group=one):
            yield
        return
    with pytest.MonkeyPatch.context() as patch:
        for module, getter in ((linear, "get_tp_group"), (vocab_parallel_embedding, "get_tp_group"),
                               (qwen3_vl, "get_pp_group")):
            patch.setattr(module, getter, lambda: one)
        yield


def use_native_ops(module: torch.nn.Module) -> int:
    """Route every sglang fused/multi-platform op to forward_native (no sgl_kernel); returns how many.

    0.5.17: ops derive from `MultiPlatformOp`; 0.5.19 adds the `BaseFusedOp` base (RMSNorm
    derives from it directly). Both cache the dispatch target in `_forward_method`.
    """
    from sglang.srt.layers.utils.multi_platform import MultiPlatformOp

    bases = [MultiPlatformOp]
    try:
        from sglang.kernels.fused_op import BaseFusedOp

        bases.append(BaseFusedOp)
    except ImportError:
        pass
    count = 0
    for sub in module.modules():
        base = next((b for b in bases if isinstance(sub, b)), None)
        if base is not None and type(sub).forward_native is not getattr(base, "forward_native", None):
            sub._forward_method = sub.forward_native
            count += 1
    return count


def sgl_kernel_ops_loaded() -> bool:
    """sgl_kernel's compiled common ops are registered (not a stand-in package, not absent)."""
    try:
        import sgl_kernel  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or broken: not real
        return False
    return hasattr(torch.ops.sgl_kernel, "rmsnorm")


def fa3_loaded() -> bool:
    """FlashAttention-3 of sgl_kernel (flash_ops) imports and registered its forward op."""
    try:
        import sgl_kernel.flash_attn  # noqa: F401  (imports sgl_kernel.flash_ops or raises)
    except Exception:  # noqa: BLE001
        return False
    import sys

    return "sgl_kernel.flash_ops" in sys.modules and hasattr(torch.ops.sgl_kernel, "fwd")


# SGX_BACKENDS: the vision attention backends a GPU run covers, read as the real-server tests read it
# (test/registered/server/vl_server_kit.py): comma-separated, default "default,triton_attn"; "default" is
# sglang's default, which is fa3 on SM90. A GPU call made before FA3 has arrived sets SGX_BACKENDS=triton_attn.
DEFAULT_SGX_BACKENDS = "default,triton_attn"


def requested_backends() -> Tuple[str, ...]:
    raw = os.environ.get("SGX_BACKENDS", DEFAULT_SGX_BACKENDS)
    return tuple(name.strip() for name in raw.split(",") if name.strip())


def fa3_requested() -> bool:
    """Whether this run asked for fa3: by name, or as sglang's default on an SM90 GPU."""
    names = requested_backends()
    if "fa3" in names:
        return True
    return "default" in names and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def require_fa3() -> None:
    """In an fa3 test: skip when this run did not ask for fa3; FAIL when it did and FA3 does not import
    (a requested backend that cannot load is an error of the run, not a reason to skip)."""
    import pytest

    requested = os.environ.get("SGX_BACKENDS", DEFAULT_SGX_BACKENDS)
    if not fa3_requested():
        pytest.skip(f"SGX_BACKENDS={requested!r} does not ask for fa3")
    if not fa3_loaded():
        pytest.fail(f"fa3 requested (SGX_BACKENDS={requested!r}) but FA3 does not import (sgl_kernel.flash_attn / "
                    "flash_ops): carry .carry/fa3-* (scripts/gpu_carry.sh), or set SGX_BACKENDS=triton_attn",
                    pytrace=False)


def kernel_report(backend: str) -> dict:
    """What actually runs, detected now: the vision attention backend and its implementation, and the ops."""
    report = {"attention_backend": backend, "sgl_kernel_ops": "real" if sgl_kernel_ops_loaded() else "native torch"}
    if backend == "fa3":
        try:
            from sglang.kernels.ops.attention.flash_attention_v3 import _load_fa3_kernels

            impl = _load_fa3_kernels()["flash_attn_varlen_func"]
            report["fa3"] = f"{getattr(impl, '__module__', '?')} ({'real flash_ops' if fa3_loaded() else 'NOT flash_ops'})"
        except Exception as exc:  # noqa: BLE001
            report["fa3"] = f"unavailable: {type(exc).__name__}"
    return report


def build_qwen2_5_tower(config: dict = SMALL_CONFIG, *, dtype=torch.float32, device="cuda", seed: int = 0,
                        graphs: bool = True, native_ops=None, use_data_parallel: bool = True):
    """sglang's Qwen2_5_VisionTransformer with random weights; `graphs` builds its ViT graph runner.

    `use_data_parallel=False` shards the tower over sglang's TP group (its parallel state must exist);
    every rank fills its own shards from the same seed.
    """
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    from sglang.srt.models import qwen2_5_vl

    previous = os.environ.get("SGLANG_VIT_ENABLE_CUDA_GRAPH")
    os.environ["SGLANG_VIT_ENABLE_CUDA_GRAPH"] = "1" if graphs else "0"
    try:
        vit = qwen2_5_vl.Qwen2_5_VisionTransformer(Qwen2_5_VLVisionConfig(**config),
                                                     use_data_parallel=use_data_parallel)
    finally:
        if previous is None:
            os.environ.pop("SGLANG_VIT_ENABLE_CUDA_GRAPH", None)
        else:
            os.environ["SGLANG_VIT_ENABLE_CUDA_GRAPH"] = previous
    return _random_weights_on(vit, dtype=dtype, device=device, seed=seed, native_ops=native_ops)



def _random_weights_on(vit, *, dtype, device, seed, native_ops):
    """`vit` with seeded random weights (biases 0, norms 1), on `device` in `dtype`, in eval mode."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in vit.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif "norm" in name or "ln_q" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    # sgl_kernel's rmsnorm has bf16/fp16 kernels only: fp32 towers run sglang's native ops.
    if native_ops if native_ops is not None else (dtype == torch.float32 or not sgl_kernel_ops_loaded()):
        use_native_ops(vit)
    return vit.to(device=device, dtype=dtype).eval()


# A small Qwen3-VL vision tower (patch 16, merge 2, deepstack after blocks 1 and 2).
QWEN3_SMALL_CONFIG = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=64,
                          num_position_embeddings=2304, deepstack_visual_indexes=[1, 2], patch_size=16,
                          spatial_merge_size=2, temporal_patch_size=2, in_channels=3, hidden_act="gelu_pytorch_tanh")
QWEN3_PATCH_DIM = 3 * 2 * 16 * 16


def build_qwen3_tower(config: dict = QWEN3_SMALL_CONFIG, *, dtype=torch.float32, device="cuda", seed: int = 0,
                      native_ops=None):
    """sglang's Qwen3VLMoeVisionModel with random weights (it builds its graph runner itself)."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    from sglang.srt.models import qwen3_vl

    vit = qwen3_vl.Qwen3VLMoeVisionModel(Qwen3VLVisionConfig(**config), use_data_parallel=True)
    return _random_weights_on(vit, dtype=dtype, device=device, seed=seed, native_ops=native_ops)


def forward_qwen3(vit, pixels: torch.Tensor, grid_thw: torch.Tensor, *, graph: bool) -> torch.Tensor:
    """Qwen3's tower picks its graph path from SGLANG_VIT_ENABLE_CUDA_GRAPH at every forward."""
    previous = os.environ.get("SGLANG_VIT_ENABLE_CUDA_GRAPH")
    os.environ["SGLANG_VIT_ENABLE_CUDA_GRAPH"] = "1" if graph else "0"
    try:
        with torch.inference_mode():
            return vit(pixels.to(vit.device), grid_thw)
    finally:
        if previous is None:
            os.environ.pop("SGLANG_VIT_ENABLE_CUDA_GRAPH", None)
        else:
            os.environ["SGLANG_VIT_ENABLE_CUDA_GRAPH"] = previous


def random_batch(rng: random.Random, sides: Sequence[int], *, max_images: int = 4, patch_dim: int = 3 * 2 * 14 * 14,
                 dtype=torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """1..max_images images, each (t=1, h, w) with h, w drawn from `sides` (even patch counts); CPU tensors."""
    grid = [[1, rng.choice(sides), rng.choice(sides)] for _ in range(rng.randint(1, max_images))]
    tokens = sum(t * h * w for t, h, w in grid)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    return torch.randn(tokens, patch_dim, generator=g, dtype=dtype), torch.tensor(grid, dtype=torch.int64)


def forward(vit, pixels: torch.Tensor, grid_thw: torch.Tensor, *, graph: bool) -> torch.Tensor:
    """One tower forward through the graph runner (`graph=True`) or sglang's eager path."""
    previous = vit.enable_cg
    vit.enable_cg = graph
    try:
        with torch.inference_mode():
            return vit(pixels, grid_thw)
    finally:
        vit.enable_cg = previous


def grid_list(grid_thw: torch.Tensor) -> List[List[int]]:
    return [list(map(int, row)) for row in grid_thw.tolist()]


from sglang_ext_testkit.single_rank import init_single_rank_parallel_state  # noqa: E402,F401
