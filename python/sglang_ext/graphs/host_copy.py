"""Host-to-device copies that do not hold the host until the device has the data."""

from __future__ import annotations

import torch

# Host tensors up to this size are staged through pinned memory (bounds the pinned blocks kept); larger copy blocking.
PIN_MAX_BYTES = 64 << 20


def to_device(tensor, device, dtype=None):
    """`tensor.to(device, dtype)`; CPU to GPU via pinned memory, no sync (the allocator keeps the block until read)."""
    if (tensor.device.type == "cpu" and torch.device(device).type == "cuda"
            and tensor.numel() * tensor.element_size() <= PIN_MAX_BYTES):
        return tensor.pin_memory().to(device, dtype=dtype, non_blocking=True)
    return tensor.to(device, dtype=dtype)
