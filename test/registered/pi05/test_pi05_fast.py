"""Pi0.5 fast denoise path (knob pi05_fast) on the CPU: real sglang model code (0.5.17, 0.5.23).

The action side of the real Pi05CoreModel / Pi05PolicyModel at a tiny width (two
layers, two query heads over one K/V head) with random weights; the CUDA graph is
the stand-in of test_pi05_graphs (`fake_graphs`: replay re-runs the captured loop on
the graph's static buffers). On CPU tensors the fused kernels run their torch
references (test/registered/kernels checks the Triton kernels against them); one
test runs this comparison with the Triton kernels themselves, through triton's
interpreter, in a subprocess.

Tolerance: fast vs exact max|d| / max|exact| <= 1e-2 and cosine >= 0.9999
(bf16: 2^-8 per rounding; the fast path rounds in other places than the exact one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

from conftest import import_triton  # noqa: E402  (test/registered/conftest.py)
from test_pi05_graphs import (  # noqa: E402,F401
    _random_prefix, _sample, _tiny_core, _tiny_policy, fake_graphs, pi05, policy_adapter, reread_knobs)

RELATIVE_TOLERANCE = 1e-2
COSINE_FLOOR = 0.9999


def _fast(name):
    """sglang_ext.pi05.<name> of the tree under test (fast_loop, fast_prefix, ...)."""
    from conftest import ext_core

    return ext_core("pi05." + name)


def _paths(m):
    """This activation's fast paths (FastPaths, made by the pi05_graphs patch)."""
    return m.policy.Pi05PolicyModel.__init__.graphs.fast_paths


def _agreement(fast, exact):
    """(max|fast - exact| / max|exact|, cosine): the bench's measures (sglang_ext_testkit.pi05_random)."""
    from sglang_ext_testkit.pi05_random import cosine, relative_diff

    return relative_diff(fast, exact), cosine(fast, exact)


def _count_calls(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
def test_fast_path_matches_exact_path_graph_and_eager(pi05, fake_graphs, monkeypatch, masked, set_knob):
    m = pi05()
    graphs = fake_graphs(m.cg)
    model = _tiny_policy(m, _tiny_core(m))
    denoise_calls = _count_calls(monkeypatch, _fast("fast_loop"), "denoise")
    for seed in (30, 31):
        context = _random_prefix(m, seed=seed, masked=masked)
        noise = torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(seed))
        set_knob("pi05_fast", 0)
        before = len(denoise_calls)
        exact = _sample(reread_knobs(model), context, noise, use_cuda_graph=False, num_steps=4)
        assert len(denoise_calls) == before  # knob off: the exact path, untouched
        set_knob("pi05_fast", 1)
        reread_knobs(model)
        fast_eager = _sample(model, context, noise, use_cuda_graph=False, num_steps=4)
        fast_graph = _sample(model, context, noise, use_cuda_graph=True, num_steps=4)
        relative, cosine = _agreement(fast_eager, exact)
        print(f"[fast {'masked' if masked else 'full'} seed={seed}] relative={relative:.3e} cosine={cosine:.7f}")
        assert relative <= RELATIVE_TOLERANCE and cosine >= COSINE_FLOOR, (relative, cosine)
        assert not torch.equal(fast_eager, exact)  # the fused path really ran: other roundings
        # Graph and eager of the same path: the same code on the same inputs.
        assert torch.equal(fast_graph, fast_eager)
    assert len(denoise_calls) >= 4  # eager + capture warm-up/capture + replays
    signatures = list(model.graph_runner._cache.entries)
    assert [s.kernels for s in signatures] == ["fast"]
    assert sum(graph.replays for graph in graphs.graphs) == 2


