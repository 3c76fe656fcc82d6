# SPDX-License-Identifier: Apache-2.0
"""Pi0.5 prompt token buckets (upstream's `vla.prompt_bucketing`, installed on 0.5.17 by patch `pi05_config`).
Opt-in: padding changes reduction shapes and can change bf16 rounding. A prompt is padded (or cut) from its last
visible position to the smallest bucket that holds it; a longer prompt keeps its exact length (a miss).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from sglang_ext.graphs.buckets import select_bucket


def _batch_rows(name: str, tensor: torch.Tensor) -> None:
    if tensor.ndim != 2:
        raise ValueError(f"Pi0.5 {name} must have shape [batch, seq], got {tuple(tensor.shape)}")


def effective_token_length(token_masks: torch.Tensor) -> int:
    """1-based position of the last token visible in any row; 0 when none is."""
    _batch_rows("token masks", token_masks)
    columns = token_masks.to(torch.bool).any(dim=0).nonzero()
    return int(columns[-1]) + 1 if columns.numel() else 0


def select_prompt_token_bucket(token_length: int, buckets: Sequence[int]) -> int | None:
    """Smallest bucket >= `token_length`, or None when the prompt is longer than all."""
    if isinstance(token_length, bool) or not isinstance(token_length, int) or token_length < 0:
        raise ValueError(f"token_length must be a non-negative integer, got {token_length!r}")
    if not buckets:
        return None
    # No padding limit; length 0 shares the smallest bucket with 1.
    return select_bucket(max(token_length, 1), buckets, max_padding_factor=math.inf).bucket


def _fit(tensor: torch.Tensor, columns: int, fill) -> torch.Tensor:
    missing = columns - tensor.shape[1]
    return F.pad(tensor, (0, missing), value=fill) if missing > 0 else tensor[:, :columns]


def bucket_prompt_tokens(tokens: torch.Tensor, token_masks: torch.Tensor, buckets: Sequence[int], *,
                         pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, int, int | None]:
    """`(tokens, token_masks, logical_length, bucket)` of a prompt batch fitted to its bucket (None: a miss)."""
    _batch_rows("tokens", tokens)
    if token_masks.shape != tokens.shape:
        raise ValueError(f"Pi0.5 tokens {tuple(tokens.shape)} and token masks {tuple(token_masks.shape)} "
                         "must have the same shape")
    length = effective_token_length(token_masks)
    bucket = select_prompt_token_bucket(length, buckets)
    # a miss keeps the logical length; an empty prompt without a bucket keeps its shape
    columns = bucket or length or tokens.shape[1]
    return _fit(tokens, columns, pad_token_id), _fit(token_masks, columns, False), length, bucket
