"""`MergedReplicatedLinear`: packed non-TP projections with shard-aware loading.

Target symbols:
    sglang.multimodal_gen.runtime.layers.linear  (adds class MergedReplicatedLinear,
        a ReplicatedLinear subclass; relies on ReplicatedLinear.__init__ accepting
        `output_sizes` and binding `weight_loader=self.weight_loader`, and on
        adjust_scalar_to_fused_array)
sglang versions: 0.5.17 (fingerprint-gated; 0.5.19 has the class upstream).
Upstream PR: the Pi0.5 bounded-graph PR released in 0.5.19 (supersedes #34588).

Why: non-TP PiGemma layers on 0.5.17 issue three Q/K/V GEMMs and two gate/up
GEMMs (plus a `torch.cat`) per layer; Pi0.5 is launch-bound, so every launch
counts. One packed weight means one GEMM.

How: the class is upstream's (same name, constructor and `weight_loader`
contract) with clearer errors: an unknown shard id lists the valid ones, and a
shape mismatch names the layer prefix, the parameter, the shard and both shapes.
`pi05_gemma_mlp` / `pi05_gemma_attention` switch PiGemma's non-TP branches to it.
0.5.17's Pi0.5 loader already maps checkpoint q/k/v and gate/up tensors to
`qkv_proj` shards "q"/"k"/"v" and `gate_up_proj` shards 0/1
(`Pi05PolicyModel._FUSED_WEIGHT_MAPPINGS`, used by the TP branch), so separate-
tensor checkpoints load unchanged.

Retire when: the minimum supported sglang is >= 0.5.19.
"""

from __future__ import annotations

import torch
from torch.nn.parameter import Parameter

from sglang.multimodal_gen.runtime.layers.linear import (
    ReplicatedLinear,
    adjust_scalar_to_fused_array,
)
from sglang.multimodal_gen.runtime.layers.quantization.configs.base_config import (
    QuantizationConfig,
)

_QKV_SHARD_INDEX = {"q": 0, "k": 1, "v": 2}


class MergedReplicatedLinear(ReplicatedLinear):
    """Several logical projections stored in one replicated weight (one GEMM).

    The non-tensor-parallel counterpart of `MergedColumnParallelLinear`: the
    output is the concatenation of the logical outputs in `output_sizes` order,
    and `weight_loader(param, tensor, shard_id)` writes one logical projection.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        self.output_sizes = list(output_sizes)
        super().__init__(
            input_size=input_size,
            output_size=sum(self.output_sizes),
            bias=bias,
            skip_bias_add=skip_bias_add,
            params_dtype=params_dtype,
            quant_config=quant_config,
            output_sizes=self.output_sizes,
            prefix=prefix,
        )

    def _shard_index(self, loaded_shard_id: int | str) -> int:
        if isinstance(loaded_shard_id, str):
            index = _QKV_SHARD_INDEX.get(loaded_shard_id)
        elif isinstance(loaded_shard_id, int) and not isinstance(loaded_shard_id, bool):
            index = loaded_shard_id
        else:
            index = None
        if index is None or not 0 <= index < len(self.output_sizes):
            raise ValueError(
                f"Invalid merged shard id: {loaded_shard_id!r} for {self._describe()}; "
                f"allowed: integers 0..{len(self.output_sizes) - 1} or 'q', 'k', 'v' (0, 1, 2)"
            )
        return index

    def _describe(self, param: torch.Tensor | None = None) -> str:
        name = "parameter"
        for attr in ("weight", "bias"):
            if param is not None and getattr(self, attr, None) is param:
                name = attr
        where = f" {self.prefix!r}" if getattr(self, "prefix", "") else ""
        return f"MergedReplicatedLinear{where} {name} (output_sizes={self.output_sizes})"

    def weight_loader(
        self,
        param: Parameter,
        loaded_weight: torch.Tensor,
        loaded_shard_id: int | str | None = None,
    ) -> None:
        if loaded_shard_id is None:  # an already packed tensor
            return super().weight_loader(param, loaded_weight)

        index = self._shard_index(loaded_shard_id)
        param_data = param.data
        output_dim = getattr(param, "output_dim", None)
        if output_dim is not None:
            offset = sum(self.output_sizes[:index])
            param_data = param_data.narrow(output_dim, offset, self.output_sizes[index])
        elif getattr(param, "is_metadata", False):
            # Metadata rows (e.g. GGUF type ids) hold one equally sized block per shard.
            size = loaded_weight.shape[0]
            param_data = param_data.narrow(0, index * size, size)
        elif getattr(param, "needs_scalar_to_array", False):
            # One scale per logical matrix (AutoFP8 / compressed-tensors).
            param_data, loaded_weight = adjust_scalar_to_fused_array(param_data, loaded_weight, index)

        if tuple(param_data.shape) != tuple(loaded_weight.shape):
            raise ValueError(
                f"Tried to load merged shard {loaded_shard_id!r} of size {tuple(loaded_weight.shape)} "
                f"to a parameter slice of size {tuple(param_data.shape)} "
                f"({self._describe(param)})"
            )
        param_data.copy_(loaded_weight)


def patch_linear(ctx, module) -> None:
    """Part for `sglang.multimodal_gen.runtime.layers.linear`: add the class."""
    ctx.transplant_function(module, MergedReplicatedLinear)
