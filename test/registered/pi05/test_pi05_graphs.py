"""Pi0.5 CUDA graph runners on sglang 0.5.17 and 0.5.23 (patch pi05_graphs), on the CPU.

Real sglang code throughout (runners, Pi05CoreModel action side at a tiny width,
Pi05PolicyModel methods, VLAPrefixEncodingStage); only the CUDA graph itself is a
stand-in: `_FakeGraph` records capture/replay/reset and re-runs the captured
function on the graph's static buffers at replay, which is what a CUDA graph does
minus what the GPU test checks (values baked in at capture).
"""

from __future__ import annotations

import builtins
import gc
import importlib
import importlib.util
import os
import sys
import weakref
from types import MethodType, SimpleNamespace

import pytest
import torch
from torch import nn

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=90, suite="base-a-test-cpu")

from sglang_ext_testkit.pi05_random import unit_server_args  # noqa: E402

CORE = "sglang.multimodal_gen.runtime.models.vlas.pi05_core"
POLICY = "sglang.multimodal_gen.runtime.models.vlas.pi05_policy"
STAGES = "sglang.multimodal_gen.runtime.pipelines_core.stages.vla"
PREFIX_CACHE = "sglang.multimodal_gen.runtime.vla.prefix_cache"


# --------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------


@pytest.fixture
def pi05(ext_patches, monkeypatch):
    """`pi05(**knobs)` activates sglang-ext and returns the patched sglang modules."""
    from sglang.multimodal_gen.runtime.server_args import get_global_server_args

    server_args_module = importlib.import_module(get_global_server_args.__module__)
    monkeypatch.setattr(server_args_module, "_global_server_args", unit_server_args(None))

    def activate(**knobs):
        from conftest import ext_core

        ext_patches(**knobs)
        return SimpleNamespace(
            cg=ext_core("pi05.vla_cuda_graph"),  # our runners (on 0.5.17 also installed as vla.cuda_graph)
            core=importlib.import_module(CORE),
            policy=importlib.import_module(POLICY),
            stages=importlib.import_module(STAGES),
            prefix_cache=importlib.import_module(PREFIX_CACHE),
        )

    return activate


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph; `replay` re-runs the captured function."""

    def __init__(self, run, output, events, label):
        self.run = run
        self.output = output
        self.events = events
        self.label = label
        self.replays = 0
        self.resets = 0

    def replay(self):
        self.replays += 1
        self.events.append(("replay", self.label))
        result = self.run()
        if isinstance(self.output, torch.Tensor):
            if result is not self.output:
                self.output.copy_(result)
        else:  # PrefixContext: write into the static output, as a graph would
            self.output.prefix_pad_masks.copy_(result.prefix_pad_masks)
            for (dk, dv, _), (sk, sv, _) in zip(self.output.past_key_values, result.past_key_values):
                dk.copy_(sk)
                dv.copy_(sv)

    def reset(self):
        self.resets += 1
        self.events.append(("reset", self.label))


@pytest.fixture
def fake_graphs(monkeypatch):
    """Patch the runners' CUDA specifics; returns the event log and the graphs made."""
    state = SimpleNamespace(events=[], graphs=[])

    def install(cg):
        def capture_graph(self, device, run):
            run()  # warm-up
            output = run()  # "capture": allocates the static output
            graph = _FakeGraph(run, output, state.events, len(state.graphs))
            state.graphs.append(graph)
            state.events.append(("capture", graph.label))
            return graph, output

        monkeypatch.setattr(cg._VLAGraphRunnerBase, "_capture_graph", capture_graph)
        monkeypatch.setattr(cg._VLAGraphRunnerBase, "device_captures", staticmethod(lambda device: True))
        return state

    return install


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _kv(prefix_cache, value, prefix_len=3, layers=2):
    return prefix_cache.VLADensePrefixCache(
        tuple(
            (
                torch.full((1, 1, prefix_len, 4), float(value)),
                torch.full((1, 1, prefix_len, 4), float(value)),
                None,
            )
            for _ in range(layers)
        )
    )


def _context(prefix_cache, value, prefix_len=3, digest=None):
    return prefix_cache.PrefixContext(
        past_key_values=_kv(prefix_cache, value, prefix_len),
        prefix_pad_masks=torch.ones(1, prefix_len, dtype=torch.bool),
        prefix_len=prefix_len,
        cache_key_digest=digest,
    )


