# SPDX-License-Identifier: Apache-2.0
"""Pi0.5 prompt token buckets (upstream module `sglang.multimodal_gen.runtime.vla.prompt_bucketing`).

sglang 0.5.19 added this module; sglang-ext installs it on 0.5.17 under the same
name (patch `pi05_config`). Bucket mode is opt-in (`prompt_token_buckets`):
padding a prompt to a bucket changes reduction shapes and can change bf16
rounding of the actions, so exact prompt lengths stay the default.

Semantics (same as upstream):
- the logical length of a prompt batch is the last visible token position
  (1-based), maximised over the batch: a mask hole does not shorten a prompt;
- a prompt is right-padded with `pad_token_id` and masked-out positions up to
  the smallest bucket that holds it (or cut to that bucket when the tokenizer
  padded it further);
- a prompt longer than every bucket keeps its exact logical length (a miss);
- an empty prompt with no bucket keeps its original shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from sglang_ext.graphs.buckets import select_bucket


def effective_token_length(token_masks: torch.Tensor) -> int:
    """Last visible position (1-based) over the batch; 0 when nothing is visible.

    Reads one scalar back from the mask's device; Pi0.5 token masks live on the
    CPU at this point (before the prefix is encoded).
    """
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
    # Prompt buckets have no padding limit: any bucket that holds the prompt is
    # fine. Buckets are positive, so length 0 and 1 share the smallest bucket
    # (and 0 * inf would make the padding limit NaN).
    return select_bucket(max(token_length, 1), buckets, max_padding_factor=math.inf).bucket


def bucket_prompt_tokens(
    tokens: torch.Tensor,
    token_masks: torch.Tensor,
    buckets: Sequence[int],
    *,
    pad_token_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, int, int | None]:
    """Fit a prompt batch to its bucket.

    Returns `(tokens, token_masks, logical_length, bucket)`; `bucket` is None on
    a miss (then the prompt is cut to its exact logical length).
    """
    if tokens.ndim != 2:
        raise ValueError(f"Pi0.5 tokens must have shape [batch, seq], got {tuple(tokens.shape)}")
    if token_masks.shape != tokens.shape:
        raise ValueError(
            "Pi0.5 tokens and token masks must have the same shape, got "
            f"{tuple(tokens.shape)} and {tuple(token_masks.shape)}"
        )
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
    return (
        F.pad(tokens, (0, padding), value=pad_token_id),
        F.pad(token_masks, (0, padding), value=False),
        logical_length,
        bucket,
    )
