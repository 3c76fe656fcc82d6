"""Qwen3-VL's ViT graph path: eager's inputs and the attention layout key from CPU metadata.

Patch: vit_cuda_graph
Targets: sglang.srt.models.qwen3_vl:Qwen3VLMoeVisionModel.forward_with_cuda_graph
Upstream PR: sgl-project/sglang#37043
Retire when: upstream bounds the ViT graph count, frees retired workspaces and returns owned outputs

Why: `_prepare_graph_inputs` interpolates positions by another rule than eager `forward` (graphs on never equal
graphs off); 0.5.17's gives the runner device cu_seqlens only. Releases: 0.5.17, 0.5.23.
How: inputs built as `forward` builds them, boundaries as Python ints (qwen3_omni_moe's encoder inherits it).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from sglang_ext.graphs.keys import cumulative_lengths
from sglang_ext.vit.runner import bind_runner


def forward_with_cuda_graph(self, x, grid_thw):
    """sglang's `_prepare_graph_inputs`, positions interpolated as eager `forward` does; boundaries as ints."""
    x = self.patch_embed(x.to(device=self.device, dtype=self.dtype, non_blocking=True))
    grid = grid_thw if isinstance(grid_thw, list) else grid_thw.tolist()
    if self._use_vectorized_pos_embed(len(grid)):
        x += self.fast_pos_embed_interpolate_vectorized(grid)
    else:
        x += self.fast_pos_embed_interpolate_from_list(grid)
    rotary_pos_emb_cos, rotary_pos_emb_sin = self.rot_pos_emb(grid)
    # one attention sequence per frame, as eager's token_cu_seqlens
    full_layout = cumulative_lengths([int(h) * int(w) for t, h, w in grid for _ in range(int(t))])
    cu_seqlens = torch.tensor(full_layout, dtype=torch.int32).to(x.device, non_blocking=True)
    # no windows, rotary as cos/sin tables, rows in the tower's order
    return self.graph_runners.run(x=x, cu_seqlens=cu_seqlens, cu_window_seqlens=None, position_embeddings=None,
                                  rotary_pos_emb_cos=rotary_pos_emb_cos, rotary_pos_emb_sin=rotary_pos_emb_sin,
                                  output_indices=None, attention_layout_key=(full_layout, None))


def patch_qwen3_vl(ctx, module) -> None:
    """Part for `sglang.srt.models.qwen3_vl`: the module's runner name, and a runner table of its own
    whose default is that name (the table caches what it built; rollback restores sglang's table)."""
    bind_runner(ctx, module)
    npu = {k: v for k, v in module.graph_runners_dict.items() if k == "npu"}  # others: what the default built
    ctx.setattr(module, "graph_runners_dict", defaultdict(lambda: module.ViTCudaGraphRunner, npu))
    ctx.setattr(module.Qwen3VLMoeVisionModel, "forward_with_cuda_graph", forward_with_cuda_graph)
