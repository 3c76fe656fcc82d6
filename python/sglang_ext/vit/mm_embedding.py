"""Multimodal embedding without a device sync before or after the vision tower.

Patch: mm_embedding_sync_free
Targets: sglang.srt.managers.mm_utils:get_embedding_and_mask, sglang.srt.managers.mm_utils:_adjust_embedding_length,
    sglang.srt.managers.mm_utils:torch
Upstream PR: (sglang 0.5.21: embedding length checked without a sync, placeholder ids from pinned memory)
Retire when: upstream checks the multimodal embedding length without a device sync and copies the
    placeholder ids to the device without one

Why: `_adjust_embedding_length` syncs on `mask.sum().item()` right after the tower, and `embed_mm_inputs`
copies placeholder ids with a pageable `torch.as_tensor(list, device=...)`: each forward first drains the GPU.
How: the multimodal tokens are counted on the host (a match skips the length check); mm_utils sees `torch`
through a proxy whose `as_tensor` copies int lists to CUDA from pinned memory without a wait.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import types

import torch

# Multimodal tokens of the current get_embedding_and_mask call's extend range, counted on the host.
_host_count = contextvars.ContextVar("sglang_ext_mm_tokens_in_extend", default=None)


def tokens_in_extend(items_size, prefix_length, extend_length, items_offset_list) -> int:
    """Multimodal tokens that the extend range of every request covers (offsets are inclusive ranges)."""
    total = 0
    for i in range(min(len(items_size) - 1, len(prefix_length))):
        length = extend_length[i] if i < len(extend_length) else 0
        if items_size[i] == items_size[i + 1] or length <= 0:
            continue
        first, last = prefix_length[i], prefix_length[i] + length - 1
        for start, end in items_offset_list[i]:
            total += max(0, min(end, last) - max(start, first) + 1)
    return total


def _wrap_get_embedding_and_mask(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_embedding_and_mask(*args, **kwargs):
        call = signature.bind(*args, **kwargs).arguments
        token = _host_count.set(tokens_in_extend(call["items_size"], call["prefix_length"], call["extend_length"],
                                                 call["items_offset_list"]))
        try:
            return original(*args, **kwargs)
        finally:
            _host_count.reset(token)

    return get_embedding_and_mask


def _replace_adjust_embedding_length(original):
    @functools.wraps(original)
    def _adjust_embedding_length(embedding, mask, logger):
        if _host_count.get() == embedding.shape[0]:
            return embedding
        return original(embedding, mask, logger)

    return _adjust_embedding_length


def copies_without_a_wait(data, device) -> bool:
    """A list (or tuple) of Python ints bound for a CUDA device, outside a capture."""
    return (isinstance(data, (list, tuple)) and len(data) > 0 and all(type(v) is int for v in data)
            and device is not None and torch.device(device).type == "cuda"
            and not torch.cuda.is_current_stream_capturing())


def pinned_copy(data, dtype, device):
    """`data` on `device` through pinned memory, no wait (the host allocator keeps the block until the copy)."""
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class TorchForMmUtils(types.ModuleType):
    """`torch` as mm_utils sees it: torch's names, and an `as_tensor` that copies int lists without a wait."""

    def __init__(self):
        super().__init__("torch", "torch for sglang.srt.managers.mm_utils (sglang-ext)")

    def __getattr__(self, name):  # every name but as_tensor (looked up each time: patches of torch show)
        return getattr(torch, name)

    @staticmethod
    def as_tensor(data, dtype=None, device=None):
        if copies_without_a_wait(data, device):
            return pinned_copy(data, dtype, device)
        return torch.as_tensor(data, dtype=dtype, device=device)


def patch_mm_utils(ctx, module) -> None:
    """Part for `sglang.srt.managers.mm_utils` (the names are looked up through the module's globals)."""
    ctx.setattr(module, "get_embedding_and_mask", _wrap_get_embedding_and_mask(module.get_embedding_and_mask))
    ctx.setattr(module, "_adjust_embedding_length", _replace_adjust_embedding_length(module._adjust_embedding_length))
    ctx.setattr(module, "torch", TorchForMmUtils())
