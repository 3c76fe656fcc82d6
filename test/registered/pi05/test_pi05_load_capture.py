"""Pi0.5 graphs captured at load, none while serving, for a robot whose state moves (sglang 0.5.17 and 0.5.23, CPU).

The robot's state is written into its prompt, so the prompt's length moves from step to step. Real
sglang code: the Pi0.5 policy (sglang_ext_testkit.pi05_random, reduced to one layer per tower), the real
preprocessor with a tiny Gemma-style tokenizer (every prompt tokenized as the server does), the
runners and caches; only the CUDA graph is the stand-in of test_pi05_graphs (`fake_graphs`: replay
re-runs the captured function on the graph's static buffers), and the runners are told the CPU captures.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=90, suite="base-a-test-cpu")

from test_pi05_graphs import _tiny_core, _tiny_policy, fake_graphs, pi05, policy_adapter  # noqa: E402,F401

MAX_TOKEN_LEN = 96  # the tiny tokenizer's robot prompts: 49-60 tokens (bucket 64) and 80-90 (80, 96)
LADDER = (32, 48, 64, 80, 96)
CAMERAS = ("base_0_rgb", "left_wrist_0_rgb")
STEPS_PER_TASK = 3
STEPS = 2


def _settings():
    name = policy_adapter().__name__.rsplit(".", 2)[0]
    import importlib

    return importlib.import_module(name + ".pi05.graph_settings")


def test_prompt_ladder_reaches_max_token_len_with_bounded_padding():
    settings = _settings()
    assert settings.prompt_ladder(200) == (32, 48, 64, 80, 112, 128, 160, 192, 200)
    assert settings.prompt_ladder(80) == (32, 48, 64, 80)
    assert settings.prompt_ladder(20) == (20,)  # shorter than the first rung: one bucket, the limit
    for limit in (33, 64, 200, 513):
        ladder = settings.prompt_ladder(limit)
        assert ladder[-1] == limit and list(ladder) == sorted(set(ladder))
        # a prompt of n tokens (n > the first rung) is padded by at most 25 % plus the rounding to 16
        for n in range(ladder[0] + 1, limit + 1):
            bucket = next(b for b in ladder if b >= n)
            assert bucket <= max(n * 1.25 + 16, ladder[0])


@pytest.mark.parametrize("capture", ["load", "lazy"])
def test_plan_sizes_the_caches_for_every_bucket_at_load(pi05, capture):
    pi05(pi05_graph_capture=capture)
    settings = _settings()
    from sglang.multimodal_gen.configs.pipeline_configs.pi05 import Pi05PipelineConfig

    config = Pi05PipelineConfig()
    plan = settings.resolve_plan(config)
    if capture == "load":
        assert plan.at_load and plan.prompt_buckets == settings.prompt_ladder(config.max_token_len)
        assert plan.prefix_entries == plan.action_entries == len(plan.prompt_buckets)
        config.prefix_cuda_graph_max_entries = 0  # off stays off
        assert settings.resolve_plan(config).prefix_entries == 0
    else:  # upstream 0.5.19's defaults: one prefix graph, four action graphs, exact prompts
        assert (plan.at_load, plan.prompt_buckets, plan.prefix_entries, plan.action_entries) == (False, (), 1, 4)
    assert plan.max_bytes == 4 << 30


def test_capacity_knob_caps_the_load_time_ladder(pi05):
    pi05(pi05_graph_capture="load", pi05_prefix_graph_max_entries=2, pi05_prompt_token_buckets="16,24,40")
    from sglang.multimodal_gen.configs.pipeline_configs.pi05 import Pi05PipelineConfig

    plan = _settings().resolve_plan(Pi05PipelineConfig())
    # the knob caps the prefix cache; the action cache keeps the config's 4, more than the 3 buckets need
    assert plan.prompt_buckets == (16, 24, 40) and plan.prefix_entries == 2 and plan.action_entries == 4


def test_segmented_actions_switch_every_graph_off(pi05, monkeypatch):
    """0.5.23's segmented actions denoise eagerly (advance_pi05_segment): with them on, upstream's config makes
    neither graph kind available; so do ours, and the policy then buckets no prompt and captures nothing at load."""
    m = pi05(pi05_graph_capture="load")
    monkeypatch.setattr(m.cg._VLAGraphRunnerBase, "device_captures", staticmethod(lambda device: True))
    settings, policy = _settings(), _tiny_policy(m, _tiny_core(m))
    config = policy.config
    assert settings.prefix_graph_available(config) and settings.action_graph_available(config)
    assert policy._prompt_token_bucketing_enabled()
    config.enable_segmented_actions = True  # 0.5.23's field (on 0.5.17's config: the same attribute)
    assert not settings.prefix_graph_available(config) and not settings.action_graph_available(config)
    assert not policy._prefix_cuda_graph_enabled() and not policy._prompt_token_bucketing_enabled()
    if hasattr(config, "action_cuda_graph_available"):  # upstream's own verdict agrees
        assert not config.prefix_cuda_graph_available() and not config.action_cuda_graph_available()


@pytest.fixture
def robot(pi05, fake_graphs, monkeypatch, tmp_path):
    """A reduced random Pi0.5 built with graph capture at load, and the server's preprocessor for it."""
    m = pi05(pi05_graph_capture="load", pi05_fused_denoise=1)
    graphs = fake_graphs(m.cg)
    monkeypatch.setattr(m.cg._VLAGraphRunnerBase, "device_captures", staticmethod(lambda device: True))
    from sglang_ext_testkit import pi05_checkpoint, pi05_random
    from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.pi05_preprocess import (
        Pi05Preprocessor)

    import torch.distributed as dist

    from sglang_ext_testkit.single_rank import release_single_rank_parallel_state

    tokenizer = pi05_checkpoint.write_tiny_gemma_tokenizer(tmp_path / "tokenizer")
    had_world = dist.is_initialized()
    try:
        policy = pi05_random.build_random_pi05(
            device="cpu", reduced=True, log=lambda _: None,
            config_overrides={"image_keys": CAMERAS, "max_token_len": MAX_TOKEN_LEN,
                              "default_num_inference_steps": STEPS, "tokenizer_name": str(tokenizer)})
        yield policy, Pi05Preprocessor(policy.config), graphs
    finally:
        if not had_world:  # the model needs a world of one; tests that fork ranks later need none
            release_single_rank_parallel_state()


