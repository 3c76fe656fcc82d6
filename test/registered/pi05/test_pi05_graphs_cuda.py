"""Pi0.5 CUDA graphs on the GPU (patch pi05_graphs): real-size model, random weights.

Pi05PolicyModel is built from sglang's own config (gemma_2b + SigLIP + gemma_300m,
about 3.35 B parameters, bf16) with a seeded random fill instead of a checkpoint
(sglang_ext_testkit.pi05_random). Two 224x224 cameras, 10 denoise steps, horizon 50,
action dim 32; full prefixes (both cameras) and masked prefixes (empty second camera).

Tolerance: graph replays run the same kernels as eager on the same inputs, so we
expect equality; the stated bound is a relative max-abs difference of 1e-2 of the
largest eager action (bf16 has 8 mantissa bits: 2^-8 = 3.9e-3 per rounding, a few
roundings of headroom). Every case prints its max abs / relative difference.
"""

from __future__ import annotations

import contextlib
import importlib
import os

import pytest
import torch

from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=240, stage="base-b", runner_config="1-gpu-small")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

RELATIVE_TOLERANCE = 1e-2
NUM_STEPS = 10
PATCHED_TREE = os.environ.get("EXT_TEST_TREE", "plugin") == "patched"


def _ext_environment(**knobs):
    """Strict activation with the patches unrelated to Pi0.5 off, plus `knobs` (SGLANG_EXT_<name>)."""
    from sglang_ext.versions import installed_sglang_version, source_tree_version

    from sglang_ext_testkit.pi05_random import unrelated_patches

    env = {
        "SGLANG_EXT": "1",
        "SGLANG_EXT_STRICT": "1",
        "SGLANG_EXT_DISABLE": ",".join(unrelated_patches()),
        **{f"SGLANG_EXT_{name}": value for name, value in knobs.items()},
    }
    if installed_sglang_version() is None:  # unpacked source tree (GPU machine)
        import sglang

        version = source_tree_version(os.path.dirname(os.path.dirname(sglang.__file__)))
        if version:
            env["SGLANG_EXT_ASSUME_SGLANG"] = version
    return env


_OPEN_POLICIES = []  # random_policy blocks open now, outermost first


@contextlib.contextmanager
def random_policy(env, unset=()):
    """The real-size random Pi0.5 (bf16, seed 0) built under `env`'s activation (`unset`: names
    removed from the environment); its graphs, memory and the activation released after, and an
    enclosing block's activation (the module's policy) made live again."""
    from sglang_ext_testkit.pi05_random import build_random_pi05

    # the plugin, or on the patched tree the copy the fork series vendors (sglang.ext)
    activation = importlib.import_module("sglang.ext.activation" if PATCHED_TREE else "sglang_ext.activation")
    patch = pytest.MonkeyPatch()
    # these tests set prompt lengths, buckets and capacities themselves: graphs captured on first use
    patch.setenv("SGLANG_EXT_PI05_GRAPH_CAPTURE", "lazy")
    for key, value in env.items():
        patch.setenv(key, value)
    for key in unset:
        patch.delenv(key, raising=False)
    activation.deactivate()
    statuses = activation.activate(eager=True)
    print("sglang-ext:", {name: str(status) for name, status in statuses.items()})
    model = build_random_pi05(device="cuda", dtype=torch.bfloat16, seed=0)
    _OPEN_POLICIES.append(model)
    try:
        yield model
    finally:
        model.prefix_graph_runner.clear()
        model.graph_runner.clear()
        _OPEN_POLICIES.pop()
        del model
        torch.cuda.empty_cache()
        activation.deactivate()
        patch.undo()  # the enclosing block's environment
        if _OPEN_POLICIES:  # its policy runs on the patched classes again
            activation.activate(eager=True)


@pytest.fixture(scope="module")
def policy():
    env = _ext_environment(PI05_PREFIX_GRAPH_MAX_ENTRIES="16", PI05_ACTION_GRAPH_MAX_ENTRIES="16")
    with random_policy(env) as model:
        print(
            "graph runners:",
            "prefix", model.prefix_graph_runner.enabled, model.prefix_graph_runner.max_entries,
            "action", model.graph_runner.enabled, model.graph_runner.max_entries,
        )
        yield model


def _compare(label, graph_actions, eager_actions):
    from sglang_ext_testkit.pi05_random import finite, max_abs_diff, relative_diff

    diff = max_abs_diff(graph_actions, eager_actions)
    relative = relative_diff(graph_actions, eager_actions)
    print(
        f"[{label}] max|graph-eager|={diff:.3e} relative={relative:.3e} "
        f"max|eager|={float(eager_actions.abs().max()):.3e} bit_equal={torch.equal(graph_actions, eager_actions)}"
    )
    assert finite(eager_actions) and finite(graph_actions), label
    assert relative <= RELATIVE_TOLERANCE, f"{label}: relative difference {relative:.3e} > {RELATIVE_TOLERANCE}"


