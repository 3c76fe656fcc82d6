"""The Pi0.5 server test's checkpoint folder (all but the 6.7 GB of weights) and request body,
through sglang 0.5.17's own CPU-side path: `sglang serve`'s multimodal_gen argument parsing
(--pipeline-config-path), the checkpoint config reader, the action endpoint's request parser
and the Pi0.5 preprocessing stage with the offline Gemma-style tokenizer; and the checkpoint's
tensor names against sglang's weight-name mapping for the unpatched and the patched model.

The weights half (sglang_ext_testkit.pi05_checkpoint.write_random_pi05_checkpoint) needs the
3.35 B model and runs on the GPU machine (test_pi05_server_cuda.py)."""

from __future__ import annotations

import argparse
import math
import sys

import pytest
import torch
from sglang.test.ci.ci_register import register_cpu_ci

from conftest import plugin_only, where_part_runs
from sglang_ext_testkit import pi05_checkpoint as pc

register_cpu_ci(est_time=40, suite="base-a-test-cpu")


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_gemma_style_tokenizer_loads_offline(tmp_path, offline):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pc.write_tiny_gemma_tokenizer(tmp_path / "tok")))
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    ids = tok("Task: pick up the cube, State: 12 200;\nAction: ")["input_ids"]
    assert ids[0] == 2 and 3 not in ids and len(ids) < 45
    assert tok.decode(ids, skip_special_tokens=True) == "Task: pick up the cube, State: 12 200;\nAction: "


def test_sglang_serve_parses_the_folder_and_preprocesses_the_request(tmp_path, offline, monkeypatch):
    from sglang.multimodal_gen.runtime.entrypoints.cli.serve import add_multimodal_gen_serve_args
    from sglang.multimodal_gen.runtime.entrypoints.utils import prepare_request
    from sglang_ext_testkit.upstream import upstream
    build_action_sampling_params = upstream("sglang.multimodal_gen.runtime.entrypoints.action.protocol:build_action_sampling_params")
    from sglang.multimodal_gen.runtime.models.vlas.pi05_policy import Pi05PolicyModel
    from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.pi05_preprocess import (
        Pi05Preprocessor,
    )
    from sglang.multimodal_gen.runtime.pipelines_core.stages.vla import VLAObservationPreprocessStage, vla_state
    from sglang.multimodal_gen.runtime.server_args import server_args as server_args_module
    from sglang.multimodal_gen.runtime.server_args import ServerArgs

    folder = str(pc.write_pi05_assets(tmp_path / "random-pi05"))
    argv = ["--model-path", folder, "--pipeline-config-path", f"{folder}/pipeline_config.json",
            "--num-gpus", "1", "--warmup-mode", "off", "--host", "127.0.0.1", "--port", "30123"]
    monkeypatch.setattr(sys, "argv", ["sglang", "serve", *argv])  # sglang reads explicit flags from it
    parser = argparse.ArgumentParser()
    add_multimodal_gen_serve_args(parser)
    parsed, rest = parser.parse_known_args(argv)
    args = ServerArgs.from_cli_args(parsed, rest, default_args={"warmup_mode": "server"})  # as `sglang serve`
    config = args.pipeline_config
    assert type(config).__name__ == "Pi05PipelineConfig"
    assert config.tokenizer_name == f"{folder}/tokenizer"
    assert config.enable_action_cuda_graph
    assert args.warmup is False if hasattr(args, "warmup") else args.warmup_mode == "off"  # 0.5.17 / 0.5.23

    Pi05PolicyModel._apply_checkpoint_config(folder, config)  # what the worker does before loading
    assert config.image_keys == pc.CAMERAS and config.state_dim == pc.STATE_DIM
    assert (config.action_horizon, config.action_dim, config.output_action_dim) == (
        pc.ACTION_HORIZON, pc.ACTION_DIM, pc.OUTPUT_ACTION_DIM)

    monkeypatch.setattr(server_args_module, "_global_server_args", args)  # set by each worker
    batches = []
    for seed in (1, 2):
        params = build_action_sampling_params(pc.action_request(seed), args)
        assert (params.action_horizon, params.num_inference_steps, params.enable_cuda_graph) == (50, 10, True)
        request = prepare_request(args, params)
        VLAObservationPreprocessStage(Pi05Preprocessor(config)).forward(request, args)
        batches.append(vla_state(request)["observation_batch"])
    batch, other = batches
    # the server test's two requests share one graph layout (prompt tokens) and differ in content
    assert torch.equal(batch.tokens, other.tokens) and torch.equal(batch.token_masks, other.token_masks)
    assert not torch.equal(batch.noise, other.noise)
    assert not torch.equal(batch.images[pc.CAMERAS[0]], other.images[pc.CAMERAS[0]])
    assert tuple(batch.tokens.shape) == (1, config.max_token_len)
    assert batch.tokens[0, 0] == 2 and 20 < int(batch.token_masks.sum()) < 80
    assert set(batch.images) == set(pc.CAMERAS) and all(bool(m) for m in batch.image_masks.values())
    for image in batch.images.values():
        assert tuple(image.shape) == (1, 3, 224, 224) and -1.0 <= float(image.min()) < float(image.max()) <= 1.0
    assert tuple(batch.noise.shape) == (1, pc.ACTION_HORIZON, pc.ACTION_DIM)
    assert tuple(batch.state.shape) == (1, pc.STATE_DIM)


