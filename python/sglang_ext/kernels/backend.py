"""Which implementation serves a tensor: the Triton kernel or the torch reference (triton imported here, once)."""

from __future__ import annotations

import os
from functools import lru_cache

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: references only
    triton = None
    tl = None
try:  # grid dependency control: triton >= 3.3; without it kernels launch plainly
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# triton's interpreter multiplies bfloat16 tl.dot operands wrongly; under it the kernels upcast
# dot operands to float32 (a constexpr: the GPU kernels are unchanged).
DOT_UPCAST = INTERPRET


def runs_triton(tensor) -> bool:
    """True: `tensor` goes to the Triton kernel (CUDA, or CPU under the interpreter)."""
    return triton is not None and (tensor.is_cuda or (INTERPRET and tensor.device.type == "cpu"))


def block_size(n: int) -> int:
    """Smallest power of two >= n (Triton blocks are powers of two; masks cut the rest)."""
    return 1 << max(0, int(n) - 1).bit_length()


def uses_pdl(tensor, enabled: bool = True) -> bool:
    """True: kernels on `tensor`'s device launch with programmatic dependent launch (sm90+ and `enabled`)."""
    return (enabled and gdc_wait is not None and not INTERPRET and tensor.is_cuda
            and _sm_major(tensor.device.index) >= 9)


@lru_cache(maxsize=None)
def _sm_major(index) -> int:
    import torch

    return torch.cuda.get_device_capability(index)[0]


if triton is not None:

    @triton.jit
    def after_previous_kernel(PDL: tl.constexpr):
        """Under PDL: wait for the previous kernel's completion, then let the next one launch."""
        if PDL:  # triggering first measured slower (the successor's programs crowd the SMs)
            gdc_wait()
            gdc_launch_dependents()