def _signature(cg, prefix_len, full=True):
    return cg.VLADenoiseGraphSignature(
        batch_size=1,
        prefix_len=prefix_len,
        prefix_full_attention=full,
        action_horizon=2,
        action_dim=4,
        dtype="float32",
        parallel_layout="single",
    )


def _kv_step(context, x_t, timestep):
    """A denoise step whose output depends on the prefix K/V (stale K/V shows)."""
    return x_t + context.past_key_values[0][0].mean() + timestep[:, None, None]


def _tiny_core(pi05_modules, runtime_role="action", seed=0):
    """Pi05CoreModel (real sglang class) with the action expert at a tiny width."""
    core = pi05_modules.core
    from sglang.multimodal_gen.configs.pipeline_configs.pi05 import Pi05PipelineConfig

    tiny = core.GemmaVariantConfig(width=64, depth=2, mlp_dim=128, num_heads=2, num_kv_heads=1, head_dim=32)
    original = core.get_gemma_variant_config
    core.get_gemma_variant_config = lambda variant: tiny
    try:
        torch.manual_seed(seed)
        model = core.Pi05CoreModel(Pi05PipelineConfig(), runtime_role=runtime_role)
    finally:
        core.get_gemma_variant_config = original
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.05)
    return model.eval()


def _random_prefix(pi05_modules, *, seed, prefix_len=9, masked=False):
    generator = torch.Generator().manual_seed(seed)
    layers = tuple(
        (
            torch.randn(1, 1, prefix_len, 32, generator=generator).to(torch.bfloat16),
            torch.randn(1, 1, prefix_len, 32, generator=generator).to(torch.bfloat16),
            None,
        )
        for _ in range(2)
    )
    masks = torch.ones(1, prefix_len, dtype=torch.bool)
    if masked:
        masks[:, 3:5] = False  # an empty camera / padded prompt
    return pi05_modules.prefix_cache.PrefixContext(
        past_key_values=pi05_modules.prefix_cache.VLADensePrefixCache(layers),
        prefix_pad_masks=masks,
        prefix_len=prefix_len,
        layout={"full_attention": not masked},
    )


def policy_adapter():
    """The pi05_graphs policy adapter of the sglang under test (plugin, or the fork's vendored copy)."""
    patched = os.environ.get("EXT_TEST_TREE", "plugin") == "patched"
    return importlib.import_module(("sglang.ext" if patched else "sglang_ext") + ".pi05.policy_graphs")


def reread_knobs(model):
    """`model` takes the knobs as they are now, as a policy built now would (its __init__ reads them)."""
    policy_adapter().state_of(model).options = policy_adapter().Pi05Options.read()
    return model


def _tiny_policy(pi05_modules, core_model, *, max_entries=4, evict_on_miss=False):
    policy_module = pi05_modules.policy
    model = policy_module.Pi05PolicyModel.__new__(policy_module.Pi05PolicyModel)
    nn.Module.__init__(model)
    reread_knobs(model)
    model.config = core_model.config
    model.device = torch.device("cpu")
    model.runtime_role = "all"
    model.core_model = core_model
    model.action_expert = policy_module.Pi05ActionExpert(core_model.config, core_model)
    model.graph_runner = pi05_modules.cg.VLADenoiseGraphRunner(
        enabled=True, max_entries=max_entries, evict_on_miss=evict_on_miss
    )
    return model


def _sample(model, context, noise, *, use_cuda_graph, num_steps=3):
    return model.sample_actions(
        SimpleNamespace(batch_size=1),
        context,
        noise=noise,
        num_steps=num_steps,
        use_cuda_graph=use_cuda_graph,
    )


# --------------------------------------------------------------------------
# Bounded caches (runner level, fake graphs)
# --------------------------------------------------------------------------


def test_exact_mode_keeps_first_signatures_and_runs_new_ones_eager(pi05, fake_graphs):
    m = pi05()
    graphs = fake_graphs(m.cg)
    runner = m.cg.VLADenoiseGraphRunner(enabled=True, max_entries=2)
    context = _context(m.prefix_cache, 1.0)
    x_t = torch.zeros(1, 2, 4)
    for prefix_len in (3, 4, 5, 3, 4, 5):
        out = runner.capture_or_run(_signature(m.cg, prefix_len), _kv_step, context, x_t, torch.ones(1))
        torch.testing.assert_close(out, _kv_step(context, x_t, torch.ones(1)))

    assert list(runner._cache.entries) == [_signature(m.cg, 3), _signature(m.cg, 4)]
    assert [e for e in graphs.events if e[0] == "capture"] == [("capture", 0), ("capture", 1)]
    info = runner.cache_info()
    assert (info.size, info.captures, info.hits, info.evictions) == (2, 2, 2, 0)
    assert info.rejections == 2 and not info.evict_on_miss
    assert all(graph.resets == 0 for graph in graphs.graphs)


