"""Pi0.5 graphs captured while the policy loads, none while serving (knob pi05_graph_capture=load).
A robot's prompt length moves with its state, so each prompt bucket's prefix and action graphs are captured from
one synthetic request at load; both caches are then sealed (a miss runs eager, counted as `no_graph_after_load`).
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger("sglang_ext.pi05")


def synthetic_observation(config, bucket: int):
    """A preprocessed observation of the checkpoint's cameras whose prompt fills `bucket` tokens."""
    from sglang.multimodal_gen.runtime.vla.observation import VLAObservationBatch

    cameras = tuple(config.image_keys)
    height, width = config.image_size
    length = max(int(config.max_token_len), bucket)
    token_masks = torch.zeros(1, length, dtype=torch.bool)
    token_masks[:, :bucket] = True
    return VLAObservationBatch(
        prompt=[""], images={name: torch.zeros(1, 3, height, width) for name in cameras},
        image_masks={name: torch.ones(1, dtype=torch.bool) for name in cameras}, state=None, noise=None,
        tokens=torch.zeros(1, length, dtype=torch.long), token_masks=token_masks, batch_size=1,
        metadata={"camera_order": cameras})


def _resident(runner) -> tuple:
    info = runner.cache_info()
    return info.size, info.bytes_resident


def capture_at_load(policy, buckets) -> None:
    """Capture every prompt bucket's graphs, then seal both caches (unbucketed policies capture on first use)."""
    if not policy._prompt_token_bucketing_enabled():
        logger.info("Pi05 graphs: no load-time capture (prompt buckets need a single-rank CUDA prefix); "
                    "graphs are captured on first use")
        return
    config, prefix, action = policy.config, policy.prefix_graph_runner, policy.graph_runner
    steps = int(config.default_num_inference_steps)
    noise = torch.zeros(1, config.action_horizon, config.action_dim)
    start = time.perf_counter()
    captured = []
    try:
        with torch.inference_mode():
            for bucket in buckets:
                before = (_resident(prefix)[0], _resident(action)[0])
                observation = synthetic_observation(config, bucket)
                context = policy.encode_prefix(observation, use_cuda_graph=True, bucket_prompt=True)
                policy.sample_actions(observation, context, noise=noise, num_steps=steps, use_cuda_graph=True)
                if (_resident(prefix)[0], _resident(action)[0]) == before:
                    break  # neither cache took this bucket (capacity or byte budget): larger ones will not fit
                captured.append(bucket)
    except Exception:  # noqa: BLE001 - serving goes on: what was captured replays, the rest runs eager
        logger.warning("Pi05 graphs: load-time capture stopped at bucket %s", bucket, exc_info=True)
    finally:
        prefix.seal()
        action.seal()
    (prefix_graphs, prefix_bytes), (action_graphs, action_bytes) = _resident(prefix), _resident(action)
    logger.info("Pi05 graphs captured at load in %.1f s: prompt buckets %s, %d prefix graphs (%.0f MiB), %d action "
                "graphs (%.0f MiB), %d denoise steps; buckets not captured run eager: %s",
                time.perf_counter() - start, captured, prefix_graphs, prefix_bytes / 2**20, action_graphs,
                action_bytes / 2**20, steps, [b for b in buckets if b not in captured] or "none")
