"""sglang 0.5.19's own unit tests for the ported pieces, run against sglang 0.5.17 + sglang-ext.

Copied verbatim from the sglang 0.5.19 wheel (sglang/multimodal_gen/test/unit/):
- test_parallel_linear_weight_loading.py: test_merged_replicated_linear_loads_independent_weight_shards,
  test_merged_replicated_linear_loads_independent_scalar_shards
- test_pi05_runtime_helpers.py: test_prefix_prompt_bucket_preserves_tokens_and_masks,
  test_prefix_prompt_bucket_preserves_mask_holes, test_prompt_bucket_selection_and_exact_tail,
  test_effective_token_length_uses_last_visible_position, test_pi05_graph_config_validation,
  test_pi05_loader_maps_unfused_prefix_weights_to_parallel_targets
- test_pi05_action_api.py: _server_args, test_action_metadata_reports_policy_shape_and_capabilities,
  test_action_metadata_reports_effective_graph_availability

Changes, and only these: the imports of upstream names that 0.5.17 lacks
(MergedReplicatedLinear, the prompt_bucketing functions, the 0.5.18+ module path
entrypoints.action.protocol) happen in the autouse fixture below, after the
patches are applied through `ext_patches`; and two assertions of
test_action_metadata_reports_policy_shape_and_capabilities that check 0.5.18
server-args features outside this port (`served_model_name` as "model",
`kv_gather_degree`) are commented out, marked `[sglang-ext] dropped`.
sglang is Apache-2.0 licensed; these tests are (c) the SGLang authors.
"""

from types import SimpleNamespace

import pytest
import torch

from sglang.test.ci.ci_register import register_cpu_ci

from sglang.multimodal_gen.configs.pipeline_configs.pi05 import Pi05PipelineConfig
from sglang.multimodal_gen.runtime.models.vlas.pi05_policy import Pi05PolicyModel

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

MergedReplicatedLinear = None
bucket_prompt_tokens = effective_token_length = select_prompt_token_bucket = None
action_metadata = None


@pytest.fixture(autouse=True)
def _upstream_names(ext_patches):
    """Apply the patches, then import the upstream names the copied tests use."""
    global MergedReplicatedLinear, bucket_prompt_tokens, effective_token_length
    global select_prompt_token_bucket, action_metadata
    ext_patches()
    from sglang.multimodal_gen.runtime.entrypoints.action.protocol import (
        action_metadata,
    )
    from sglang.multimodal_gen.runtime.layers.linear import MergedReplicatedLinear
    from sglang.multimodal_gen.runtime.vla.prompt_bucketing import (
        bucket_prompt_tokens,
        effective_token_length,
        select_prompt_token_bucket,
    )
    yield


# ---- from test_parallel_linear_weight_loading.py (0.5.19) ----


def test_merged_replicated_linear_loads_independent_weight_shards():
    layer = MergedReplicatedLinear(3, [2, 1, 1], bias=False)
    first = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    second = torch.tensor([[7.0, 8.0, 9.0]])
    third = torch.tensor([[10.0, 11.0, 12.0]])

    layer.weight_loader(layer.weight, first, 0)
    layer.weight_loader(layer.weight, second, 1)
    layer.weight_loader(layer.weight, third, "v")

    assert torch.equal(layer.weight, torch.cat((first, second, third)))


def test_merged_replicated_linear_loads_independent_scalar_shards():
    layer = MergedReplicatedLinear(3, [2, 1, 1], bias=False)
    scales = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    scales.needs_scalar_to_array = True

    layer.weight_loader(scales, torch.tensor(0.25), "q")
    layer.weight_loader(scales, torch.tensor(0.5), "k")
    layer.weight_loader(scales, torch.tensor(0.75), "v")

    assert torch.equal(scales, torch.tensor([0.25, 0.5, 0.75]))


# ---- from test_pi05_runtime_helpers.py (0.5.19) ----


def test_prefix_prompt_bucket_preserves_tokens_and_masks():
    tokens = torch.arange(40).view(1, 40)
    token_masks = torch.ones_like(tokens, dtype=torch.bool)

    bucketed_tokens, bucketed_masks, logical_length, bucket = bucket_prompt_tokens(
        tokens,
        token_masks,
        (32, 64, 128, 200),
    )

    assert logical_length == 40
    assert bucket == 64
    assert bucketed_tokens.shape == (1, 64)
    assert torch.equal(bucketed_tokens[:, :40], tokens)
    assert bucketed_tokens[:, 40:].eq(0).all()
    assert bucketed_masks[:, :40].all()
    assert not bucketed_masks[:, 40:].any()


def test_prefix_prompt_bucket_preserves_mask_holes():
    tokens = torch.arange(6).view(1, 6)
    token_masks = torch.tensor([[True, False, True, False, False, False]])

    bucketed_tokens, bucketed_masks, logical_length, bucket = bucket_prompt_tokens(
        tokens,
        token_masks,
        (4, 8),
    )

    assert logical_length == 3
    assert bucket == 4
    assert torch.equal(bucketed_tokens, tokens[:, :4])
    assert torch.equal(bucketed_masks, token_masks[:, :4])