def test_bucket_mode_evicts_lru_and_resets_before_the_new_capture(pi05, fake_graphs):
    m = pi05()
    graphs = fake_graphs(m.cg)
    runner = m.cg.VLADenoiseGraphRunner(enabled=True, max_entries=2, evict_on_miss=True)
    context = _context(m.prefix_cache, 1.0)
    x_t = torch.zeros(1, 2, 4)
    for prefix_len in (3, 4, 3, 5):  # 3 is used again, so 4 is the LRU when 5 arrives
        runner.capture_or_run(_signature(m.cg, prefix_len), _kv_step, context, x_t, torch.ones(1))

    assert list(runner._cache.entries) == [_signature(m.cg, 3), _signature(m.cg, 5)]
    assert graphs.graphs[1].resets == 1 and graphs.graphs[0].resets == 0
    # The evicted graph's pool memory is released before the new graph is captured.
    assert graphs.events.index(("reset", 1)) < graphs.events.index(("capture", 2))
    assert runner.cache_info().evictions == 1
    runner.clear()
    assert [graph.resets for graph in graphs.graphs] == [1, 1, 1]
    assert len(runner._cache.entries) == 0


def test_zero_capacity_disables_graphs(pi05, fake_graphs):
    m = pi05()
    graphs = fake_graphs(m.cg)
    for runner in (
        m.cg.VLADenoiseGraphRunner(enabled=True, max_entries=0),
        m.cg.VLAPrefixGraphRunner(enabled=True, max_entries=0),
    ):
        assert runner.enabled is False
    runner = m.cg.VLADenoiseGraphRunner(enabled=True, max_entries=0)
    context = _context(m.prefix_cache, 2.0)
    out = runner.capture_or_run(_signature(m.cg, 3), _kv_step, context, torch.zeros(1, 2, 4), torch.ones(1))
    torch.testing.assert_close(out, torch.full((1, 2, 4), 3.0))
    assert graphs.graphs == []


def test_policy_reads_capacities_from_knobs(pi05, monkeypatch):
    m = pi05(pi05_action_graph_max_entries=0, pi05_prefix_graph_max_entries=3)
    from sglang.multimodal_gen.configs.pipeline_configs.pi05 import Pi05PipelineConfig

    model = m.policy.Pi05PolicyModel.__new__(m.policy.Pi05PolicyModel)
    nn.Module.__init__(model)
    monkeypatch.setattr(policy_adapter().graphs_of(model), "sglang_init", lambda *args, **kwargs: None)  # no network
    model.config = Pi05PipelineConfig()
    model.device = torch.device("cuda")
    model.runtime_role = "all"
    model._prefix_language_model = lambda: SimpleNamespace(tensor_parallel=False)
    m.policy.Pi05PolicyModel.__init__(
        model, model.config, model_path="x", device=model.device, dtype=torch.bfloat16, manifest=None
    )
    assert model.graph_runner.enabled is False and model.graph_runner.max_entries == 0
    assert model.prefix_graph_runner.enabled is True and model.prefix_graph_runner.max_entries == 3


def test_anti_thrash_captures_on_the_second_sighting(pi05, fake_graphs):
    m = pi05(pi05_graph_min_hits=2)
    graphs = fake_graphs(m.cg)
    runner = m.cg.VLADenoiseGraphRunner(enabled=True, max_entries=1, evict_on_miss=True)
    context = _context(m.prefix_cache, 1.0)
    x_t = torch.zeros(1, 2, 4)
    runner.capture_or_run(_signature(m.cg, 3), _kv_step, context, x_t, torch.ones(1))
    runner.capture_or_run(_signature(m.cg, 4), _kv_step, context, x_t, torch.ones(1))
    assert graphs.graphs == []  # one-off signatures do not evict anything
    runner.capture_or_run(_signature(m.cg, 3), _kv_step, context, x_t, torch.ones(1))
    assert list(runner._cache.entries) == [_signature(m.cg, 3)]