def _robot_observations(count, seed=0):
    """A moving robot: a new state every step (a random walk in [-1, 1]^8); every STEPS_PER_TASK steps another
    task and another set of cameras (both; the wrist alone, named in camera_order; the base camera alone)."""
    rng = np.random.default_rng(seed)
    state = rng.uniform(-1, 1, 8)
    camera_sets = (CAMERAS, CAMERAS[1:], CAMERAS[:1])
    for step in range(count):
        segment = step // STEPS_PER_TASK
        state = np.clip(state + rng.normal(0, 0.3, 8), -1, 1)
        cameras = camera_sets[segment % len(camera_sets)]
        raw = {"prompt": ("go", "pick up the red block and put it in the basket")[segment % 2],
               "images": {name: rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for name in cameras},
               "state": state.astype(np.float32), "noise": rng.standard_normal((50, 32)).astype(np.float32)}
        if cameras != CAMERAS:
            raw["camera_order"] = list(cameras)
        yield raw


def _act(policy, observation, *, graph):
    with torch.inference_mode():
        context = policy.encode_prefix(observation, use_cuda_graph=graph, bucket_prompt=True)
        return policy.sample_actions(observation, context, noise=observation.noise, num_steps=STEPS,
                                     use_cuda_graph=graph).clone()


def test_moving_robot_replays_load_time_graphs_and_captures_nothing_while_serving(robot):
    policy, preprocess, graphs = robot
    prefix, action = policy.prefix_graph_runner, policy.graph_runner
    loaded = len(graphs.graphs)
    # at load: one prefix and one action graph per bucket, both caches sealed
    assert _settings().prompt_ladder(MAX_TOKEN_LEN) == LADDER
    assert prefix.cache_info().size == action.cache_info().size == len(LADDER) == loaded // 2
    assert prefix.cache_info().sealed and action.cache_info().sealed
    assert prefix.cache_info().bytes_resident > 0 and action.cache_info().bytes_resident > 0

    lengths, camera_counts = [], []
    for raw in _robot_observations(3 * STEPS_PER_TASK):
        observation = preprocess(raw)
        camera_counts.append(len(observation.metadata["camera_order"]))
        lengths.append(int(observation.token_masks.sum()))
        graph, eager = _act(policy, observation, graph=True), _act(policy, observation, graph=False)
        assert torch.isfinite(graph).all() and torch.equal(graph, eager)
    assert len(set(lengths)) >= 4 and len({next(b for b in LADDER if b >= n) for n in lengths}) >= 2, lengths
    assert set(camera_counts) == {1, 2}  # requests naming one camera replay the two-camera graphs
    assert len(graphs.graphs) == loaded  # nothing captured while serving
    for runner in (prefix, action):
        info = runner.cache_info()
        assert (info.captures, info.hits, info.sealed_misses) == (len(LADDER), 3 * STEPS_PER_TASK, 0), info

    # A prompt no bucket holds (tokens given by the client, longer than max_token_len) runs eager, counted,
    # and still captures nothing.
    long_prompt = preprocess({**next(_robot_observations(1, seed=3)), "tokens": np.arange(4, 4 + 2 * MAX_TOKEN_LEN)})
    assert torch.isfinite(_act(policy, long_prompt, graph=True)).all()
    assert len(graphs.graphs) == loaded and prefix.cache_info().sealed_misses == 1
    # The same with one camera named: laid out as both (the other masked), so no full-attention hint.
    one_camera_long = preprocess({**list(_robot_observations(STEPS_PER_TASK + 1, seed=3))[STEPS_PER_TASK],
                                  "tokens": np.arange(4, 4 + 2 * MAX_TOKEN_LEN)})
    assert len(one_camera_long.metadata["camera_order"]) == 1
    assert torch.isfinite(_act(policy, one_camera_long, graph=True)).all()
    assert len(graphs.graphs) == loaded and prefix.cache_info().sealed_misses == 2

    # The first camera missing (masked): its tokens come before any visible one; served, not an
    # out-of-bounds rotary gather.
    masked = preprocess({**next(_robot_observations(1, seed=4)), "image_masks": {"base_0_rgb": False}})
    assert not bool(masked.image_masks["base_0_rgb"]) and bool(masked.image_masks["left_wrist_0_rgb"])
    assert torch.isfinite(_act(policy, masked, graph=True)).all()

    # Padding the prompt to its bucket and laying one camera out as both (the other masked) changes the
    # arithmetic's shapes only: the answer stays within the bf16 tolerance of the unpadded one-camera prefix.
    one_camera = preprocess(list(_robot_observations(STEPS_PER_TASK + 1, seed=5))[STEPS_PER_TASK])
    assert len(one_camera.metadata["camera_order"]) == 1
    with torch.inference_mode():
        unpadded = policy.encode_prefix(one_camera, use_cuda_graph=False, bucket_prompt=False)
        exact = policy.sample_actions(one_camera, unpadded, noise=one_camera.noise, num_steps=STEPS,
                                      use_cuda_graph=False)
    replayed = _act(policy, one_camera, graph=True)
    relative = float((replayed - exact).abs().max() / exact.abs().max())
    cosine = float(torch.nn.functional.cosine_similarity(replayed.flatten().double(), exact.flatten().double(), 0))
    assert unpadded.prefix_len == 256 + int(one_camera.token_masks.sum()) and relative <= 1e-2 and cosine >= 0.9999, (
        relative, cosine)