def _request(policy, *, prompt_len, masked, seed, graph):
    from sglang_ext_testkit.pi05_random import make_noise, make_observation, run_request

    observation = make_observation(policy, prompt_len=prompt_len, masked_camera=masked, seed=seed)
    return run_request(policy, observation, make_noise(policy, seed), graph=graph, num_steps=NUM_STEPS)


@pytest.mark.parametrize("prompt_len", [17, 48, 111])
@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
def test_graph_mode_matches_eager(policy, masked, prompt_len):
    before_prefix = policy.prefix_graph_runner.cache_info()
    before_action = policy.graph_runner.cache_info()
    eager = _request(policy, prompt_len=prompt_len, masked=masked, seed=prompt_len, graph=False)
    captured = _request(policy, prompt_len=prompt_len, masked=masked, seed=prompt_len, graph=True)
    replayed = _request(policy, prompt_len=prompt_len, masked=masked, seed=prompt_len, graph=True)
    label = f"{'masked' if masked else 'full'} prompt={prompt_len}"
    _compare(label + " capture", captured, eager)
    _compare(label + " replay", replayed, eager)
    assert torch.equal(captured, replayed)
    prefix, action = policy.prefix_graph_runner.cache_info(), policy.graph_runner.cache_info()
    print(f"[{label}] prefix cache {prefix}\n[{label}] action cache {action}")
    # Both graphs were used: one new prefix and one new action signature, then hits.
    assert prefix.captures == before_prefix.captures + 1 and prefix.hits >= before_prefix.hits + 1
    assert action.captures == before_action.captures + 1
    assert action.hits >= before_action.hits + 2 * NUM_STEPS - 1


def test_graphs_captured_at_load_serve_every_prompt_length_and_capture_nothing_after(policy):
    """The server's default (knob pi05_graph_capture=load): every prompt bucket's graphs captured while the
    policy is built; prompts of many lengths, cameras masked or not, then replay them, within the bf16
    tolerance of the module-scoped policy's eager answer (the same weights: seed 0)."""
    from sglang_ext_testkit.pi05_random import make_noise, make_observation, pi05_state, run_request

    env = _ext_environment(PI05_GRAPH_CAPTURE="load")
    with random_policy(env) as loaded:
        prefix, action = loaded.prefix_graph_runner, loaded.graph_runner
        at_load = (prefix.cache_info(), action.cache_info())
        buckets = pi05_state(loaded).plan.prompt_buckets
        print(f"[load] buckets {buckets}; prefix {at_load[0]}; action {at_load[1]}")
        assert at_load[0].size == at_load[1].size == len(buckets) and at_load[0].sealed and at_load[1].sealed
        graphs_made = (at_load[0].captures, at_load[1].captures)
        for seed, (prompt_len, masked) in enumerate([(17, False), (33, True), (60, False), (111, True), (200, False)]):
            observation = make_observation(loaded, prompt_len=prompt_len, masked_camera=masked, seed=seed)
            got = run_request(loaded, observation, make_noise(loaded, seed), graph=True, num_steps=NUM_STEPS)
            eager = run_request(policy, observation, make_noise(policy, seed), graph=False, num_steps=NUM_STEPS)
            _compare(f"load-time prompt={prompt_len} masked={masked}", got, eager)
        after = (prefix.cache_info(), action.cache_info())
        assert (after[0].captures, after[1].captures) == graphs_made  # nothing captured after the load
        assert after[0].sealed_misses == after[1].sealed_misses == 0 and after[0].hits == 5


def test_fused_denoise_matches_eager(policy):
    from sglang_ext_testkit.pi05_random import pi05_knobs

    with pi05_knobs(policy, fused_denoise=True):  # a policy reads its knobs once, when built
        for masked in (False, True):
            eager = _request(policy, prompt_len=33, masked=masked, seed=7, graph=False)
            first = _request(policy, prompt_len=33, masked=masked, seed=7, graph=True)
            second = _request(policy, prompt_len=33, masked=masked, seed=7, graph=True)
            label = f"fused {'masked' if masked else 'full'}"
            _compare(label + " capture", first, eager)
            _compare(label + " replay", second, eager)
    loop_signatures = [s for s in policy.graph_runner._cache.entries if hasattr(s, "num_steps")]
    print("fused graphs:", loop_signatures)
    assert len(loop_signatures) == 2