def test_failed_capture_runs_eager_and_quarantines_the_signature(pi05, fake_graphs, monkeypatch):
    m = pi05()
    fake_graphs(m.cg)
    attempts = []

    def failing_capture(self, device, run):
        attempts.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(m.cg._VLAGraphRunnerBase, "_capture_graph", failing_capture)
    runner = m.cg.VLADenoiseGraphRunner(enabled=True, max_entries=2)
    context = _context(m.prefix_cache, 1.0)
    for _ in range(3):
        out = runner.capture_or_run(_signature(m.cg, 3), _kv_step, context, torch.zeros(1, 2, 4), torch.ones(1))
        torch.testing.assert_close(out, torch.full((1, 2, 4), 2.0))
    assert len(attempts) == 1
    assert runner.cache_info().failures == 1 and len(runner._cache.entries) == 0


def test_cache_counters_reach_graph_stats(pi05, fake_graphs):
    m = pi05()
    fake_graphs(m.cg)
    from conftest import ext_core

    stats = ext_core("graphs.stats")  # the patched tree's runners report to its vendored copy

    runner = m.cg.VLADenoiseGraphRunner(enabled=True, max_entries=1)
    context = _context(m.prefix_cache, 1.0)
    for _ in range(3):
        runner.capture_or_run(_signature(m.cg, 3), _kv_step, context, torch.zeros(1, 2, 4), torch.ones(1))
    snapshots = [s for name, s in stats.snapshot().items() if name.startswith("vla.action-denoise")]
    assert {"captures": 1, "hits": 2} in [{k: s[k] for k in ("captures", "hits")} for s in snapshots]


# --------------------------------------------------------------------------
# K/V refresh: id() reuse (0.5.17 / upstream) versus context generations (ours)
# --------------------------------------------------------------------------


