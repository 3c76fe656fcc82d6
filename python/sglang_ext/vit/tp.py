"""Tensor parallelism of the ViT graphs: the tower's group, and local stand-ins for its collectives in the warm-up."""

import contextlib

import torch

from sglang.srt.layers.dp_attention import is_dp_attention_enabled
from sglang.srt.runtime_context import get_parallel


def agreeing_group(vit):
    """The group the tower's TP collectives run on, when its ranks must agree (else None: a DP encoder
    captures rank-locally, a world of one agrees with itself). The vision linears reduce over the
    attention-TP group under DP attention, over the TP group otherwise."""
    if getattr(vit, "use_data_parallel", False):
        return None
    try:
        dp_attention = is_dp_attention_enabled()
    except Exception:  # noqa: BLE001 - no runtime flags published (unit tests, offline use): plain TP
        dp_attention = False
    group = get_parallel().attn_tp_group if dp_attention else get_parallel().tp_group
    return group if getattr(group, "world_size", 1) > 1 else None


class LocalCollectives:
    """The group's all-reduce / all-gather as local stand-ins for the warm-up (no peer can be left waiting)."""

    _MISSING = object()

    def __init__(self, group):
        self.group = group
        self.saved = {}

    def __enter__(self):
        world = self.group.world_size

        def all_gather(input_, dim=-1, output_tensor_list=None):
            if output_tensor_list is not None:
                for out in output_tensor_list:
                    out.copy_(input_)
                return None
            return torch.cat([input_] * world, dim=dim)

        for name, stand_in in (("all_reduce", lambda input_: input_), ("all_gather", all_gather)):
            self.saved[name] = self.group.__dict__.get(name, self._MISSING)
            setattr(self.group, name, stand_in)
        return self

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            if value is self._MISSING:
                delattr(self.group, name)
            else:
                setattr(self.group, name, value)
        return False


def warm_up_context(group):
    """Local stand-ins on the tower's group (and the TP group) for `with`, when there is a group."""
    if group is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    groups = []
    for candidate in (group, get_parallel().tp_group):
        if all(candidate is not seen for seen in groups):
            groups.append(candidate)
            stack.enter_context(LocalCollectives(candidate))
    return stack
