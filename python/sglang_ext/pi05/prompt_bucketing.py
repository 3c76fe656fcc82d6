# SPDX-License-Identifier: Apache-2.0
"""Pi0.5 prompt token buckets (upstream module `sglang.multimodal_gen.runtime.vla.prompt_bucketing`).

Installed on 0.5.17 under that name by patch `pi05_config`. Opt-in: padding changes reduction
shapes and can change bf16 rounding. A prompt's logical length is its last visible position; it is
padded (or cut) to the smallest bucket that holds it; a longer prompt keeps its exact length (a miss).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from sglang_ext.graphs.buckets import select_bucket


def effective_token_length(token_masks: torch.Tensor) -> int:
    """Last visible position (1-based) over the batch; 0 when nothing is visible (masks are on the CPU here)."""
    if token_masks.ndim != 2:
        raise ValueError(f"Pi0.5 token masks must have shape [batch, seq], got {tuple(token_masks.shape)}")
    if token_masks.shape[0] == 0 or token_masks.shape[1] == 0:
        return 0
    positions = torch.arange(1, token_masks.shape[1] + 1, device=token_masks.device)
    visible_positions = torch.where(token_masks.to(torch.bool), positions, 0)
    return int(visible_positions.max().item())


def select_prompt_token_bucket(token_length: int, buckets: Sequence[int]) -> int | None:
    """Smallest bucket >= `token_length`, or None when the prompt is longer than all."""
    if isinstance(token_length, bool) or not isinstance(token_length, int) or token_length < 0:
        raise ValueError(f"token_length must be a non-negative integer, got {token_length!r}")
    if not buckets:
        return None
    # No padding limit; length 0 shares the smallest bucket with 1.
    return select_bucket(max(token_length, 1), buckets, max_padding_factor=math.inf).bucket


def bucket_prompt_tokens(tokens: torch.Tensor, token_masks: torch.Tensor, buckets: Sequence[int], *,
                         pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, int, int | None]:
    """`(tokens, token_masks, logical_length, bucket)` of a prompt batch fitted to its bucket (None: a miss)."""
    if tokens.ndim != 2:
        raise ValueError(f"Pi0.5 tokens must have shape [batch, seq], got {tuple(tokens.shape)}")
    if token_masks.shape != tokens.shape:
        raise ValueError(f"Pi0.5 tokens and token masks must have the same shape, got {tuple(tokens.shape)} and "
                         f"{tuple(token_masks.shape)}")
    logical_length = effective_token_length(token_masks)
    bucket = select_prompt_token_bucket(logical_length, buckets)
    if bucket is not None:
        target_length = bucket
    elif logical_length > 0:
        target_length = logical_length
    else:
        target_length = tokens.shape[1]  # empty prompt, no bucket: keep the shape

    if tokens.shape[1] >= target_length:
        return tokens[:, :target_length], token_masks[:, :target_length], logical_length, bucket
    padding = target_length - tokens.shape[1]
    return (F.pad(tokens, (0, padding), value=pad_token_id), F.pad(token_masks, (0, padding), value=False),
            logical_length, bucket)