def _legacy_denoise_graph_module():
    """The installed release's own denoise runner module (0.5.17's vla/denoise_cuda_graph.py, 0.5.23's
    vla/cuda_graph.py: both key the K/V refresh on id()), loaded from its file under a private name."""
    import sglang

    vla = os.path.join(os.path.dirname(sglang.__file__), "multimodal_gen", "runtime", "vla")
    path = os.path.join(vla, "denoise_cuda_graph.py")
    path = path if os.path.exists(path) else os.path.join(vla, "cuda_graph.py")
    spec = importlib.util.spec_from_file_location("_legacy_denoise_cuda_graph", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    # On a patched tree the file hands out our module (it is an alias).
    if not hasattr(module, "VLADenoiseGraphRunner") or hasattr(module.VLADenoiseGraphRunner, "capture_or_run_loop"):
        pytest.skip("this sglang tree carries the patched module; 0.5.17's code is not available")
    return module


def _run_id_reuse_scenario(prefix_cache, runner, captured_cls, runner_module, monkeypatch):
    """Sync request A's K/V into a graph, free A, build B so that its K/V container
    reuses A's address, sync B. Returns (static K value, B's K value).

    CPython normally hands the freed block to the next object of its size class (the
    loop below checks it). Whether it does within the loop depends on the allocator's
    pool layout at that moment; when it does not, id() equality is simulated for B's
    container in the runner's module (its `id` global), which is exactly the
    condition the legacy runner trusts.
    """
    static_context = _context(prefix_cache, 0.0)
    captured = captured_cls(
        graph=object(),
        static_prefix_context=static_context,
        static_x_t=torch.empty(1, 2, 4),
        static_timestep=torch.empty(1),
        static_output=torch.empty(1, 2, 4),
    )
    # Neighbours of the same type keep A's allocator pool in use after A is freed,
    # so the freed block is handed out again rather than the pool being recycled.
    ballast = [prefix_cache.VLADensePrefixCache(()) for _ in range(64)]
    request_a = _context(prefix_cache, 1.0)
    ballast += [prefix_cache.VLADensePrefixCache(()) for _ in range(64)]
    runner._sync_context_if_needed(captured, request_a)
    assert static_context.past_key_values[0][0].eq(1.0).all()
    layers_b = tuple((torch.full((1, 1, 3, 4), 2.0), torch.full((1, 1, 3, 4), 2.0), None) for _ in range(2))
    kv_a = request_a.past_key_values
    freed_id = id(kv_a)
    freed = weakref.ref(kv_a)
    del request_a  # the request's state goes; its K/V container is released last
    make_kv = prefix_cache.VLADensePrefixCache
    attempts = iter(range(200_000))
    candidates = []  # everything the loop needs exists before the free (no allocation in between)
    gc.collect()  # unrelated garbage first: the container's block must be the newest free one
    gc.disable()
    try:
        del kv_a
        for _ in attempts:  # CPython's allocator hands the freed block out again
            kv = make_kv(layers_b)
            if id(kv) == freed_id:
                break
            candidates.append(kv)
    finally:
        gc.enable()
    assert freed() is None
    if id(kv) != freed_id:
        reused_container = kv
        monkeypatch.setattr(
            runner_module,
            "id",
            lambda obj: freed_id if obj is reused_container else builtins.id(obj),
            raising=False,
        )
    assert runner_module.__dict__.get("id", builtins.id)(kv) == freed_id
    request_b = prefix_cache.PrefixContext(
        past_key_values=kv,
        prefix_pad_masks=torch.ones(1, 3, dtype=torch.bool),
        prefix_len=3,
    )
    runner._sync_context_if_needed(captured, request_b)
    return float(static_context.past_key_values[0][0].flatten()[0]), float(kv[0][0].flatten()[0])


def test_legacy_id_keyed_refresh_replays_previous_requests_kv(pi05, monkeypatch):
    legacy = _legacy_denoise_graph_module()
    m = pi05()  # only for the prefix_cache module; the legacy runner is 0.5.17 code
    static_value, request_value = _run_id_reuse_scenario(
        m.prefix_cache, legacy.VLADenoiseGraphRunner(enabled=True), legacy._CapturedDenoiseGraph, legacy, monkeypatch
    )
    assert request_value == 2.0
    assert static_value == 1.0  # the hazard: the graph still holds request A's K/V


def test_generation_keyed_refresh_copies_new_requests_kv(pi05, monkeypatch):
    m = pi05()
    static_value, request_value = _run_id_reuse_scenario(
        m.prefix_cache, m.cg.VLADenoiseGraphRunner(enabled=True), m.cg._CapturedDenoiseGraph, m.cg, monkeypatch
    )
    assert (static_value, request_value) == (2.0, 2.0)


def test_generation_refresh_skips_the_copy_for_the_same_context(pi05, monkeypatch):
    m = pi05()
    runner = m.cg.VLADenoiseGraphRunner(enabled=True)
    captured = m.cg._CapturedDenoiseGraph(
        graph=object(),
        static_prefix_context=_context(m.prefix_cache, 0.0),
        static_x_t=torch.empty(1, 2, 4),
        static_timestep=torch.empty(1),
        static_output=torch.empty(1, 2, 4),
    )
    context = _context(m.prefix_cache, 5.0)
    runner._sync_context_if_needed(captured, context)
    copies = []
    monkeypatch.setattr(m.cg, "_copy_prefix_context_", lambda dst, src: copies.append(src))
    for _ in range(3):  # every denoise step of one request
        runner._sync_context_if_needed(captured, context)
    assert copies == []
    context.layout["mutable_graph_output"] = True  # a prefix-graph output changes in place
    runner._sync_context_if_needed(captured, context)
    assert copies == [context]


# --------------------------------------------------------------------------
# Denoise layout hoisting (real Pi05CoreModel action side, tiny width)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
def test_hoisted_layout_equals_per_step_layout_and_0517_step(pi05, masked):
    core_cls = importlib.import_module(CORE).Pi05CoreModel
    legacy_denoise = None
    if not hasattr(core_cls, "prepare_denoise_layout"):  # plugin mode: 0.5.17 code still in place
        legacy_denoise = core_cls.__dict__["denoise_step"]
        legacy_embed_suffix = core_cls.__dict__["embed_suffix"]
    m = pi05()
    model = _tiny_core(m)
    context = _random_prefix(m, seed=1, masked=masked)
    x_t = torch.randn(1, model.config.action_horizon, model.config.action_dim, generator=torch.Generator().manual_seed(2))
    timestep = torch.full((1,), 0.7)
    args = (context.prefix_pad_masks, context.past_key_values, x_t, timestep, not masked)

    layout = model.prepare_denoise_layout(context.prefix_pad_masks, x_t, not masked)
    assert (layout[0] is None) == (not masked)
    hoisted = model.denoise_step(*args, denoise_layout=layout)
    per_step = model.denoise_step(*args)
    assert torch.equal(hoisted, per_step)
    if legacy_denoise is not None:

        class _LegacyCoreView:
            def __getattr__(self, name):
                return getattr(model, name)

        view = _LegacyCoreView()
        view.embed_suffix = MethodType(legacy_embed_suffix, view)
        assert torch.equal(hoisted, legacy_denoise(view, *args))


def test_eager_sample_actions_builds_the_layout_once(pi05):
    m = pi05()
    model = _tiny_policy(m, _tiny_core(m))
    calls = []
    original = model.core_model.prepare_denoise_layout

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    model.core_model.prepare_denoise_layout = counting
    context = _random_prefix(m, seed=3, masked=True)
    noise = torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(4))
    _sample(model, context, noise, use_cuda_graph=False, num_steps=4)
    assert len(calls) == 1


