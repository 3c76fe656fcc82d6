"""Qwen2.5-VL's ViT graph path: the attention layout key from CPU metadata, no device sync.

Patch: vit_cuda_graph
Targets: sglang.srt.models.qwen2_5_vl:Qwen2_5_VisionTransformer.forward_with_cuda_graph
Upstream PR: sgl-project/sglang#37043
Retire when: upstream bounds the ViT graph count, frees retired workspaces and returns owned outputs

Why: the graph path syncs on its host-to-device copies and rotary indexing; 0.5.17's also gives the runner
device cu_seqlens only (a key needs a sync). Releases: 0.5.17, 0.5.23.
How: inputs built from the host's grid (boundaries as Python ints: the runner's attention_layout_key),
host tensors copied non-blocking from pinned memory.
"""

from __future__ import annotations

import torch

from sglang.srt.models.utils import permute_inv
from sglang_ext.graphs.host_copy import to_device
from sglang_ext.graphs.keys import cumulative_lengths, dedup_consecutive, grid_thw_lengths
from sglang_ext.vit.runner import bind_runner


def rot_pos_emb(vit, grid_thw):
    """sglang's `rot_pos_emb`, position ids copied without a sync, ints as `rot_pos_ids` arguments (its lru_cache
    hits: tensor scalars hash by identity)."""
    pos_ids = []
    for t, h, w in grid_thw.tolist():
        base = vit.rot_pos_ids(h, w, vit.spatial_merge_size)
        pos_ids.append(base if t == 1 else base.repeat(t, 1))
    pos_ids = to_device(torch.cat(pos_ids, dim=0), vit.device)
    table = vit.rotary_pos_emb(torch.arange(int(grid_thw[:, 1:].max()), device=vit.device))
    return table[pos_ids].flatten(1)


def _by_window(rows, window_index, group):
    """`rows` regrouped window by window: consecutive groups of `group` rows taken in `window_index` order."""
    return rows.unflatten(0, (-1, group))[window_index].flatten(0, 1)


def forward_with_cuda_graph(self, x, grid_thw):
    """Inputs from host metadata (the layout key too); every host-to-device copy non-blocking from pinned memory."""
    if isinstance(grid_thw, torch.Tensor) and grid_thw.device.type != "cpu":
        grid_thw = grid_thw.cpu()  # sglang reads it on the host anyway (get_window_index, rot_pos_emb)
    hidden = self.patch_embed(to_device(x, self.device, self.dtype))
    window_index, window_boundaries = self.get_window_index(grid_thw)
    window_layout = dedup_consecutive(int(v) for v in window_boundaries)  # == torch.unique_consecutive
    full_layout = (0,) + cumulative_lengths(grid_thw_lengths(grid_thw))  # leading zero doubled, as sglang's
    window_index = to_device(window_index, hidden.device)

    angles = _by_window(rot_pos_emb(self, grid_thw).to(device=hidden.device, dtype=hidden.dtype), window_index,
                        self.spatial_merge_unit).repeat(1, 2)
    return self.cuda_graph_runner.run(
        x=_by_window(hidden, window_index, self.spatial_merge_unit), position_embeddings=(angles.cos(), angles.sin()),
        cu_seqlens=torch.tensor(full_layout, dtype=torch.int32).to(hidden.device, non_blocking=True),
        cu_window_seqlens=torch.tensor(window_layout, dtype=torch.int32).to(hidden.device, non_blocking=True),
        output_indices=permute_inv(window_index), attention_layout_key=(full_layout, window_layout))


def patch_qwen2_5_vl(ctx, module) -> None:
    bind_runner(ctx, module)
    ctx.setattr(module.Qwen2_5_VisionTransformer, "forward_with_cuda_graph", forward_with_cuda_graph)
