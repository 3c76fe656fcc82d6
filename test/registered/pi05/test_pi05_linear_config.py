"""CPU tests of the `pi05_merged_linear` and `pi05_config` patches on sglang 0.5.17.

Packed PiGemma projections are loaded from a synthetic checkpoint with separate
q/k/v and gate/up tensors through 0.5.17's real Pi0.5 loader
(`Pi05PolicyModel._load_weights`) and compared with the separate projections;
prompt bucketing edge cases; config validation (every rule, misspelled keys,
knob overrides, pickling); action metadata.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sglang.test.ci.ci_register import register_cpu_ci

from conftest import ext_core, plugin_only, where_part_runs
from sglang.multimodal_gen.configs.pipeline_configs.pi05 import Pi05PipelineConfig

ExtConfigError = ext_core("errors").ExtConfigError  # the patched tree raises its vendored copy

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 16, 24, 4, 1, 4
Q_SIZE, KV_SIZE = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM

# Checkpoint prefixes as OpenPI/LeRobot write them, and the module paths the
# 0.5.17 loader maps them to (`_candidate_weight_keys`).
PREFIX_LM_SOURCE = "paligemma_with_expert.paligemma.language_model.layers.0."
ACTION_EXPERT_SOURCE = "paligemma_with_expert.gemma_expert.model.layers.0."


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


class _NoLocalAttention(nn.Module):
    """Stands in for LocalAttention, whose backend selection needs a running server."""

    def __init__(self, **kwargs):
        super().__init__()


def _gemma_config(attention_bias: bool = False):
    from transformers.models.gemma.modeling_gemma import GemmaConfig

    return GemmaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        hidden_act="gelu_pytorch_tanh",
        attention_bias=attention_bias,
        vocab_size=32,
        num_hidden_layers=1,
    )


def _pi05_core(monkeypatch):
    from sglang.multimodal_gen.runtime.models.vlas import pi05_core

    monkeypatch.setattr(pi05_core, "LocalAttention", _NoLocalAttention)
    return pi05_core


def _layer(pi05_core, config) -> nn.ModuleDict:
    return nn.ModuleDict(
        {"self_attn": pi05_core.PiGemmaAttention(config, 0), "mlp": pi05_core.PiGemmaMLP(config)}
    )


def _core_with_two_layers(pi05_core, config) -> nn.Module:
    """Module tree with the target names of a prefix-LM layer and an action-expert layer."""
    tree = nn.ModuleDict(
        {
            "paligemma_with_expert": nn.ModuleDict(
                {
                    "paligemma": nn.ModuleDict(
                        {"model": nn.ModuleDict({"language_model": nn.ModuleDict(
                            {"layers": nn.ModuleList([_layer(pi05_core, config)])})})}
                    ),
                    "gemma_expert": nn.ModuleDict(
                        {"model": nn.ModuleDict({"layers": nn.ModuleList([_layer(pi05_core, config)])})}
                    ),
                }
            )
        }
    )
    return tree


def _separate_layer_tensors(seed: int, attention_bias: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "self_attn.q_proj.weight": (Q_SIZE, HIDDEN),
        "self_attn.k_proj.weight": (KV_SIZE, HIDDEN),
        "self_attn.v_proj.weight": (KV_SIZE, HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, Q_SIZE),
        "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
        "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
    }
    if attention_bias:
        shapes.update(
            {
                "self_attn.q_proj.bias": (Q_SIZE,),
                "self_attn.k_proj.bias": (KV_SIZE,),
                "self_attn.v_proj.bias": (KV_SIZE,),
                "self_attn.o_proj.bias": (HIDDEN,),
            }
        )
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def _write_checkpoint(tmp_path, tensors: dict) -> str:
    from safetensors.torch import save_file

    path = str(tmp_path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return path


def _loading_policy(core: nn.Module, checkpoint: str):
    """A Pi05PolicyModel with only what `_load_weights` reads (no 2B-parameter model)."""
    from sglang.multimodal_gen.runtime.models.vlas.pi05_policy import (
        Pi05CheckpointManifest,
        Pi05PolicyModel,
    )

    policy = Pi05PolicyModel.__new__(Pi05PolicyModel)
    nn.Module.__init__(policy)
    policy.core_model = core
    policy.config = Pi05PipelineConfig()
    policy.runtime_role = "all"
    policy.device = torch.device("cpu")
    policy.manifest = Pi05CheckpointManifest(model_path="synthetic", safetensor_files=[checkpoint])
    return policy


def _reference_qkv(x, t, prefix=""):
    def proj(name):
        return F.linear(x, t[f"{prefix}self_attn.{name}.weight"], t.get(f"{prefix}self_attn.{name}.bias"))

    batch_seq = x.shape[:-1]
    q = proj("q_proj").view(*batch_seq, HEADS, HEAD_DIM).transpose(1, 2)
    k = proj("k_proj").view(*batch_seq, KV_HEADS, HEAD_DIM).transpose(1, 2)
    v = proj("v_proj").view(*batch_seq, KV_HEADS, HEAD_DIM).transpose(1, 2)
    return q, k, v


def _reference_mlp(x, t, prefix=""):
    gate = F.linear(x, t[f"{prefix}mlp.gate_proj.weight"])
    up = F.linear(x, t[f"{prefix}mlp.up_proj.weight"])
    return F.linear(F.gelu(gate, approximate="tanh") * up, t[f"{prefix}mlp.down_proj.weight"])


class _LinearCallCounter:
    def __init__(self, monkeypatch):
        self.calls = 0
        original = F.linear

        def counting_linear(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "linear", counting_linear)


# --------------------------------------------------------------------------
# MergedReplicatedLinear
# --------------------------------------------------------------------------


def test_merged_replicated_linear_packs_shards_and_runs_one_gemm(ext_patches, monkeypatch):
    ext_patches()
    from sglang.multimodal_gen.runtime.layers.linear import MergedReplicatedLinear

    layer = MergedReplicatedLinear(5, [4, 2, 2], bias=True)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, 5, generator=g) for n in (4, 2, 2)]
    biases = [torch.randn(n, generator=g) for n in (4, 2, 2)]
    # string and integer shard ids, loaded out of order
    for shard_id, index in (("v", 2), (0, 0), ("k", 1)):
        layer.weight_loader(layer.weight, weights[index], shard_id)
        layer.weight_loader(layer.bias, biases[index], shard_id)

    assert layer.output_sizes == [4, 2, 2]
    assert layer.weight.shape == (8, 5)
    x = torch.randn(3, 5, generator=g)
    expected = torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)
    counter = _LinearCallCounter(monkeypatch)
    output, output_bias = layer(x)
    assert counter.calls == 1
    assert output_bias is None
    torch.testing.assert_close(output, expected)


def test_merged_replicated_linear_loads_a_packed_tensor_without_shard_id(ext_patches):
    ext_patches()
    from sglang.multimodal_gen.runtime.layers.linear import MergedReplicatedLinear

    layer = MergedReplicatedLinear(3, [2, 1], bias=False)
    packed = torch.arange(9.0).view(3, 3)
    layer.weight_loader(layer.weight, packed)
    assert torch.equal(layer.weight, packed)


def test_merged_replicated_linear_metadata_and_scalar_params(ext_patches):
    ext_patches()
    from sglang.multimodal_gen.runtime.layers.linear import MergedReplicatedLinear

    layer = MergedReplicatedLinear(3, [2, 2, 2], bias=False)
    # metadata rows: one equally sized block per shard, placed by shard index
    metadata = nn.Parameter(torch.zeros(6), requires_grad=False)
    metadata.is_metadata = True
    layer.weight_loader(metadata, torch.tensor([5.0, 6.0]), "k")
    assert torch.equal(metadata, torch.tensor([0.0, 0.0, 5.0, 6.0, 0.0, 0.0]))
    # one scale per logical matrix; scalars with and without a shape, int shard ids
    scales = nn.Parameter(torch.zeros(3), requires_grad=False)
    scales.needs_scalar_to_array = True
    layer.weight_loader(scales, torch.tensor(0.5), 2)
    layer.weight_loader(scales, torch.tensor([0.25]), 0)
    assert torch.equal(scales, torch.tensor([0.25, 0.0, 0.5]))


@where_part_runs("sglang_ext.pi05.merged_linear:patch_linear")  # its own messages; upstream has its own
@pytest.mark.parametrize("shard_id", ["x", 3, -1, 1.0, True])
def test_merged_replicated_linear_rejects_unknown_shard_ids(ext_patches, shard_id):
    ext_patches()
    from sglang.multimodal_gen.runtime.layers.linear import MergedReplicatedLinear

    layer = MergedReplicatedLinear(3, [2, 1, 1], bias=False, prefix="layers.0.self_attn.qkv_proj")
    layer.weight.data.fill_(7.0)
    with pytest.raises(ValueError, match="Invalid merged shard id") as info:
        layer.weight_loader(layer.weight, torch.ones(1, 3), shard_id)
    assert repr(shard_id) in str(info.value)
    assert "layers.0.self_attn.qkv_proj" in str(info.value)
    assert (layer.weight == 7.0).all()


@where_part_runs("sglang_ext.pi05.merged_linear:patch_linear")  # its own messages; upstream has its own
def test_merged_replicated_linear_shape_mismatch_names_param_shard_and_shapes(ext_patches):
    ext_patches()
    from sglang.multimodal_gen.runtime.layers.linear import MergedReplicatedLinear

    layer = MergedReplicatedLinear(4, [4, 2, 2], bias=True, prefix="model.layers.3.self_attn.qkv_proj")
    with pytest.raises(ValueError) as info:
        layer.weight_loader(layer.weight, torch.ones(3, 4), "k")
    message = str(info.value)
    for part in ("'k'", "(3, 4)", "(2, 4)", "weight", "model.layers.3.self_attn.qkv_proj", "[4, 2, 2]"):
        assert part in message, (part, message)
    with pytest.raises(ValueError, match="bias") as info:
        layer.weight_loader(layer.bias, torch.ones(3), 0)
    assert "(3,)" in str(info.value) and "(4,)" in str(info.value)


# --------------------------------------------------------------------------
# PiGemma layers on packed weights, loaded by 0.5.17's Pi0.5 loader
# --------------------------------------------------------------------------


@pytest.mark.parametrize("attention_bias", [False, True])
def test_pigemma_packed_layers_load_separate_checkpoint_tensors(ext_patches, monkeypatch, tmp_path,
                                                               attention_bias):
    ext_patches()
    from sglang.multimodal_gen.runtime.layers.linear import MergedReplicatedLinear

    pi05_core = _pi05_core(monkeypatch)
    config = _gemma_config(attention_bias)
    core = _core_with_two_layers(pi05_core, config)
    prefix_tensors = _separate_layer_tensors(1, attention_bias)
    expert_tensors = _separate_layer_tensors(2, attention_bias)
    checkpoint = {PREFIX_LM_SOURCE + k: v for k, v in prefix_tensors.items()}
    checkpoint.update({ACTION_EXPERT_SOURCE + k: v for k, v in expert_tensors.items()})
    policy = _loading_policy(core, _write_checkpoint(tmp_path, checkpoint))

    policy._load_weights()  # raises on any missing or mismatched target

    layers = (
        (core["paligemma_with_expert"]["paligemma"]["model"]["language_model"]["layers"][0], prefix_tensors),
        (core["paligemma_with_expert"]["gemma_expert"]["model"]["layers"][0], expert_tensors),
    )
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(3))
    for layer, tensors in layers:
        attn, mlp = layer["self_attn"], layer["mlp"]
        assert isinstance(attn.qkv_proj, MergedReplicatedLinear)
        assert isinstance(mlp.gate_up_proj, MergedReplicatedLinear)
        assert attn.q_proj is attn.k_proj is attn.v_proj is None
        assert mlp.gate_proj is mlp.up_proj is None
        assert attn.projection_dtype == mlp.projection_dtype == torch.float32

        counter = _LinearCallCounter(monkeypatch)
        q, k, v = attn.project_qkv(x)
        assert counter.calls == 1  # 0.5.17: three GEMMs
        for got, want in zip((q, k, v), _reference_qkv(x, tensors)):
            torch.testing.assert_close(got, want)

        counter = _LinearCallCounter(monkeypatch)
        out = mlp(x)
        assert counter.calls == 2  # gate_up + down (0.5.17: gate, up, down)
        torch.testing.assert_close(out, _reference_mlp(x, tensors))


def test_pigemma_loader_accepts_an_already_packed_checkpoint(ext_patches, monkeypatch, tmp_path):
    ext_patches()
    pi05_core = _pi05_core(monkeypatch)
    core = _core_with_two_layers(pi05_core, _gemma_config())
    checkpoint = {}
    for source, seed in ((PREFIX_LM_SOURCE, 4), (ACTION_EXPERT_SOURCE, 5)):
        t = _separate_layer_tensors(seed, False)
        checkpoint[source + "self_attn.qkv_proj.weight"] = torch.cat(
            [t["self_attn.q_proj.weight"], t["self_attn.k_proj.weight"], t["self_attn.v_proj.weight"]]
        )
        checkpoint[source + "mlp.gate_up_proj.weight"] = torch.cat([t["mlp.gate_proj.weight"], t["mlp.up_proj.weight"]])
        checkpoint[source + "self_attn.o_proj.weight"] = t["self_attn.o_proj.weight"]
        checkpoint[source + "mlp.down_proj.weight"] = t["mlp.down_proj.weight"]
    _loading_policy(core, _write_checkpoint(tmp_path, checkpoint))._load_weights()

    expert = core["paligemma_with_expert"]["gemma_expert"]["model"]["layers"][0]
    assert torch.equal(expert["self_attn"].qkv_proj.weight, checkpoint[ACTION_EXPERT_SOURCE + "self_attn.qkv_proj.weight"])
    assert torch.equal(expert["mlp"].gate_up_proj.weight, checkpoint[ACTION_EXPERT_SOURCE + "mlp.gate_up_proj.weight"])


@where_part_runs("sglang_ext.pi05.merged_linear:patch_linear")  # its own messages; upstream has its own
def test_pigemma_loader_reports_a_wrong_shard_shape(ext_patches, monkeypatch, tmp_path):
    ext_patches()
    pi05_core = _pi05_core(monkeypatch)
    core = _core_with_two_layers(pi05_core, _gemma_config())
    checkpoint = {}
    for source, seed in ((PREFIX_LM_SOURCE, 6), (ACTION_EXPERT_SOURCE, 7)):
        checkpoint.update({source + k: v for k, v in _separate_layer_tensors(seed, False).items()})
    # a checkpoint whose k_proj has as many heads as q_proj (wrong for this MQA config)
    checkpoint[ACTION_EXPERT_SOURCE + "self_attn.k_proj.weight"] = torch.ones(Q_SIZE, HIDDEN)
    policy = _loading_policy(core, _write_checkpoint(tmp_path, checkpoint))
    with pytest.raises(ValueError) as info:
        policy._load_weights()
    assert "'k'" in str(info.value) and f"({Q_SIZE}, {HIDDEN})" in str(info.value)
    assert f"({KV_SIZE}, {HIDDEN})" in str(info.value)


# --------------------------------------------------------------------------
# prompt bucketing
# --------------------------------------------------------------------------


def _bucketing():
    from sglang.multimodal_gen.runtime.vla import prompt_bucketing

    return prompt_bucketing


@where_part_runs("sglang_ext.pi05.config:install_prompt_bucketing")  # the 0.5.17 backport of the fields
def test_empty_prompt_pads_to_smallest_bucket_or_keeps_its_shape(ext_patches):
    ext_patches()
    pb = _bucketing()
    tokens = torch.full((2, 6), 9)
    masks = torch.zeros(2, 6, dtype=torch.bool)
    out_tokens, out_masks, length, bucket = pb.bucket_prompt_tokens(tokens, masks, (4, 8))
    assert (length, bucket) == (0, 4)
    assert out_tokens.shape == out_masks.shape == (2, 4) and not out_masks.any()
    out_tokens, out_masks, length, bucket = pb.bucket_prompt_tokens(tokens, masks, ())
    assert (length, bucket) == (0, None)
    assert torch.equal(out_tokens, tokens) and torch.equal(out_masks, masks)
    # zero-width prompt tensors
    empty = torch.zeros(1, 0, dtype=torch.long)
    out_tokens, out_masks, length, bucket = pb.bucket_prompt_tokens(empty, empty.bool(), (4,))
    assert (length, bucket) == (0, 4) and out_tokens.shape == (1, 4) and not out_masks.any()
    assert pb.effective_token_length(torch.zeros(0, 5, dtype=torch.bool)) == 0


def test_prompt_exactly_at_a_bucket_is_not_padded(ext_patches):
    ext_patches()
    pb = _bucketing()
    tokens = torch.arange(1, 33).view(1, 32)
    masks = torch.ones(1, 32, dtype=torch.bool)
    out_tokens, out_masks, length, bucket = pb.bucket_prompt_tokens(tokens, masks, (16, 32, 64))
    assert (length, bucket) == (32, 32)
    assert torch.equal(out_tokens, tokens) and torch.equal(out_masks, masks)
    assert pb.select_prompt_token_bucket(32, (16, 32, 64)) == 32
    assert pb.select_prompt_token_bucket(33, (16, 32, 64)) == 64


def test_prompt_above_the_last_bucket_keeps_its_exact_length(ext_patches):
    ext_patches()
    pb = _bucketing()
    tokens = torch.arange(50).view(1, 50)
    masks = torch.arange(50).view(1, 50) < 40  # tokenizer padded to 50
    out_tokens, out_masks, length, bucket = pb.bucket_prompt_tokens(tokens, masks, (16, 32))
    assert (length, bucket) == (40, None)
    assert torch.equal(out_tokens, tokens[:, :40]) and out_masks.all()


def test_batch_with_different_lengths_uses_the_longest_and_keeps_each_mask(ext_patches):
    ext_patches()
    pb = _bucketing()
    tokens = torch.tensor([[1, 2, 3, 0, 0, 0, 0], [4, 5, 6, 7, 8, 9, 0]])
    masks = tokens != 0
    out_tokens, out_masks, length, bucket = pb.bucket_prompt_tokens(tokens, masks, (4, 10), pad_token_id=-1)
    assert (length, bucket) == (6, 10)
    assert out_tokens.shape == (2, 10)
    assert torch.equal(out_tokens[:, :7], tokens)
    assert (out_tokens[:, 7:] == -1).all()
    assert torch.equal(out_masks[:, :7], masks) and not out_masks[:, 7:].any()
    assert out_masks.sum(dim=1).tolist() == [3, 6]


def test_mask_holes_do_not_shorten_a_prompt(ext_patches):
    ext_patches()
    pb = _bucketing()
    masks = torch.tensor([[True, False, False, False, True, False, False, False]])
    tokens = torch.arange(8).view(1, 8)
    assert pb.effective_token_length(masks) == 5
    out_tokens, out_masks, length, bucket = pb.bucket_prompt_tokens(tokens, masks, (2, 6))
    assert (length, bucket) == (5, 6)
    assert torch.equal(out_masks, masks[:, :6]) and torch.equal(out_tokens, tokens[:, :6])


@where_part_runs("sglang_ext.pi05.config:install_prompt_bucketing")  # the 0.5.17 backport of the fields
def test_prompt_bucketing_rejects_bad_input(ext_patches):
    ext_patches()
    pb = _bucketing()
    with pytest.raises(ValueError, match="batch, seq"):
        pb.bucket_prompt_tokens(torch.zeros(4), torch.zeros(4, dtype=torch.bool), (4,))
    with pytest.raises(ValueError, match="same shape"):
        pb.bucket_prompt_tokens(torch.zeros(1, 4), torch.zeros(1, 5, dtype=torch.bool), (4,))
    with pytest.raises(ValueError, match="non-negative"):
        pb.select_prompt_token_bucket(-1, (4,))
    with pytest.raises(ValueError):
        pb.select_prompt_token_bucket(3, (8, 4))  # buckets must be increasing


# --------------------------------------------------------------------------
# Pi05PipelineConfig graph fields
# --------------------------------------------------------------------------


def test_config_has_upstream_graph_fields_and_defaults(ext_patches):
    ext_patches()
    config = Pi05PipelineConfig()
    names = [f.name for f in dataclasses.fields(config)]
    for name in ("enable_prefix_cuda_graph", "prompt_token_buckets", "prefix_cuda_graph_max_entries",
                 "action_cuda_graph_max_entries"):
        assert name in names
    assert config.enable_prefix_cuda_graph is True
    assert config.prompt_token_buckets == []
    assert config.prefix_cuda_graph_max_entries == 1
    assert config.action_cuda_graph_max_entries == 4
    assert config.prefix_cuda_graph_available() and config.action_cuda_graph_available()
    assert dataclasses.asdict(config)["action_cuda_graph_max_entries"] == 4
    # default lists are not shared between instances
    config.prompt_token_buckets.append(8)
    assert Pi05PipelineConfig().prompt_token_buckets == []


INVALID_GRAPH_CONFIGS = [
    ({"prompt_token_buckets": [True, 8]}, "prompt_token_buckets must contain integers"),
    ({"prompt_token_buckets": [8.0, 16]}, "prompt_token_buckets must contain integers"),
    ({"prompt_token_buckets": ["16"]}, "prompt_token_buckets must contain integers"),
    ({"prompt_token_buckets": "16,32"}, "prompt_token_buckets must contain integers"),
    ({"prompt_token_buckets": 16}, "prompt_token_buckets must contain integers"),
    ({"prompt_token_buckets": [0, 32]}, "prompt_token_buckets must contain positive"),
    ({"prompt_token_buckets": [-8]}, "prompt_token_buckets must contain positive"),
    ({"prompt_token_buckets": [32, 32]}, "prompt_token_buckets must be strictly increasing and unique"),
    ({"prompt_token_buckets": [64, 32]}, "prompt_token_buckets must be strictly increasing and unique"),
    ({"prompt_token_buckets": [32, 256]}, r"prompt_token_buckets cannot exceed max_token_len \(200\)"),
    ({"prompt_token_buckets": [64], "max_token_len": 48}, r"max_token_len \(48\)"),
    ({"prefix_cuda_graph_max_entries": -1}, "prefix_cuda_graph_max_entries must be non-negative"),
    ({"action_cuda_graph_max_entries": -2}, "action_cuda_graph_max_entries must be non-negative"),
    ({"prefix_cuda_graph_max_entries": True}, r"prefix_cuda_graph_max_entries must be an integer \(not bool\)"),
    ({"action_cuda_graph_max_entries": 1.5}, r"action_cuda_graph_max_entries must be an integer"),
    ({"action_cuda_graph_max_entries": "4"}, r"action_cuda_graph_max_entries must be an integer"),
]


@pytest.mark.parametrize("overrides,match", INVALID_GRAPH_CONFIGS)
def test_config_rejects_each_invalid_graph_setting(ext_patches, overrides, match):
    ext_patches()
    with pytest.raises(ValueError, match=match):
        Pi05PipelineConfig(**overrides)
    with pytest.raises(ValueError, match=match):  # JSON path (0.5.17 calls __post_init__ after it)
        Pi05PipelineConfig().update_pipeline_config(overrides)
    config = Pi05PipelineConfig()
    for name, value in overrides.items():
        setattr(config, name, value)  # e.g. set from CLI arguments
    with pytest.raises(ValueError, match=match):
        config.check_pipeline_config()


def test_config_accepts_and_normalizes_valid_graph_settings(ext_patches):
    import numpy as np

    ext_patches()
    config = Pi05PipelineConfig(prompt_token_buckets=(np.int64(16), 48, 200), prefix_cuda_graph_max_entries=0,
                                action_cuda_graph_max_entries=np.int32(2))
    assert config.prompt_token_buckets == [16, 48, 200]
    assert all(type(b) is int for b in config.prompt_token_buckets)
    assert type(config.action_cuda_graph_max_entries) is int
    assert not config.prefix_cuda_graph_available()
    config.check_pipeline_config()
    config.update_pipeline_config({"max_token_len": 300, "prompt_token_buckets": [256]})
    assert config.prompt_token_buckets == [256]
    replaced = dataclasses.replace(config, prompt_token_buckets=[8])
    assert replaced.prompt_token_buckets == [8] and replaced.max_token_len == 300
    with pytest.raises(ValueError, match="strictly increasing"):
        dataclasses.replace(config, prompt_token_buckets=[8, 8])


@pytest.mark.parametrize(
    "key,suggestion",
    [
        ("prompt_token_bucket", "prompt_token_buckets"),
        ("prompt_tokens_buckets", "prompt_token_buckets"),
        ("prefix_graph_max_entries", "prefix_cuda_graph_max_entries"),
        ("action_cuda_graph_max_entry", "action_cuda_graph_max_entries"),
        ("enable_prefix_cuda_graphs", "enable_prefix_cuda_graph"),
        ("pi05_prompt_token_buckets", "prompt_token_buckets"),
        ("enable_vision_cuda_graph", None),
    ],
)
def test_misspelled_graph_key_is_an_error(ext_patches, key, suggestion):
    ext_patches()
    config = Pi05PipelineConfig()
    with pytest.raises(ExtConfigError) as info:
        config.update_pipeline_config({key: [16]})
    message = str(info.value)
    assert repr(key) in message
    if suggestion is not None:
        assert f"did you mean {suggestion!r}" in message
    assert config.prompt_token_buckets == []  # nothing was applied


def test_misspelled_graph_key_in_a_pipeline_config_file_stops_loading(ext_patches, tmp_path):
    import json

    ext_patches()
    path = tmp_path / "pi05_pipeline.json"
    path.write_text(json.dumps({"action_horizon": 10, "action_cuda_graph_max_entires": 2}))
    config = Pi05PipelineConfig()
    with pytest.raises(ExtConfigError, match="did you mean 'action_cuda_graph_max_entries'"):
        config.load_from_json(str(path))  # 0.5.17's loader -> update_pipeline_config
    path.write_text(json.dumps({"action_horizon": 10, "action_cuda_graph_max_entries": 2}))
    config.load_from_json(str(path))
    assert (config.action_horizon, config.action_cuda_graph_max_entries) == (10, 2)


def test_unrelated_unknown_keys_are_still_ignored_like_0_5_17(ext_patches):
    ext_patches()
    config = Pi05PipelineConfig()
    config.update_pipeline_config({"enable_pi06_actions": True, "action_horizon": 10})
    assert config.action_horizon == 10 and not hasattr(config, "enable_pi06_actions")
    with pytest.raises(TypeError):
        Pi05PipelineConfig(prompt_token_bucket=[16])  # the constructor was never lenient


def test_knobs_override_config_values_and_are_validated(ext_patches):
    ext_patches(pi05_prefix_graph_max_entries=3, pi05_action_graph_max_entries=0,
                pi05_prompt_token_buckets="16,64")
    config = Pi05PipelineConfig(prefix_cuda_graph_max_entries=1, prompt_token_buckets=[32])
    assert config.prefix_cuda_graph_max_entries == 3
    assert config.action_cuda_graph_max_entries == 0 and not config.action_cuda_graph_available()
    assert config.prompt_token_buckets == [16, 64]
    config.update_pipeline_config({"prompt_token_buckets": [8], "prefix_cuda_graph_max_entries": 2})
    assert config.prompt_token_buckets == [16, 64] and config.prefix_cuda_graph_max_entries == 3
    # the knob value is checked against this config's max_token_len, and the error names the knob
    with pytest.raises(ValueError, match=r"max_token_len \(32\).*--ext-pi05-prompt-token-buckets"):
        Pi05PipelineConfig(max_token_len=32)


def test_unset_knobs_keep_config_values(ext_patches):
    ext_patches()
    config = Pi05PipelineConfig(prefix_cuda_graph_max_entries=2, action_cuda_graph_max_entries=5,
                                prompt_token_buckets=[32])
    assert (config.prefix_cuda_graph_max_entries, config.action_cuda_graph_max_entries) == (2, 5)
    assert config.prompt_token_buckets == [32]


@where_part_runs("sglang_ext.pi05.config:install_prompt_bucketing")  # the 0.5.17 backport of the fields
def test_config_pickles_with_graph_fields_and_old_pickles_get_defaults(ext_patches):
    ext_patches()
    config = Pi05PipelineConfig(prompt_token_buckets=[16, 32], action_cuda_graph_max_entries=2)
    clone = pickle.loads(pickle.dumps(config))
    assert type(clone) is Pi05PipelineConfig
    assert clone.prompt_token_buckets == [16, 32] and clone.action_cuda_graph_max_entries == 2
    # an instance pickled by a process without the patch carries no graph fields
    old_state = {k: v for k, v in vars(config).items() if k not in
                 ("enable_prefix_cuda_graph", "prompt_token_buckets", "prefix_cuda_graph_max_entries",
                  "action_cuda_graph_max_entries")}
    old = Pi05PipelineConfig.__new__(Pi05PipelineConfig)
    old.__dict__.update(old_state)
    assert list(old.prompt_token_buckets) == []
    assert old.prefix_cuda_graph_max_entries == 1 and old.action_cuda_graph_max_entries == 4
    assert old.prefix_cuda_graph_available() and old.action_cuda_graph_available()


@where_part_runs("sglang_ext.pi05.config:install_prompt_bucketing")  # the 0.5.17 backport of the fields
@plugin_only
def test_config_pickled_with_the_patch_loads_where_the_patch_is_not_active(ext_patches):
    """A launcher with the patch and a spawned worker without it (or before it applies)."""
    from sglang_ext import activation

    ext_patches()
    payload = pickle.dumps(Pi05PipelineConfig(prompt_token_buckets=[16], prefix_cuda_graph_max_entries=2))
    activation.deactivate()
    assert "prompt_token_buckets" not in Pi05PipelineConfig.__dataclass_fields__  # 0.5.17 class again
    config = pickle.loads(payload)
    assert type(config) is Pi05PipelineConfig
    assert config.prompt_token_buckets == [16] and config.prefix_cuda_graph_max_entries == 2


@pytest.mark.parametrize(
    "flag", ["offload_prefix_image_encoder", "offload_prefix_image_encoder_after_embed",
             "offload_prefix_token_embedding", "offload_prefix_language_layers",
             "offload_prefix_language_layers_after_prefix", "empty_cache_after_prefix"],
)
def test_prefix_offload_makes_the_prefix_graph_unavailable(ext_patches, flag):
    ext_patches()
    config = Pi05PipelineConfig(**{flag: True})
    assert not config.prefix_cuda_graph_available()
    assert config.action_cuda_graph_available()


def test_graph_availability_follows_flags_and_capacities(ext_patches):
    ext_patches()
    assert not Pi05PipelineConfig(enable_prefix_cuda_graph=False).prefix_cuda_graph_available()
    assert not Pi05PipelineConfig(offload_prefix_language_layer_count_after_prefix=2).prefix_cuda_graph_available()
    assert not Pi05PipelineConfig(enable_action_cuda_graph=False).action_cuda_graph_available()
    assert not Pi05PipelineConfig(action_cuda_graph_max_entries=0).action_cuda_graph_available()
    assert not Pi05PipelineConfig(offload_action_expert_after_denoise=True).action_cuda_graph_available()


# --------------------------------------------------------------------------
# action metadata
# --------------------------------------------------------------------------


def _server_args(config):
    from types import SimpleNamespace

    return SimpleNamespace(model_id=None, model_path="lerobot/pi05_base", served_model_name="lerobot/pi05_base", num_gpus=1, tp_size=1, sp_degree=1,
                           ulysses_degree=1, ring_degree=1, kv_gather_degree=1, pipeline_config=config)


LADDER = [32, 48, 64, 80, 112, 128, 160, 192, 200]
# capture at load is sglang-ext's Pi0.5 graphs' (where they serve; else sglang's own report the config)
OUR_GRAPHS = where_part_runs("sglang_ext.pi05.policy_graphs:patch_policy")  # the default prompt buckets up to max_token_len 200


@pytest.mark.parametrize(
    "capture,overrides,expected_block,mode",
    [
        # graphs captured at load (the default): every bucket held, the config's capacity when larger
        pytest.param("load", {}, {"prefix_enabled": True, "prefix_max_entries": 9, "action_enabled": True,
                      "action_max_entries": 9, "prompt_token_buckets": LADDER}, "bucket", marks=OUR_GRAPHS),
        pytest.param("load", {"prompt_token_buckets": [32, 64], "action_cuda_graph_max_entries": 0},
         {"prefix_enabled": True, "prefix_max_entries": 2, "action_enabled": False,
          "action_max_entries": 0, "prompt_token_buckets": [32, 64]}, "bucket", marks=OUR_GRAPHS),
        pytest.param("load", {"offload_prefix_token_embedding": True, "enable_action_cuda_graph": False},
         {"prefix_enabled": False, "prefix_max_entries": 9, "action_enabled": False,
          "action_max_entries": 9, "prompt_token_buckets": LADDER}, "off", marks=OUR_GRAPHS),
        # upstream's first-use capture: the config as it is
        ("lazy", {}, {"prefix_enabled": True, "prefix_max_entries": 1, "action_enabled": True,
                      "action_max_entries": 4, "prompt_token_buckets": []}, "exact"),
        ("lazy", {"prompt_token_buckets": [32, 64], "action_cuda_graph_max_entries": 0},
         {"prefix_enabled": True, "prefix_max_entries": 1, "action_enabled": False,
          "action_max_entries": 0, "prompt_token_buckets": [32, 64]}, "bucket"),
    ],
)
def test_action_metadata_reports_graph_settings(ext_patches, capture, overrides, expected_block, mode):
    ext_patches(pi05_graph_capture=capture)
    from sglang_ext_testkit.upstream import upstream
    api, protocol, ws_utils = upstream("sglang.multimodal_gen.runtime.entrypoints.action.api"), upstream("sglang.multimodal_gen.runtime.entrypoints.action.protocol"), upstream("sglang.multimodal_gen.runtime.entrypoints.action.ws_utils")

    assert api.action_metadata is protocol.action_metadata is ws_utils.action_metadata
    metadata = protocol.action_metadata(_server_args(Pi05PipelineConfig(**overrides)))
    assert metadata["runtime"]["cuda_graph"] == expected_block
    assert metadata["runtime"]["cuda_graph_mode"] == mode
    any_graph = mode != "off"
    assert metadata["defaults"]["cuda_graph"] == ("auto" if any_graph else False)
    assert metadata["capabilities"]["cuda_graph"] is any_graph
    # 0.5.17's other fields are unchanged
    assert metadata["model"] == "lerobot/pi05_base"
    assert metadata["runtime"]["parallelism"]["prefix_strategy"] == "tp"
