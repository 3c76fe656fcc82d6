"""`MergedReplicatedLinear` (0.5.19's class): several replicated projections in one packed weight, one GEMM.

Patch: pi05_merged_linear
Targets: sglang.multimodal_gen.runtime.layers.linear:ReplicatedLinear
Upstream PR: sgl-project/sglang Pi0.5 bounded CUDA graph cache PR (0.5.19, supersedes #34588)
Retire when: the minimum supported sglang has MergedReplicatedLinear (>= 0.5.19)

Why: 0.5.17 has no non-TP packed layer, so PiGemma's non-TP projections run one GEMM each.
How: a ReplicatedLinear subclass under upstream's name whose weight_loader writes the projection `shard_id` names.
"""

from __future__ import annotations

import torch

from sglang.multimodal_gen.runtime.layers.linear import ReplicatedLinear, adjust_scalar_to_fused_array

_QKV_SHARD_INDEX = {"q": 0, "k": 1, "v": 2}


class MergedReplicatedLinear(ReplicatedLinear):
    """Several projections in one replicated weight, outputs concatenated: a non-TP `MergedColumnParallelLinear`."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True, **kwargs):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias, output_sizes=self.output_sizes, **kwargs)

    def _describe(self, param: torch.Tensor | None = None) -> str:
        name = next((attr for attr, value in self.named_parameters(recurse=False) if value is param), "parameter")
        where = f" {self.prefix!r}" if getattr(self, "prefix", "") else ""
        return f"MergedReplicatedLinear{where} {name} (output_sizes={self.output_sizes})"

    def weight_loader(self, param: torch.nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: int | str | None = None) -> None:
        if loaded_shard_id is None:  # an already packed tensor
            return super().weight_loader(param, loaded_weight)

        index = _QKV_SHARD_INDEX.get(loaded_shard_id) if isinstance(loaded_shard_id, str) else loaded_shard_id
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(self.output_sizes):
            raise ValueError(f"Invalid merged shard id: {loaded_shard_id!r} for {self._describe()}; "
                             f"allowed: integers 0..{len(self.output_sizes) - 1} or 'q', 'k', 'v' (0, 1, 2)")
        param_data = param.data
        if (output_dim := getattr(param, "output_dim", None)) is not None:
            param_data = param_data.narrow(output_dim, sum(self.output_sizes[:index]), self.output_sizes[index])
        elif getattr(param, "is_metadata", False):
            # Metadata rows (e.g. GGUF type ids) hold one equally sized block per shard.
            size = loaded_weight.shape[0]
            param_data = param_data.narrow(0, index * size, size)
        elif getattr(param, "needs_scalar_to_array", False):
            # One scale per logical matrix (AutoFP8 / compressed-tensors).
            param_data, loaded_weight = adjust_scalar_to_fused_array(param_data, loaded_weight, index)

        if tuple(param_data.shape) != tuple(loaded_weight.shape):
            raise ValueError(f"Tried to load merged shard {loaded_shard_id!r} of size {tuple(loaded_weight.shape)} "
                             f"to a parameter slice of size {tuple(param_data.shape)} ({self._describe(param)})")
        param_data.copy_(loaded_weight)


def patch_linear(ctx, module) -> None:
    ctx.setattr(module, "MergedReplicatedLinear", MergedReplicatedLinear)