def test_cached_time_scaling_is_reused_and_bit_exact(pi05):
    m = pi05()
    model = _tiny_core(m)
    timestep = torch.tensor([0.25])
    noise = torch.randn(1, 50, 32)
    first = model.embed_suffix(noise, timestep)
    cached = model._time_embedding_scaling
    second = model.embed_suffix(noise, timestep)
    assert model._time_embedding_scaling is cached
    assert "_time_embedding_scaling" not in model.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    width = model.action_in_proj.out_features
    reference = m.core.create_sinusoidal_pos_embedding(
        timestep, width, model.config.time_embedding_min_period, model.config.time_embedding_max_period
    )
    assert torch.equal(
        reference,
        m.core.create_sinusoidal_pos_embedding(
            timestep,
            width,
            model.config.time_embedding_min_period,
            model.config.time_embedding_max_period,
            scaling=cached,
        ),
    )


# --------------------------------------------------------------------------
# Graph mode through Pi05PolicyModel.sample_actions (fake graphs, real model)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["per-step", "fused"])
def test_graph_mode_equals_eager_across_requests_and_layouts(pi05, fake_graphs, fused):
    m = pi05(pi05_fused_denoise=int(fused))
    graphs = fake_graphs(m.cg)
    model = _tiny_policy(m, _tiny_core(m))
    noise = torch.randn(1, 50, 32, generator=torch.Generator().manual_seed(5))
    requests = [
        _random_prefix(m, seed=10, masked=False),
        _random_prefix(m, seed=11, masked=False),  # same signature, different K/V
        _random_prefix(m, seed=12, masked=True),
        _random_prefix(m, seed=13, masked=True),
    ]
    for context in requests:
        eager = _sample(model, context, noise, use_cuda_graph=False)
        graph = _sample(model, context, noise, use_cuda_graph=True)
        assert torch.equal(graph, eager)
    # full and masked prefixes each got a graph (0.5.17 never graphed masked prefixes)
    signatures = list(model.graph_runner._cache.entries)
    full_flags = [getattr(s, "step", s).prefix_full_attention for s in signatures]
    assert sorted(full_flags) == [False, True]
    replays = sum(graph.replays for graph in graphs.graphs)
    assert replays == (len(requests) if fused else 3 * len(requests))


def test_bucket_miss_context_runs_eager(pi05, fake_graphs):
    m = pi05()
    graphs = fake_graphs(m.cg)
    model = _tiny_policy(m, _tiny_core(m))
    context = _random_prefix(m, seed=20, masked=True)
    context.layout["cuda_graph_eligible"] = False
    noise = torch.randn(1, 50, 32)
    assert torch.equal(
        _sample(model, context, noise, use_cuda_graph=True), _sample(model, context, noise, use_cuda_graph=False)
    )
    assert graphs.graphs == []


# --------------------------------------------------------------------------
# Prefix graph output: never cached, owned when several requests are in flight
# --------------------------------------------------------------------------