def _core_model_tensors() -> dict:
    """{name: shape} of sglang's Pi05 core model (full size, meta device: no memory)."""
    import torch

    from sglang.multimodal_gen.configs.pipeline_configs.pi05 import Pi05PipelineConfig
    from sglang.multimodal_gen.runtime.models.vlas import pi05_core

    with torch.device("meta"):
        model = pi05_core.Pi05CoreModel(Pi05PipelineConfig(), runtime_role="all", prefix_tensor_parallel=False)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


@plugin_only
@where_part_runs("sglang_ext.pi05.gemma_projections:patch_pi05_core")  # merged GEMMs are upstream's from 0.5.19
def test_checkpoint_names_load_into_the_unpatched_and_the_patched_model(ext_patches, monkeypatch):
    """The checkpoint holds the unpatched model's state dict; sglang's own name mapping
    (Pi05PolicyModel._candidate_target_weights, what _load_weights resolves with) must reach
    every tensor of both models, or the server refuses to start ("N missing weights")."""
    from sglang.multimodal_gen.runtime.models.vlas.pi05_policy import Pi05PolicyModel
    from sglang.multimodal_gen.runtime.server_args import server_args as server_args_module

    from sglang_ext_testkit.pi05_random import unit_server_args

    monkeypatch.setattr(server_args_module, "_global_server_args", unit_server_args("torch_sdpa"))
    checkpoint = _core_model_tensors()
    assert 3.3e9 < sum(math.prod(s) for s in checkpoint.values()) < 3.4e9
    statuses = ext_patches()
    assert all(str(statuses[name]) == "applied" for name in ("pi05_graphs", "pi05_merged_linear")), statuses
    patched = _core_model_tensors()
    layer0 = "paligemma_with_expert.paligemma.model.language_model.layers.0.self_attn."
    assert layer0 + "q_proj.weight" in checkpoint and layer0 + "q_proj.weight" not in patched
    assert layer0 + "qkv_proj.weight" in patched  # merged GEMMs: other names than the checkpoint's

    for target in (checkpoint, patched):
        covered = set()
        for key, shape in checkpoint.items():
            hit = next(((name, shard) for name, shard in Pi05PolicyModel._candidate_target_weights(key)
                        if name in target), None)
            assert hit is not None, f"checkpoint tensor {key} maps to nothing"
            if hit[1] is None:
                assert target[hit[0]] == shape, (key, hit, target[hit[0]], shape)
            covered.add(hit[0])
        assert sorted(set(target) - covered) == []
