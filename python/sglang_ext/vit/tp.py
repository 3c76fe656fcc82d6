"""Tensor parallelism of the ViT graphs: the tower's group, and local stand-ins for its collectives in the warm-up."""

import contextlib

import torch

from sglang.srt.layers.dp_attention import is_dp_attention_enabled
from sglang.srt.runtime_context import get_parallel
from sglang_ext.patching import PatchContext


def agreeing_group(vit):
    """The group the tower's TP collectives run on when its ranks must agree, else None (a DP encoder, a world of
    one). The vision linears reduce over the attention-TP group under DP attention, over the TP group otherwise."""
    if getattr(vit, "use_data_parallel", False):
        return None
    try:
        dp_attention = is_dp_attention_enabled()
    except Exception:  # noqa: BLE001 - no runtime flags published (unit tests, offline use): plain TP
        dp_attention = False
    group = get_parallel().attn_tp_group if dp_attention else get_parallel().tp_group
    return group if getattr(group, "world_size", 1) > 1 else None


@contextlib.contextmanager
def local_collectives(group):
    """While open, the group's all-reduce / all-gather are local stand-ins (a warm-up leaves no peer waiting)."""
    def all_gather(input_, dim=-1, output_tensor_list=None):
        if output_tensor_list is not None:
            for out in output_tensor_list:
                out.copy_(input_)
            return None
        return torch.cat([input_] * group.world_size, dim=dim)

    swaps = PatchContext("vit_cuda_graph warm-up", None)
    try:
        swaps.setattr(group, "all_reduce", lambda input_: input_)
        swaps.setattr(group, "all_gather", all_gather)
        yield
    finally:
        swaps.rollback()


@contextlib.contextmanager
def warm_up_context(group):
    """While open, local stand-ins on the tower's group and the TP group (each once), when there is a group."""
    with contextlib.ExitStack() as stack:
        if group is not None:
            for candidate in {id(g): g for g in (group, get_parallel().tp_group)}.values():
                stack.enter_context(local_collectives(candidate))
        yield
