"""Which implementation serves a tensor: the Triton kernel or the torch reference.

triton is imported here, once, when the first kernel module is imported; the
kernels are defined only when it imports. `TRITON_INTERPRET=1` must be in the
environment before that import for CPU tensors to run the kernels.
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: references only
    triton = None
    tl = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# triton's interpreter multiplies bfloat16 tl.dot operands wrongly (3.8: ~1e11 off); under it the
# kernels upcast dot operands to float32 first (a constexpr: the GPU kernels are unchanged).
DOT_UPCAST = INTERPRET


def runs_triton(tensor) -> bool:
    """True: `tensor` goes to the Triton kernel (CUDA, or CPU under the interpreter)."""
    if triton is None:
        return False
    return tensor.is_cuda or (INTERPRET and tensor.device.type == "cpu")


def block_size(n: int) -> int:
    """Smallest power of two >= n (Triton blocks are powers of two; masks cut the rest)."""
    return 1 << max(0, int(n) - 1).bit_length()