def test_skinny_gemm_and_attention_plans_fill_the_gpu():
    """The GEMM plans for Pi0.5's real action-expert shapes on a 132-SM H200: one wave (at most
    one program per SM), no other block width / K split with more programs in one wave, each
    part >= two 128-wide K blocks, and the gated gate_up (gelu in the epilogue) never split."""
    fast_loop = _fast("fast_loop")
    sms = 132
    shapes = {"qkv": (2560, 1024), "o": (1024, 2048), "gate_up": (8192, 1024), "down": (1024, 4096)}
    for name, (n, k) in shapes.items():
        gated = name == "gate_up"
        _, parts, block_n, block_k = fast_loop.skinny_plan(torch.empty(n, k), sms, splittable=not gated, gated=gated)
        width = n // 2 if gated else n
        programs = -(-width // block_n) * parts
        print(f"[plan] {name} N={n} K={k}: parts={parts} block_n={block_n} block_k={block_k} programs={programs}")
        assert block_k == 128 and k % (parts * 128) == 0 and k // parts >= 256
        assert programs <= sms
        candidates = [-(-width // bn) * p for bn in (32, 64) for p in (1, 2, 4, 8)
                      if (p == 1 or not gated) and k // p >= 256 and -(-width // bn) * p <= sms]
        assert programs == max(candidates), (name, programs, candidates)
        if gated:
            assert parts == 1
    # The tiny test model's K = 64: one 64-wide block, no split; K = 24 has no block >= 16.
    assert fast_loop.skinny_plan(torch.empty(128, 64), sms)[1:] == (1, 32, 64)
    assert fast_loop.skinny_plan(torch.empty(128, 24), sms) is None
    # 50 action tokens x 8 heads over one K/V head: 7 query blocks; keys 560 prefix + 50.
    from sglang_ext.kernels.attention import key_splits

    splits = key_splits(1, 50, 8, 1, 610, sms)
    print(f"[plan] attention: {splits} key splits x 7 query blocks")
    assert splits == -(-610 // 64)  # one 64-row key block per program: 70 programs
    assert key_splits(1, 50, 8, 1, 8000, sms) == sms // 7  # long K/V: capped by the SMs


def test_fast_and_exact_fused_loops_get_separate_graphs(pi05, fake_graphs, monkeypatch, set_knob):
    m = pi05(pi05_fused_denoise=1)
    fake_graphs(m.cg)
    model = _tiny_policy(m, _tiny_core(m))
    context = _random_prefix(m, seed=40)
    noise = torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(40))
    exact_graph = _sample(model, context, noise, use_cuda_graph=True)
    set_knob("pi05_fast", 1)
    fast_graph = _sample(reread_knobs(model), context, noise, use_cuda_graph=True)
    set_knob("pi05_fast", 0)
    assert torch.equal(_sample(reread_knobs(model), context, noise, use_cuda_graph=True), exact_graph)
    assert not torch.equal(fast_graph, exact_graph)
    assert sorted(s.kernels for s in model.graph_runner._cache.entries) == ["exact", "fast"]


def test_time_conditioning_is_computed_once_per_step_count_and_matches_the_model(pi05, monkeypatch):
    m = pi05(pi05_fast=1)
    model = _tiny_policy(m, _tiny_core(m))
    builds = _count_calls(monkeypatch, _fast("fast_loop"), "build_time_conditioning")
    noise = torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(50))
    for seed in (51, 52, 53):
        _sample(model, _random_prefix(m, seed=seed, masked=seed % 2 == 0), noise, use_cuda_graph=False, num_steps=3)
    assert len(builds) == 1
    fast = policy_adapter()._fast_path(model)
    table = fast.time_conditioning(3, 1, torch.device("cpu"))
    assert len(builds) == 1
    _sample(model, _random_prefix(m, seed=54), noise, use_cuda_graph=False, num_steps=5)
    assert len(builds) == 2

    # The table holds what the exact path computes in each step.
    core = model.core_model
    expert = core.paligemma_with_expert.gemma_expert.model
    norms = [n for layer in expert.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    norms.append(expert.norm)
    assert tuple(table.shape) == (3, len(norms), 3, 1, norms[0].dim)
    for step, t in enumerate(torch.linspace(1.0, 1.0 / 3, 3)):
        _, cond = core.embed_suffix(noise, t.reshape(1))
        for index, norm in enumerate(norms):
            scale, shift, gate = norm.dense(cond.to(norm.dense.weight.dtype)).chunk(3, dim=-1)
            torch.testing.assert_close(table[step, index, 0], scale.float(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(table[step, index, 1], shift.float(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(table[step, index, 2], gate.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-3)

    # Bounded, and dropped with the action graphs (as policy __init__ registers the hook; _tiny_policy skips it).
    entries = _fast("fast_path").TIME_TABLE_ENTRIES
    for steps in range(6, 6 + entries + 2):
        fast.time_conditioning(steps, 1, torch.device("cpu"))
    assert len(fast._tables) == entries
    _reset_with_the_action_graphs(model)
    model.graph_runner.clear()
    assert not fast._tables and not any(k.startswith("_ext") for k in core.__dict__)


def _reset_with_the_action_graphs(model):
    import functools
    import weakref

    adapter = policy_adapter()
    model.graph_runner.add_clear_hook(functools.partial(adapter._reset_fast_path, adapter.graphs_of(model),
                                                        weakref.ref(model), "reset_action"))


def test_bench_modes_set_the_options_a_policy_built_with_them_would_read(pi05):
    """bench_pi05's configure() rebuilds one policy's runners per mode: each mode's Pi05Options land in the
    policy's state (the patch's PolicyGraphs, not attributes on the policy) and its graph plan is resolved
    again from the config it just set."""
    import sys

    from sglang_ext_testkit.pi05_random import pi05_state

    sys.argv, argv = ["bench_pi05.py", "--impl", "0517-ext", "--buckets", "32,64"], sys.argv
    try:
        import bench_pi05

        args = bench_pi05.parse_args()
    finally:
        sys.argv = argv
    m = pi05(pi05_fast=1, pi05_graph_capture="lazy")  # what bench_pi05 runs (pi05_random)
    policy = _tiny_policy(m, _tiny_core(m))
    policy.prefix_graph_runner = m.cg.VLAPrefixGraphRunner(enabled=False)
    policy._prefix_language_model = lambda: SimpleNamespace(tensor_parallel=False)
    state = pi05_state(policy)
    assert state is not None and "_ext_options" not in vars(policy)
    # (fast, fused_denoise, fused_vision, pdl) each mode sets
    modes = {"graph": (False, False, True, True), "graph-fused": (False, True, True, True),
             "graph-fast": (True, True, True, True), "graph-fast-nopdl": (True, True, True, False),
             "graph-fast-exact-vision": (True, True, False, True), "graph-bucket": (False, False, True, True)}
    for mode, want in modes.items():
        described = bench_pi05.configure(policy, "0517-ext", mode, args)
        options = state.options
        got = (options.fast, options.fused_denoise, options.fused_vision, options.pdl)
        assert got == want, mode
        assert described["fused_vision"] == (want[2] if want[0] else None)
        assert state.plan.prompt_buckets == ((32, 64) if mode == "graph-bucket" else ()), mode


def test_the_modes_of_one_model_share_its_state(pi05):
    """Another mode (bench_pi05's modes, pdl=False in a test) is another path on the same state: graphs captured in
    either mode read the same time tables and packed q/k/v, and a reset of one resets all."""
    m = pi05(pi05_fast=1)
    paths = _paths(m)
    core = _tiny_core(m)
    first = paths.path(core)
    other = paths.path(core, pdl=False)
    assert other is not first and (other.pdl, first.pdl) == (False, True)
    assert paths.path(core) is first
    table = first.time_conditioning(2, 1, "cpu")
    assert other.time_conditioning(2, 1, "cpu") is table
    assert other.packing is first.packing
    other.reset_action()
    assert len(first._tables) == 0 and first.time_conditioning(2, 1, "cpu") is not table


def test_unsupported_layout_takes_the_exact_path(pi05, monkeypatch, set_knob):
    m = pi05(pi05_fast=1)
    model = _tiny_policy(m, _tiny_core(m))
    context = _random_prefix(m, seed=60, masked=True)
    noise = torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(60))
    fast = _sample(model, context, noise, use_cuda_graph=False)
    monkeypatch.setattr(_fast("fast_support"), "denoise_unsupported", lambda core: "tensor-parallel action expert")
    other = _tiny_policy(m, model.core_model)
    _paths(m)._paths.pop(model.core_model)  # a new model's fast path: its verdict not made yet
    denoise_calls = _count_calls(monkeypatch, _fast("fast_loop"), "denoise")
    fallback = _sample(other, context, noise, use_cuda_graph=False)
    assert denoise_calls == []
    set_knob("pi05_fast", 0)
    assert torch.equal(fallback, _sample(reread_knobs(other), context, noise, use_cuda_graph=False))
    assert not torch.equal(fast, fallback)


def test_a_failing_first_fast_run_costs_the_exact_path_not_the_request(pi05, monkeypatch, set_knob):
    m = pi05(pi05_fast=1)
    model = _tiny_policy(m, _tiny_core(m))
    context = _random_prefix(m, seed=65, masked=True)
    noise = torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(65))
    attempts = []

    def failing(core, prefix_context, state, table, **kwargs):
        attempts.append(1)
        state.fill_(float("nan"))  # a half-done loop must not leak into the request
        raise RuntimeError("kernel does not build here")

    monkeypatch.setattr(_fast("fast_loop"), "denoise", failing)
    first = _sample(model, context, noise, use_cuda_graph=False)
    second = _sample(model, context, noise, use_cuda_graph=False)
    assert attempts == [1]
    assert "kernel does not build here" in policy_adapter()._fast_path(model).unsupported_reason()
    set_knob("pi05_fast", 0)
    exact = _sample(reread_knobs(model), context, noise, use_cuda_graph=False)
    assert torch.equal(first, exact) and torch.equal(second, exact)


def _tiny_prefix_language_model(m, core):
    """sglang's PiGemmaModel as the prefix language model (no adaRMS), at the tiny width,
    in the dtypes Pi05CoreModel gives it (bf16, norms float32), attached to `core`."""
    import copy

    config = copy.deepcopy(core.paligemma_with_expert.gemma_expert.model.config)
    config.use_adarms, config.adarms_cond_dim = False, None
    torch.manual_seed(81)
    language_model = m.core.PiGemmaModel(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, parameter in language_model.named_parameters():
            if "layernorm" in name or name.startswith("norm"):
                parameter.data = parameter.data.float()
            parameter.normal_(0.0, 0.05)
    core.paligemma_with_expert.paligemma = SimpleNamespace(model=SimpleNamespace(language_model=language_model))
    return language_model.eval()


@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
def test_fast_prefix_layers_give_the_exact_prefix_kv(pi05, monkeypatch, masked, set_knob):
    """Stretch: the prefix language model's layers on the fused kernels vs sglang's forward."""
    m = pi05(pi05_fast=1)
    core = _tiny_core(m)
    language_model = _tiny_prefix_language_model(m, core)
    policy = m.policy.Pi05PolicyModel.__new__(m.policy.Pi05PolicyModel)
    nn.Module.__init__(policy)
    policy.core_model = core
    fast_path = policy_adapter()._fast_prefix(reread_knobs(policy))
    assert fast_path is not None and fast_path.unsupported_reason("prefix") is None
    generator = torch.Generator().manual_seed(80)
    embeds = torch.randn(1, 23, 64, generator=generator)
    pad = torch.ones(1, 23, dtype=torch.bool)
    if masked:
        pad[:, 9:14] = False  # an empty camera / padded prompt
    positions = torch.cumsum(pad, dim=1) - 1
    mask = None
    if masked:
        mask = core.prepare_attention_masks_4d(
            m.core.make_att_2d_masks(pad, torch.zeros_like(pad)), full_attention=False
        )
    with torch.inference_mode(), m.core.set_forward_context(current_timestep=0, attn_metadata=None):
        fast = fast_path.encode_prefix_layers(embeds, mask, positions, pad if masked else None)
        # what PaliGemmaWithExpertModel.forward runs for a prefix
        exact = language_model.forward(
            inputs_embeds=embeds, attention_mask=mask, position_ids=positions, past_key_values=None, use_cache=True
        ).past_key_values
    assert len(fast) == len(exact) == 2
    valid = pad[0]
    for (fast_k, fast_v, _), (exact_k, exact_v, _) in zip(fast, exact):
        assert fast_k.shape == exact_k.shape and fast_v.shape == exact_v.shape
        for got, want in ((fast_k, exact_k), (fast_v, exact_v)):
            got, want = got[:, :, valid], want[:, :, valid]  # padded positions are masked everywhere
            relative, cosine = _agreement(got, want)
            assert relative <= RELATIVE_TOLERANCE and cosine >= COSINE_FLOOR, (relative, cosine)
    # Off: the exact forward, bit for bit (encode_prefix does not ask for the fast layers).
    set_knob("pi05_fast", 0)
    assert policy_adapter()._fast_prefix(reread_knobs(policy)) is None


def _tiny_vision_tower(m, core, hidden_act="gelu_pytorch_tanh"):
    """transformers' SiglipVisionModel at a tiny width as Pi05CoreModel sets it up (sglang's forward and
    native attention, bf16 but the patch embedding), attached to `core`."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    config = SiglipVisionConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                                image_size=28, patch_size=14, hidden_act=hidden_act)
    torch.manual_seed(90)
    tower = SiglipVisionModel(config)
    vision_model = getattr(tower, "vision_model", tower)
    vision_model.forward = m.core.siglip_vision_forward_with_openpi_dtype.__get__(vision_model, type(vision_model))
    m.core.patch_siglip_vision_attention_to_native(vision_model)
    tower.to(torch.bfloat16)
    vision_model.embeddings.float()
    with torch.no_grad():
        for name, parameter in tower.named_parameters():
            parameter.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.05)
    core.paligemma_with_expert.paligemma = SimpleNamespace(model=SimpleNamespace(vision_tower=tower))
    return tower.eval()


def _features(m, tower, pixels):
    """The tower's last hidden state, in the forward context Pi05CoreModel.embed_image opens."""
    with m.core.set_forward_context(current_timestep=0, attn_metadata=None):
        return tower(pixels).last_hidden_state


def test_fused_vision_layers_match_the_exact_tower_and_fall_back_cleanly(pi05, monkeypatch):
    """Pi05FastPath.fused_vision: SigLIP's encoder layers on packed q/k/v, add+LayerNorm and gelu-in-GEMM
    against the exact tower; off, closed or failing: the exact layers bit for bit."""
    from conftest import ext_core

    kernels = ext_core("kernels")  # the copy the fast path calls (the patched tree vendors its own)

    m = pi05(pi05_fast=1)
    if not hasattr(m.core, "siglip_vision_forward_with_openpi_dtype"):
        pytest.skip("0.5.18+ builds srt's SigLIP tower: the fused layers decline it (test_srt_siglip_tower_...)")
    paths = _paths(m)
    core = _tiny_core(m)
    tower = _tiny_vision_tower(m, core)
    encoder = _fast("fast_support").vision_encoder(core)
    path = paths.path(core)
    assert path.unsupported_reason("vision") is None
    norms = _count_calls(monkeypatch, kernels, "add_layer_norm")
    pixels = torch.rand(2, 3, 28, 28, generator=torch.Generator().manual_seed(91)) * 2 - 1
    with torch.inference_mode():
        exact = _features(m, tower, pixels)
        with paths.path(core, fused_vision=False).vision():  # the setting is off: the exact layers
            assert torch.equal(_features(m, tower, pixels), exact) and not norms
        path.prepare_vision()
        with path.vision():
            fused = _features(m, tower, pixels)
        assert len(norms) == 2 * 2  # the first LayerNorm, then two per layer less the one after the last
        assert torch.equal(_features(m, tower, pixels), exact)  # closed: exact layers, same (packed) weights
        assert len(norms) == 2 * 2
    relative, cosine = _agreement(fused, exact)
    print(f"[fused vision tiny] relative={relative:.3e} cosine={cosine:.7f}")
    assert relative <= RELATIVE_TOLERANCE and cosine >= COSINE_FLOOR  # (the norm calls above: it ran)
    assert path.verified("vision")
    # the encoder's forward is wrapped once, through the patch: recorded, undone by deactivation
    swaps = [s for s in paths._ctx.swaps if s.owner is encoder and s.name == "forward"]
    assert len(swaps) == 1 and encoder.__dict__["forward"] is swaps[0].replacement

    attn = encoder.layers[1].self_attn
    packing = _fast("fast_prefix")
    weight, bias = packing.current_packing(path.packing, attn)
    assert attn.v_proj.weight.data_ptr() == weight[2 * 64:].data_ptr() and attn.k_proj.bias.data_ptr() == bias[64:].data_ptr()
    attn.k_proj.weight.data = attn.k_proj.weight.data.clone()  # replaced, not copied into: packed again
    with torch.inference_mode(), path.vision():
        assert torch.equal(_features(m, tower, pixels), fused)
    assert packing.current_packing(path.packing, attn)[0] is not weight
    assert not attn.k_proj.weight.is_inference()  # packed inside inference mode, still loadable
    packings = _count_calls(monkeypatch, packing, "packed_qkv")
    path.prepare_vision()
    assert not packings  # checked once per model (each request would pay for it before its replay)...
    path.reset_prefix()  # ...until the prefix graphs are reset
    path.prepare_vision()
    assert len(packings) == 2
    stale = encoder.layers[0].self_attn
    stale.q_proj.weight.data = stale.q_proj.weight.data.clone()  # replaced: its packed copy is stale
    path.reset_prefix()
    assert len(path.packing) == 1 and packing.current_packing(path.packing, attn) is not None  # freed; kept

    # an activation the GELU epilogue does not compute: the exact layers, the reason named
    other = _tiny_core(m)
    _tiny_vision_tower(m, other, hidden_act="gelu")
    assert "vision activation 'gelu'" in paths.path(other).unsupported_reason("vision")

    # a first use that raises: logged, the exact layers for this request and the next
    failing = _tiny_core(m)
    failing_tower = _tiny_vision_tower(m, failing)
    def no_kernel(*_, **__):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(_fast("fast_prefix"), "vision_layers", no_kernel)
    with torch.inference_mode():
        want = _features(m, failing_tower, pixels)
        for _ in range(2):
            with paths.path(failing).vision():
                assert torch.equal(_features(m, failing_tower, pixels), want)
    reason = paths.path(failing).unsupported_reason("vision")
    assert "fused vision layers failed on first use: RuntimeError: no kernel" in reason

    ext_core("activation").deactivate()
    assert "forward" not in encoder.__dict__


_INTERPRETED = r"""
import json, os, sys
import torch
from torch import nn
sys.path.insert(0, sys.argv[1])
from sglang_ext.kernels import runs_triton
assert runs_triton(torch.zeros(1)), "the interpreter must serve CPU tensors"
results = {}
import importlib
from test_pi05_graphs import _random_prefix, _sample, _tiny_core, _tiny_policy, reread_knobs, unit_server_args
from sglang_ext import activation
os.environ.update({"SGLANG_EXT": "1", "SGLANG_EXT_STRICT": "1"})
activation.deactivate(); activation.activate(eager=True)
from sglang.multimodal_gen.runtime.server_args import get_global_server_args
importlib.import_module(get_global_server_args.__module__)._global_server_args = unit_server_args(None)
from types import SimpleNamespace
m = SimpleNamespace(
    cg=importlib.import_module("sglang_ext.pi05.vla_cuda_graph"),
    core=importlib.import_module("sglang.multimodal_gen.runtime.models.vlas.pi05_core"),
    policy=importlib.import_module("sglang.multimodal_gen.runtime.models.vlas.pi05_policy"),
    prefix_cache=importlib.import_module("sglang.multimodal_gen.runtime.vla.prefix_cache"),
)
model = _tiny_policy(m, _tiny_core(m))
from sglang_ext import kernels, knobs
calls = {"skinny_linear": 0, "linear_rope_qkv": 0, "first_rows_attention": 0}
for name in calls:
    def counting(*args, _name=name, _original=getattr(kernels, name), **kwargs):
        calls[_name] += 1
        return _original(*args, **kwargs)
    setattr(kernels, name, counting)
def against_exact(prefix, fast_env):  # the fast loop under fast_env vs the exact path (no knobs)
    for masked in (False, True):
        context = _random_prefix(m, seed=70, masked=masked)
        noise = torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(70))
        os.environ.pop("SGLANG_EXT_PI05_FAST", None)
        knobs.use(knobs.load_settings())
        exact = _sample(reread_knobs(model), context, noise, use_cuda_graph=False, num_steps=2)
        os.environ.update(fast_env)
        knobs.use(knobs.load_settings())
        fast = _sample(reread_knobs(model), context, noise, use_cuda_graph=False, num_steps=2)
        f, e = fast.double().flatten(), exact.double().flatten()
        results[prefix + ("masked" if masked else "full")] = [
            float((f - e).abs().max() / e.abs().max()),
            float(torch.nn.functional.cosine_similarity(f, e, dim=0)),
        ]
against_exact("", {"SGLANG_EXT_PI05_FAST": "1"})
policy_graphs = importlib.import_module("sglang_ext.pi05.policy_graphs")
results["calls"] = dict(calls)
results["fallback"] = policy_graphs._fast_path(model).unsupported_reason()
print("RESULTS " + json.dumps(results))
"""


@pytest.mark.skipif(os.environ.get("EXT_TEST_TREE", "plugin") == "patched", reason="runs the plugin in a subprocess")
def test_fast_path_with_interpreted_triton_kernels_matches_exact_path():
    import_triton()
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETED, here], env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULTS "):])
    print("[interpreted triton] fast vs exact (relative, cosine):", results)
    assert results.pop("fallback") is None  # the fast loop ran to the end on the kernels
    calls = results.pop("calls")
    # 2 layouts x 2 steps x 2 layers: qkv with RoPE, 3 skinny GEMMs (o, gated gate_up, down) and
    # one attention; per step the action in / out projections
    assert calls == {"skinny_linear": 2 * 2 * (2 * 3 + 2), "linear_rope_qkv": 2 * 2 * 2,
                     "first_rows_attention": 2 * 2 * 2}, calls
    assert sorted(results) == ["full", "masked"]
    for layout, (relative, cosine) in results.items():
        assert relative <= RELATIVE_TOLERANCE and cosine >= COSINE_FLOOR, (layout, relative, cosine)


def test_srt_siglip_tower_keeps_the_exact_vision_layers(pi05):
    """0.5.18+'s tower is srt's SigLIP (VisionAttention: one packed q/k/v, no q_proj): the fused vision layers
    (written for 0.5.17's transformers tower) say why not instead of failing on the missing projections."""
    m = pi05(pi05_fast=1)
    core = _tiny_core(m)
    layer = SimpleNamespace(self_attn=SimpleNamespace(qkv_proj=torch.nn.Linear(4, 12)), mlp=SimpleNamespace())
    encoder = SimpleNamespace(layers=[layer])
    core.paligemma_with_expert.paligemma = SimpleNamespace(
        model=SimpleNamespace(vision_tower=SimpleNamespace(vision_model=SimpleNamespace(encoder=encoder))))
    assert "srt's SigLIP tower" in _paths(m).path(core).unsupported_reason("vision")


@pytest.mark.parametrize("component", ["action_expert", "action_heads"])
def test_fp8_quantized_checkpoint_keeps_the_exact_denoise(pi05, component):
    """A ModelOpt FP8 checkpoint (0.5.23: float8 projections with their own GEMMs, pi05_quantization) is declined
    with its reason: the fused kernels read plain weights. On 0.5.17 (no such checkpoints) one weight is made
    float8 in place, which is what the check reads."""
    m = pi05(pi05_fast=1)
    assert _paths(m).path(_tiny_core(m)).unsupported_reason("denoise") is None
    core = _tiny_core(m)
    try:
        from sglang.multimodal_gen.runtime.vla.pi05_quantization import replace_projections
    except ImportError:
        expert = _fast("fast_support").expert(core)
        module = core.action_out_proj if component == "action_heads" else expert.layers[1].mlp.down_proj
        module.weight = torch.nn.Parameter(module.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
    else:
        replace_projections(core, [component], quantized=True)
    what = "action heads" if component == "action_heads" else "action expert projections"
    reason = _paths(m).path(core).unsupported_reason("denoise")
    assert reason == f"FP8-quantized {what} (a ModelOpt checkpoint)"
    # the policy's denoise asks serves() (upstream's FP8 GEMMs themselves need a GPU)
    assert not policy_adapter()._fast_path(_tiny_policy(m, core)).serves("denoise")