class _PrefixGraphPolicy:
    """Stands in for Pi05PolicyModel.encode_prefix on top of the real prefix runner."""

    def __init__(self, m):
        self.m = m
        self.runner = m.cg.VLAPrefixGraphRunner(enabled=True, max_entries=2)
        self.calls = []

    def build_prefix_cache_key(self, observation, *, bucket_prompt=False):
        return f"prefix-{float(observation.images['camera'].flatten()[0])}"

    def encode_prefix(self, observation, *, use_cuda_graph=True, bucket_prompt=None):
        self.calls.append(use_cuda_graph)
        inputs = (observation.images["camera"],)

        def encode(current):
            kv = self.m.prefix_cache.VLADensePrefixCache(((current[0] * 2, current[0] * 3, None),))
            return self.m.prefix_cache.PrefixContext(
                past_key_values=kv,
                prefix_pad_masks=torch.ones(1, current[0].shape[2], dtype=torch.bool),
                prefix_len=current[0].shape[2],
                layout={"full_attention": True},
            )

        if not use_cuda_graph:
            return encode(inputs)
        signature = self.m.cg.VLAPrefixGraphSignature(
            batch_size=1,
            input_shapes=(tuple(inputs[0].shape),),
            input_dtypes=("float32",),
            static_layout=(1, True, None),
            parallel_layout="single",
        )
        return self.runner.capture_or_run(signature, encode, inputs)


def _request(value, *, options=None):
    observation = SimpleNamespace(images={"camera": torch.full((1, 1, 3, 4), float(value))})
    return SimpleNamespace(
        is_warmup=False,
        generator=torch.Generator(),  # requests with seeds are grouped one by one
        extra={"vla": {"observation_batch": observation, "options": options or {}}},
    )


def _stage(m, policy, *, global_cache):
    class _Stage(m.stages.VLAPrefixEncodingStage):
        def __call__(self, batch, server_args):  # PipelineStage.__call__ minus profiling
            return self.forward(batch, server_args)

    stage = _Stage(policy, m.prefix_cache.VLAPrefixCacheManager(max_entries=8))
    server_args = SimpleNamespace(  # the conditioning-cache fields: 0.5.23's prefix-cache switch reads them
        pipeline_config=SimpleNamespace(enable_global_prefix_cache=global_cache, empty_cache_after_prefix=False),
        disable_conditioning_cache=False, conditioning_cache_max_size_mb=64)
    return stage, server_args


def test_prefix_graph_output_never_enters_the_prefix_cache(pi05, fake_graphs):
    m = pi05()
    fake_graphs(m.cg)
    policy = _PrefixGraphPolicy(m)
    stage, server_args = _stage(m, policy, global_cache=True)
    stage.forward(_request(1.0), server_args)
    stage.forward(_request(1.0, options={"enable_prefix_cache": False}), server_args)
    assert policy.calls == [False, True]
    (cached,) = stage.prefix_cache._cache.values()
    assert not cached.layout.get("mutable_graph_output", False)
    assert cached.past_key_values[0][0].eq(2.0).all()


def test_grouped_requests_keep_their_own_prefix_kv(pi05, fake_graphs):
    m = pi05()
    graphs = fake_graphs(m.cg)
    policy = _PrefixGraphPolicy(m)
    stage, server_args = _stage(m, policy, global_cache=False)
    first, second = _request(1.0), _request(5.0)
    # Grouped execution: the prefix stage runs for both requests before any action stage.
    stage.run_grouped_requests([first, second], server_args)
    assert graphs.graphs and graphs.graphs[0].replays == 2  # both used the same prefix graph
    first_kv = first.extra["vla"]["prefix_context"].past_key_values[0][0]
    second_kv = second.extra["vla"]["prefix_context"].past_key_values[0][0]
    assert first_kv.eq(2.0).all() and second_kv.eq(10.0).all()

    # One request at a time (the action stage runs before the next prefix): the
    # graph output is handed out without a copy.
    third = _request(7.0)
    stage.run_grouped_requests([third], server_args)
    third_context = third.extra["vla"]["prefix_context"]
    assert third_context.layout.get("mutable_graph_output") is True
    assert third_context.past_key_values[0][0].eq(14.0).all()


# --------------------------------------------------------------------------
# A graph's static tensors stay where they were captured: requests refresh them in place
# --------------------------------------------------------------------------


def _prefix_kv_step(prefix_cache):
    def encode(inputs):
        (pixels,) = inputs
        kv = (pixels * 2).reshape(1, 1, 3, 1).repeat(1, 1, 1, 4)
        return prefix_cache.PrefixContext(
            past_key_values=prefix_cache.VLADensePrefixCache(((kv, kv + 1, None), (kv + 2, kv + 3, None))),
            prefix_pad_masks=pixels.reshape(1, 3) > 0,
            prefix_len=3,
        )

    return encode


