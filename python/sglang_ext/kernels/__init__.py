"""Fused Triton kernels: small-batch transformer steps (Pi0.5's action expert), the residual add and
LayerNorm of Pi0.5's SigLIP layers, and the ViT's rotary.

Knows nothing of sglang. Each public function runs its Triton kernel on CUDA tensors and its
torch reference (`*_reference`, same signature less `pdl`, same float32 math) elsewhere; with
`TRITON_INTERPRET=1` set before triton is imported, CPU tensors take the kernel through triton's
interpreter (how the CPU tests check them). The interpreter truncates float32 -> bfloat16 instead
of rounding, so interpreted bf16 outputs may differ from the reference by one ulp.
"""

from sglang_ext.kernels.attention import first_rows_attention, first_rows_attention_reference
from sglang_ext.kernels.activation import gelu_tanh_and_mul, gelu_tanh_and_mul_reference
from sglang_ext.kernels.layer_norm import add_layer_norm, add_layer_norm_reference
from sglang_ext.kernels.rms_norm import ada_rms_norm, ada_rms_norm_reference
from sglang_ext.kernels.backend import runs_triton
from sglang_ext.kernels.rope import linear_rope_qkv, linear_rope_qkv_reference, rope_qkv, rope_qkv_reference
from sglang_ext.kernels.rotate_half import rotate_half_qk, rotate_half_qk_reference
from sglang_ext.kernels.skinny_gemm import Partials, skinny_linear, skinny_linear_reference
