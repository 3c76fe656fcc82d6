"""Host-to-device copies that do not hold the host until the device has the data."""

from __future__ import annotations

import torch

# Host tensors up to this size are staged through pinned memory (bounds the pinned blocks kept); larger copy blocking.
PIN_MAX_BYTES = 64 << 20


def to_device(tensor, device, dtype=None):
    """`tensor.to(device, dtype)`; a CPU tensor bound for a GPU goes through pinned memory without a stream sync
    (the caching host allocator keeps the pinned block until the copy that reads it has run)."""
    if (tensor.device.type == "cpu" and torch.device(device).type == "cuda"
            and tensor.numel() * tensor.element_size() <= PIN_MAX_BYTES):
        return tensor.pin_memory().to(device, dtype=dtype, non_blocking=True)
    return tensor.to(device, dtype=dtype)