def _loop_kv_steps(context, x_t, timesteps):
    for timestep in timesteps:
        x_t.add_(context.past_key_values[0][0].mean() + timestep)
    return x_t


def _graph_case(m, kind):
    """A runner of `kind` and `run(value)` (one request)."""
    if kind == "prefix":
        runner = m.cg.VLAPrefixGraphRunner(enabled=True, max_entries=2)
        signature = m.cg.VLAPrefixGraphSignature(
            batch_size=1, input_shapes=((1, 3),), input_dtypes=("float32",), static_layout=(), parallel_layout="single"
        )
        encode = _prefix_kv_step(m.prefix_cache)

        def run(value):
            return runner.capture_or_run(signature, encode, (torch.full((1, 3), value),))

        return SimpleNamespace(runner=runner, signature=signature, run=run)
    if kind == "step":
        runner = m.cg.VLADenoiseGraphRunner(enabled=True, max_entries=2)
        signature = _signature(m.cg, 3)

        def run(value):
            return runner.capture_or_run(
                signature, _kv_step, _context(m.prefix_cache, value), torch.zeros(1, 2, 4), torch.ones(1)
            )

        return SimpleNamespace(runner=runner, signature=signature, run=run)
    runner = m.cg.VLADenoiseGraphRunner(enabled=True, max_entries=2)
    signature = m.cg.VLADenoiseLoopGraphSignature(step=_signature(m.cg, 3), num_steps=2)

    def run(value):
        return runner.capture_or_run_loop(
            signature, _loop_kv_steps, _context(m.prefix_cache, value), torch.zeros(1, 2, 4), torch.ones(2)
        )

    return SimpleNamespace(runner=runner, signature=signature, run=run)


def _static_addresses(captured):
    """Address of every tensor a captured entry holds (prefix K/V and masks included), by attribute."""
    out = {}
    for name, value in vars(captured).items():
        if hasattr(value, "past_key_values"):
            value = [value.prefix_pad_masks, *(t for keys, values, _ in value.past_key_values for t in (keys, values))]
        for i, tensor in enumerate(value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(tensor, torch.Tensor):
                out[f"{name}[{i}]"] = tensor.data_ptr()
    return out


@pytest.mark.parametrize("kind", ["prefix", "step", "loop"])
def test_requests_refresh_static_tensors_in_place(pi05, fake_graphs, kind):
    m = pi05()
    graphs = fake_graphs(m.cg)
    case = _graph_case(m, kind)
    values = (lambda out: out.past_key_values[0][0]) if kind == "prefix" else (lambda out: out)
    first = values(case.run(1.0)).clone()
    captured = case.runner._cache.entries[case.signature]
    addresses = _static_addresses(captured)
    assert len(addresses) >= 3
    second = values(case.run(2.0))  # a new request: inputs and K/V are copied into the captured tensors
    (graph,) = graphs.graphs
    assert graph.replays == 2 and case.runner._cache.entries[case.signature] is captured
    assert _static_addresses(captured) == addresses
    assert not torch.equal(first, second)  # the replay read the new request's values


def test_cameras_reach_the_gpu_through_pinned_memory_without_blocking(pi05):
    """encode_prefix's camera copy: a CPU frame bound for a GPU is pinned, then copied without blocking
    the host; anything else is a plain `.to`."""
    from conftest import ext_core

    pi05()
    host_copy = ext_core("graphs.host_copy")  # what the policy's encode_prefix copies camera frames with
    calls = []

    class HostFrame:  # a CPU tensor's copy calls, as seen from here (no GPU on this machine)
        device = torch.device("cpu")

        def numel(self):
            return 3 * 224 * 224

        def element_size(self):
            return 4

        def pin_memory(self):
            calls.append("pin")
            return self

        def to(self, device, dtype=None, non_blocking=False):
            calls.append((str(device), dtype, non_blocking))
            return self

    host_copy.to_device(HostFrame(), "cuda:0", torch.float32)
    assert calls == ["pin", ("cuda:0", torch.float32, True)]
    calls.clear()
    host_copy.to_device(HostFrame(), torch.device("cpu"), torch.float32)
    assert calls == [("cpu", torch.float32, False)]
    frame = torch.arange(6, dtype=torch.uint8)
    assert torch.equal(host_copy.to_device(frame, "cpu", torch.float32), frame.float())