def test_prompt_bucket_selection_and_exact_tail():
    assert select_prompt_token_bucket(33, (32, 64, 128)) == 64
    assert select_prompt_token_bucket(129, (32, 64, 128)) is None

    tokens = torch.arange(140).view(1, 140)
    token_masks = torch.arange(140).view(1, 140) < 129
    exact_tokens, exact_masks, logical_length, bucket = bucket_prompt_tokens(
        tokens,
        token_masks,
        (32, 64, 128),
    )

    assert logical_length == 129
    assert bucket is None
    assert exact_tokens.shape == (1, 129)
    assert exact_masks.all()


def test_effective_token_length_uses_last_visible_position():
    masks = torch.tensor(
        [
            [True, False, False, True, False],
            [True, True, False, False, False],
        ]
    )

    assert effective_token_length(masks) == 4


def test_pi05_graph_config_validation():
    config = Pi05PipelineConfig()
    config.update_pipeline_config(
        {
            "prompt_token_buckets": [16, 48, 96],
            "action_cuda_graph_max_entries": 3,
        }
    )
    assert config.prompt_token_buckets == [16, 48, 96]
    assert config.action_cuda_graph_max_entries == 3

    invalid_configs = (
        ({"prompt_token_buckets": [32, 32]}, "strictly increasing"),
        ({"prompt_token_buckets": [64, 32]}, "strictly increasing"),
        ({"prompt_token_buckets": [0, 32]}, "positive"),
        ({"prompt_token_buckets": [32, 256]}, "max_token_len"),
        ({"prefix_cuda_graph_max_entries": -1}, "prefix_cuda_graph"),
        ({"action_cuda_graph_max_entries": -1}, "action_cuda_graph"),
    )
    for overrides, match in invalid_configs:
        with pytest.raises(ValueError, match=match):
            Pi05PipelineConfig(**overrides)


def test_pi05_loader_maps_unfused_prefix_weights_to_parallel_targets():
    q_key = (
        "paligemma_with_expert.paligemma.model.language_model.layers.0."
        "self_attn.q_proj.weight"
    )
    gate_key = (
        "paligemma_with_expert.paligemma.model.language_model.layers.0."
        "mlp.gate_proj.weight"
    )

    assert (
        "paligemma_with_expert.paligemma.model.language_model.layers.0."
        "self_attn.qkv_proj.weight",
        "q",
    ) in Pi05PolicyModel._candidate_target_weights(q_key)
    assert (
        "paligemma_with_expert.paligemma.model.language_model.layers.0."
        "mlp.gate_up_proj.weight",
        0,
    ) in Pi05PolicyModel._candidate_target_weights(gate_key)


# ---- from test_pi05_action_api.py (0.5.19) ----


def _server_args(config: Pi05PipelineConfig | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        model_id=None,
        model_path="lerobot/pi05_base",
        served_model_name="pi05-production",
        output_path=None,
        comfyui_mode=False,
        num_gpus=1,
        tp_size=1,
        sp_degree=1,
        ulysses_degree=1,
        ring_degree=1,
        kv_gather_degree=1,
        pipeline_config=config or Pi05PipelineConfig(),
    )


def test_action_metadata_reports_policy_shape_and_capabilities():
    config = Pi05PipelineConfig(
        image_keys=("front", "wrist"),
        image_size=(256, 256),
        state_dim=8,
        action_horizon=10,
        action_dim=32,
        output_action_dim=7,
        prompt_token_buckets=[32, 64, 128, 200],
        prefix_cuda_graph_max_entries=4,
        enable_action_cuda_graph=True,
        action_cuda_graph_max_entries=6,
    )

    metadata = action_metadata(_server_args(config))

    assert metadata["object"] == "action.metadata"
    # [sglang-ext] dropped: assert metadata["model"] == "pi05-production"  (0.5.18 served_model_name)
    assert metadata["policy_family"] == "pi05"
    assert metadata["input"]["image_keys"] == ["front", "wrist"]
    assert metadata["input"]["image_size"] == [256, 256]
    assert metadata["input"]["state_dim"] == 8
    assert metadata["output"]["action_horizon"] == 10
    assert metadata["output"]["action_dim"] == 7
    assert metadata["output"]["padded_action_dim"] == 32
    assert metadata["runtime"]["materialize_dtype"] == "bf16"
    assert metadata["runtime"]["enable_autocast"] is True
    assert metadata["runtime"]["cuda_graph"] == {
        "prefix_enabled": True,
        "prefix_max_entries": 4,
        "action_enabled": True,
        "action_max_entries": 6,
        "prompt_token_buckets": [32, 64, 128, 200],
    }
    assert metadata["runtime"]["parallelism"]["num_gpus"] == 1
    # [sglang-ext] dropped: assert metadata["runtime"]["parallelism"]["kv_gather_degree"] == 1  (0.5.18)
    assert metadata["runtime"]["parallelism"]["prefix_strategy"] == "tp"
    assert metadata["runtime"]["parallelism"]["action_strategy"] == "sp"
    assert metadata["defaults"]["prefix_cache"] is False
    assert metadata["capabilities"]["realtime_websocket"]
    assert metadata["capabilities"]["openpi_websocket"]


def test_action_metadata_reports_effective_graph_availability():
    config = Pi05PipelineConfig(
        prefix_cuda_graph_max_entries=0,
        offload_action_expert_after_denoise=True,
    )

    metadata = action_metadata(_server_args(config))

    assert metadata["runtime"]["cuda_graph"]["prefix_enabled"] is False
    assert metadata["runtime"]["cuda_graph"]["action_enabled"] is False
    assert metadata["defaults"]["cuda_graph"] is False
    assert metadata["capabilities"]["cuda_graph"] is False