def test_fused_norms_change_actions_only_within_rounding(policy, monkeypatch):
    """pi05_fused_norms vs 0.5.17's norm and gated-residual math, whole request at real size (eager)."""
    from sglang.multimodal_gen.runtime.models.vlas import pi05_core

    from pi05_pristine import reference_forward, reference_gated_residual

    identical = []
    for masked in (False, True):
        fused = _request(policy, prompt_len=40, masked=masked, seed=11, graph=False)
        with monkeypatch.context() as m:
            m.setattr(pi05_core.PiGemmaRMSNorm, "forward", reference_forward)
            m.setattr(pi05_core, "gated_residual", reference_gated_residual)
            original = _request(policy, prompt_len=40, masked=masked, seed=11, graph=False)
        _compare(f"fused norms vs 0.5.17 norms {'masked' if masked else 'full'}", fused, original)
        identical.append(torch.equal(fused, original))
    # The fused code really ran: its single bf16 rounding differs from 0.5.17's somewhere.
    assert not all(identical), "fused and 0.5.17 norms gave bit-identical actions: is pi05_fused_norms active?"
    assert pi05_core.PiGemmaRMSNorm.forward is not reference_forward  # restored


@pytest.mark.parametrize("prefix_graph", [True, False], ids=["prefix-graph", "eager-prefix"])
def test_consecutive_requests_never_share_kv(policy, prefix_graph):
    """Requests with different images and the same signature, alternating: each must
    see its own prefix K/V (eager-prefix contexts are freed between requests, so a
    refresh keyed on id() could skip the copy)."""
    from sglang_ext_testkit.pi05_random import make_noise, make_observation, max_abs_diff, run_request

    noise = make_noise(policy, 99)
    observations = {seed: make_observation(policy, prompt_len=40, seed=seed) for seed in (101, 202)}
    eager = {
        seed: run_request(policy, obs, noise, graph=False, num_steps=NUM_STEPS)
        for seed, obs in observations.items()
    }
    separation = max_abs_diff(eager[101], eager[202])
    print(f"[kv {prefix_graph}] eager A vs B differ by {separation:.3e}")
    assert separation > 1e-3, "the two requests must produce different actions"

    for seed in (101, 202, 101, 202, 101):
        observation = observations[seed]
        with torch.inference_mode():
            context = policy.encode_prefix(observation, use_cuda_graph=prefix_graph)
            actions = policy.sample_actions(
                observation, context, noise=noise, num_steps=NUM_STEPS, use_cuda_graph=True
            )
            del context
        _compare(f"kv seed={seed} prefix_graph={prefix_graph}", actions, eager[seed])
        other = 202 if seed == 101 else 101
        assert max_abs_diff(actions, eager[other]) > separation / 2


def test_bounded_cache_memory_is_flat(policy):
    """Bucket mode, capacity 2: many signatures; graph memory stays bounded."""
    cuda_graph = importlib.import_module("sglang.multimodal_gen.runtime.vla.cuda_graph")
    saved = policy.prefix_graph_runner, policy.graph_runner
    saved[0].clear()
    saved[1].clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    policy.prefix_graph_runner = cuda_graph.VLAPrefixGraphRunner(enabled=True, max_entries=2, evict_on_miss=True)
    policy.graph_runner = cuda_graph.VLADenoiseGraphRunner(enabled=True, max_entries=2, evict_on_miss=True)
    try:
        lengths = [20, 45, 70, 95, 120, 145]
        reserved = []
        for round_index in range(3):
            for prompt_len in lengths:
                _request(policy, prompt_len=prompt_len, masked=False, seed=prompt_len, graph=True)
                torch.cuda.synchronize()
                reserved.append(torch.cuda.memory_reserved())
            print(
                f"[memory] round {round_index}: reserved MiB",
                [round(r / 2**20) for r in reserved[-len(lengths):]],
            )
        prefix, action = policy.prefix_graph_runner.cache_info(), policy.graph_runner.cache_info()
        print(f"[memory] prefix {prefix}\n[memory] action {action}")
        assert prefix.size <= 2 and action.size <= 2
        assert prefix.evictions >= 3 * len(lengths) - 2 and action.evictions >= 3 * len(lengths) - 2
        first_round_peak = max(reserved[: len(lengths)])
        later_peak = max(reserved[len(lengths):])
        slack = 256 * 2**20
        print(f"[memory] first round peak {first_round_peak / 2**20:.0f} MiB, later peak {later_peak / 2**20:.0f} MiB")
        assert later_peak <= first_round_peak + slack
        eager = _request(policy, prompt_len=145, masked=False, seed=145, graph=False)
        graph = _request(policy, prompt_len=145, masked=False, seed=145, graph=True)
        _compare("after evictions prompt=145", graph, eager)
    finally:
        policy.prefix_graph_runner.clear()
        policy.graph_runner.clear()
        policy.prefix_graph_runner, policy.graph_runner = saved
