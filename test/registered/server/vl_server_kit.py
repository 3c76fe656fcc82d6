"""Shared body of the real-server VL GPU tests (one module per tiny model).

One module starts six servers of one tiny model CONCURRENTLY on one GPU (ports differ):
sglang-ext with ViT graphs on/off for the default ViT backend (fa3 on Hopper) and for
triton_attn, and unpatched sglang 0.5.17 with graphs on for both backends. Every server gets the
same request stream; the `run_all` fixture collects everything once, the tests then assert one
claim each.

Knobs (environment): SGX_SERVER_REQUESTS (200), SGX_SERVER_ATOL (graphs on vs off, 1e-2),
SGX_CONCURRENT_ATOL (concurrent vs sequential; unset: max(ATOL, 2 x batching noise)),
SGX_HEALTH_TIMEOUT_S (300), SGX_STAGGER (1), SGX_BACKENDS (default,triton_attn).
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from threading import Event as ThreadEvent
from typing import Dict, List, Optional

import pytest

from sglang_ext_testkit import vl_stream as vs
from sglang_ext_testkit.server_process import ServerProcess, free_port, start_server

N_REQUESTS = int(os.environ.get("SGX_SERVER_REQUESTS", "200"))
N_CHAT = 40  # /v1/chat/completions subset (output-token logprobs only)
N_CONCURRENT, CONCURRENCY, POOL = 64, 32, 16  # (h): 64 requests over 16 image sets, 32 in flight
ATOL = float(os.environ.get("SGX_SERVER_ATOL", "1e-2"))
_CONCURRENT = os.environ.get("SGX_CONCURRENT_ATOL")  # unset: derived from the batching noise, see (h)
CONCURRENT_ATOL = float(_CONCURRENT) if _CONCURRENT else None
HEALTH_TIMEOUT = float(os.environ.get("SGX_HEALTH_TIMEOUT_S", "300"))
# The first server starts alone and fills the JIT caches (tvm-ffi, flashinfer, triton) before the
# other five start, so six processes never compile the same kernel at once. SGX_STAGGER=0: all at once.
STAGGER = os.environ.get("SGX_STAGGER", "1") != "0"
MEMORY_SLACK = 64 << 20  # reserved bytes may move by allocator rounding, not by graphs
SRT_PATCH_PROCESS = "srt scheduler"
BACKEND_LINE = re.compile(r"Using (\S+) as multimodal attention backend")


@dataclass(frozen=True)
class ServerConfig:
    name: str
    upstream: bool  # python -m sglang.launch_server, sglang-ext switched off
    backend: Optional[str]  # --mm-attention-backend; None: sglang's default (fa3 on SM90)
    graphs: bool  # SGLANG_VIT_ENABLE_CUDA_GRAPH

    @property
    def reference(self) -> str:
        return f"ext-{self.backend or 'default'}-graphs-off"


# SGX_BACKENDS (default "default,triton_attn"): which ViT backends this run covers, so that a GPU call
# made before FA3 has arrived can run the triton_attn servers alone.
BACKENDS = tuple(None if b == "default" else b
                 for b in os.environ.get("SGX_BACKENDS", "default,triton_attn").split(","))
CONFIGS = tuple(ServerConfig(f"{'upstream' if up else 'ext'}-{be or 'default'}-graphs-{'on' if g else 'off'}",
                             up, be, g)
                for be in BACKENDS for up, g in ((False, True), (False, False), (True, True)))


@dataclass
class Run:
    config: ServerConfig
    log_path: str
    activation_dir: str
    startup_s: Optional[float] = None
    error: Optional[str] = None  # start-up failure or crash, with the log tail
    backend_logged: Optional[str] = None
    probe: List[List[float]] = field(default_factory=list)  # (a): request, same with one image changed
    signatures: List[List[float]] = field(default_factory=list)  # the stream, /generate
    chat: List[List[float]] = field(default_factory=list)  # its first N_CHAT, /v1/chat/completions
    pool_sequential: List[List[float]] = field(default_factory=list)  # (h) reference, graphs off only
    concurrent: List[List[float]] = field(default_factory=list)  # (h), CONCURRENCY in flight
    metrics_warm: Dict[str, Optional[float]] = field(default_factory=dict)
    metrics_stream: Dict[str, Optional[float]] = field(default_factory=dict)
    metrics_end: Dict[str, Optional[float]] = field(default_factory=dict)
    records: List[dict] = field(default_factory=list)
    unit: int = 0  # merged-patch size in pixels the stream was built with


# Per model, for every server of the module. Qwen3-VL's vision attention rotates q/k with a
# torch.compile'd function when ViT graphs are off and with its eager twin when they are on (sglang
# 0.5.17 `VisionAttention`, so nothing is compiled during a capture). With dynamo off both run the
# same eager math, so (d) and (e) measure the graph runner alone. Dynamo off did not explain the
# H200's mismatch (still 0 of 200 bitwise): the graph's bf16 rotary buffers did (fixed, see
# vit/capture.py GraphStore.fill_rotary); with dynamo on, not measured.
MODEL_ENV = {"qwen3_vl": {"TORCHDYNAMO_DISABLE": "1"}}


def server_env(cfg: ServerConfig, kind: str = "") -> Dict[str, str]:
    # Each server its own sglang-ext settings and its own Prometheus folder (sglang makes one).
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SGLANG_EXT") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(SGLANG_VIT_ENABLE_CUDA_GRAPH="1" if cfg.graphs else "0",
               SGLANG_VLM_CACHE_SIZE_MB="256",  # sglang's mm embedding cache, on (its default is 100)
               PYTHONUNBUFFERED="1", **MODEL_ENV.get(kind, {}))
    return env


def server_argv(cfg: ServerConfig, model_dir: str, port: int, activation_dir: str) -> List[str]:
    argv = [sys.executable, "-m", "sglang.launch_server" if cfg.upstream else "sglang_ext.launch_server",
            "--model-path", model_dir, "--tokenizer-path", model_dir, "--dtype", "bfloat16",
            "--attention-backend", "triton", "--sampling-backend", "pytorch",
            "--cuda-graph-max-bs-decode", "8", "--disable-radix-cache", "--random-seed", "0",
            # Six servers share the GPU: a large static fraction keeps sglang's "free memory minus
            # slack" KV budget positive while the others allocate; the token cap keeps the pool small.
            "--mem-fraction-static", "0.3", "--max-total-tokens", "32768",
            "--enable-metrics", "--host", "127.0.0.1", "--port", str(port)]
    if cfg.backend:
        argv += ["--mm-attention-backend", cfg.backend]
    if not cfg.upstream:
        argv += ["--ext-strict", "--ext-activation-dir", activation_dir]
        from sglang_ext.versions import installed_sglang_version

        if installed_sglang_version() is None:  # unpacked source tree without dist metadata
            argv += ["--ext-assume-sglang", "0.5.17"]
    return argv


def model_unit(model_dir: Path) -> int:
    vision = json.loads((model_dir / "config.json").read_text())["vision_config"]
    return int(vision["patch_size"]) * int(vision.get("spatial_merge_size", 2))


def check_sizes_kept(model_dir: Path, unit: int) -> None:
    """The processor must not resize the stream's images (that would change the layouts under test)."""
    pre = json.loads((model_dir / "preprocessor_config.json").read_text())
    size = pre.get("size") or {}
    lo = pre.get("min_pixels") or size.get("shortest_edge") or 0
    hi = pre.get("max_pixels") or size.get("longest_edge") or float("inf")
    pixels = [w * h * unit * unit for lay in vs.LAYOUTS for w, h in lay]
    assert lo <= min(pixels) and max(pixels) <= hi, (
        f"{model_dir}: min/max pixels {lo}/{hi} would resize images of {min(pixels)}..{max(pixels)} pixels")


def concurrent_specs(unit: int) -> List[vs.RequestSpec]:
    """(h): N_CONCURRENT requests over POOL distinct image sets, so the embedding cache gets hits."""
    pool = vs.build_stream(unit, POOL, seed=77)
    rng = random.Random(5)
    order = [pool[i % POOL] for i in range(N_CONCURRENT)]
    rng.shuffle(order)
    return order


def _generate(h: ServerProcess, spec: vs.RequestSpec) -> List[float]:
    return vs.generate_signature(h.post("/generate", vs.generate_body(spec)))


def _metrics(h: ServerProcess) -> Dict[str, Optional[float]]:
    out = vs.vit_graph_counters(h.get_text("/metrics"))
    out["nvidia_smi_mib"] = _nvidia_smi_mib(h.proc.pid)
    return out


def _nvidia_smi_mib(pgid: int) -> Optional[float]:
    """GPU memory of the server's process group by nvidia-smi (second source; None if not visible)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    total, seen = 0.0, False
    for line in out.splitlines():
        try:
            pid, mib = (int(x) for x in line.split(","))
            if os.getpgid(pid) == pgid:
                total, seen = total + mib, True
        except (ValueError, ProcessLookupError, PermissionError):
            continue
    return total if seen else None


def drive(run: Run, h: ServerProcess, unit: int, model: str) -> None:
    """The whole request sequence of one server; a failure ends it and is recorded in run.error."""
    stream = vs.build_stream(unit, N_REQUESTS)
    try:
        for spec in vs.warmup_stream(unit):
            _generate(h, spec)
        run.metrics_warm = _metrics(h)
        probe = vs.build_stream(unit, 1, seed=99)[0]  # images not in the stream
        run.probe = [_generate(h, probe), _generate(h, vs.with_image_changed(probe))]
        for spec in stream:
            run.signatures.append(_generate(h, spec))
        run.metrics_stream = _metrics(h)
        for spec in stream[:N_CHAT]:
            run.chat.append(vs.chat_signature(h.post("/v1/chat/completions", vs.chat_body(spec, model))))
        specs = concurrent_specs(unit)
        if not run.config.graphs:
            run.pool_sequential = [_generate(h, spec) for spec in specs]
        with ThreadPoolExecutor(CONCURRENCY) as ex:
            run.concurrent = list(ex.map(lambda s: _generate(h, s), specs))
        run.metrics_end = _metrics(h)
    except Exception as exc:  # noqa: BLE001 - recorded (unpatched sglang may crash); tests decide
        alive = h.proc.poll() is None
        run.error = (f"{type(exc).__name__}: {exc} after {len(run.signatures)} stream requests "
                     f"(server {'alive' if alive else f'exited {h.proc.returncode}'})\n" + h.log_tail())


def _finish(run: Run, h: ServerProcess) -> None:
    try:
        found = BACKEND_LINE.findall(h.log_text())
        run.backend_logged = found[-1] if found else None
    except OSError:
        pass
    for path in sorted(Path(run.activation_dir).glob("*.json")):
        run.records.append(json.loads(path.read_text()))


def run_servers(kind: str, workdir: Path) -> Dict[str, Run]:
    from sglang_ext_testkit.tiny_model import ensure_tiny_model

    # The model (a few MB) stays out of $OUT; logs and activation records go there.
    model_dir = Path(ensure_tiny_model(kind, Path(tempfile.mkdtemp(prefix="sgx-tiny-")) / kind, seed=0)[0])
    unit = model_unit(model_dir)
    check_sizes_kept(model_dir, unit)
    runs = {c.name: Run(c, str(workdir / f"{c.name}.log"), str(workdir / f"{c.name}-activation"), unit=unit)
            for c in CONFIGS}
    handles: Dict[str, ServerProcess] = {}
    first_done = ThreadEvent()  # the first server is healthy (or failed to start)
    if not STAGGER:
        first_done.set()

    def serve(name: str) -> None:
        run = runs[name]
        if name != CONFIGS[0].name:
            first_done.wait(HEALTH_TIMEOUT)
        port = free_port()
        h = handles[name] = start_server(server_argv(run.config, str(model_dir), port, run.activation_dir),
                                         server_env(run.config, kind), port, run.log_path)
        print(f"[{kind}] started {name} on port {port}, log {run.log_path}", flush=True)
        try:
            run.startup_s = h.wait_healthy(HEALTH_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - recorded; the tests say which server failed
            run.error = f"start-up: {exc}"
            return
        finally:
            if name == CONFIGS[0].name:
                first_done.set()
        print(f"[{kind}] {name} healthy after {run.startup_s:.0f}s", flush=True)
        drive(run, h, unit, str(model_dir))
        print(f"[{kind}] {name} done: {len(run.signatures)} stream requests"
              + (f", ERROR {run.error.splitlines()[0]}" if run.error else ""), flush=True)

    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(len(CONFIGS)) as ex:
            list(ex.map(serve, list(runs)))
        print(f"[{kind}] all servers done in {time.monotonic() - t0:.0f}s", flush=True)
    finally:
        with ThreadPoolExecutor(len(CONFIGS)) as ex:
            list(ex.map(lambda name: (handles[name].stop(), _finish(runs[name], handles[name])), list(handles)))
    for run in runs.values():
        if run.error:
            print(f"[{kind}] {run.config.name} log tail / error:\n{run.error}", flush=True)
    return runs


def make_run_all_fixture(kind: str):
    @pytest.fixture(scope="module")
    def run_all():
        workdir = Path(tempfile.mkdtemp(prefix=f"sgx-server-{kind}-", dir=os.environ.get("OUT")))
        return run_servers(kind, workdir)

    return run_all


def ok(runs: Dict[str, Run], name: str) -> Run:
    """A run that must have completed (ours, and the references)."""
    run = runs[name]
    assert run.error is None, f"{name} failed: {run.error}"
    assert len(run.signatures) == N_REQUESTS, (name, len(run.signatures))
    return run


def srt_patch_names() -> List[str]:
    from sglang_ext.registry import PATCHES

    return [p.name for p in PATCHES if p.process == SRT_PATCH_PROCESS]


def scheduler_records(run: Run) -> List[dict]:
    """Records of processes other than the launcher (sglang's detokenizer loads no plugins)."""
    return [r for r in run.records if r.get("role") != "MainProcess"]


def print_table(kind: str, runs: Dict[str, Run]) -> None:
    for run in runs.values():
        print(f"[{kind}] {run.config.name}: startup {run.startup_s}, backend logged {run.backend_logged!r}, "
              f"warm {run.metrics_warm}, end {run.metrics_end}", flush=True)


# ---------------------------------------------------------------------------
# The claims. Each module binds `kind` and `run_all` and imports these.

EXT_ON = [c.name for c in CONFIGS if not c.upstream and c.graphs]
EXT_ALL = [c.name for c in CONFIGS if not c.upstream]
UPSTREAM = [c.name for c in CONFIGS if c.upstream]


def test_a_signature_depends_on_image(kind, run_all):
    """First: a changed image changes the signature by more than every tolerance used below."""
    print_table(kind, run_all)
    for name in EXT_ALL:
        run = ok(run_all, name)
        d = vs.max_abs_diff(*run.probe)
        print(f"[{kind}] (a) {name}: one image changed -> max |diff| {d:.6g}", flush=True)
        assert d > ATOL, (
            f"{name}: changing an image moved the signature by only {d:.3g}; the comparisons prove nothing")


def test_b_activation_records(kind, run_all):
    for name in EXT_ALL:
        run = ok(run_all, name)
        records = scheduler_records(run)
        assert records, f"{name}: no scheduler activation record in {run.activation_dir}: {run.records}"
        for rec in records:
            states = {p: rec["patches"].get(p, {}).get("status") for p in srt_patch_names()}
            print(f"[{kind}] (b) {name} pid {rec['pid']} ({rec['role']}): {states}", flush=True)
            assert "vit_cuda_graph" in states
            assert all(s == "applied" for s in states.values()), (name, rec["role"], states)
        config = run.config
        print(f"[{kind}] (b) {name}: ViT backend from the server log: {run.backend_logged}", flush=True)
        assert run.backend_logged, f"{name}: no 'Using ... as multimodal attention backend' line in the log"
        if config.backend:
            assert run.backend_logged == config.backend, (name, run.backend_logged)


def test_c_vit_graph_counters(kind, run_all):
    for name in EXT_ON:
        run = ok(run_all, name)
        m = run.metrics_end
        print(f"[{kind}] (c) {name}: after warm-up {run.metrics_warm}; after stream {run.metrics_stream}; "
              f"end {m}", flush=True)
        for key in ("captures", "hits", "resident", "capacity"):
            assert m.get(key) is not None, f"{name}: /metrics has no ViT {key} (cache=vit_cuda_graph): {m}"
        assert m["captures"] > 0 and m["hits"] > 0, (name, m)
        assert m["resident"] <= m["capacity"], (name, m)
        # The warm-up covers every layout of the stream: the stream itself only replays.
        assert run.metrics_stream["captures"] == run.metrics_warm["captures"], (name, run.metrics_warm,
                                                                                run.metrics_stream)
        assert run.metrics_stream["hits"] - run.metrics_warm["hits"] >= N_REQUESTS, (name, run.metrics_stream)
    for name in (n.replace("-on", "-off") for n in EXT_ON):
        captures = run_all[name].metrics_end.get("captures")
        assert not captures, f"{name} (graphs off) captured ViT graphs: {captures}"


def test_d_graphs_on_equal_graphs_off(kind, run_all):
    for name in EXT_ON:
        run, ref = ok(run_all, name), ok(run_all, run_all[name].config.reference)
        gen = vs.compare(run.signatures, ref.signatures, ATOL)
        chat = vs.compare(run.chat, ref.chat, ATOL)
        print(f"[{kind}] (d) " + gen.line(f"{name} vs {ref.config.name} /generate"), flush=True)
        print(f"[{kind}] (d) " + chat.line(f"{name} vs {ref.config.name} /v1/chat/completions"), flush=True)
        assert len(run.chat) == N_CHAT
        assert gen.mismatches == 0 and chat.mismatches == 0, (gen, chat)


def test_e_equal_patch_count_boundaries(kind, run_all):
    """The stream holds one WIDE image right before two SQ images (equal patches), and they match."""
    unit = model_unit_of(run_all)
    stream = vs.build_stream(unit, N_REQUESTS)
    wide, pair = [tuple((w * unit, h * unit) for w, h in lay) for lay in vs.EQUAL_PATCH_PAIR]
    at = [i for i in range(N_REQUESTS - 1) if stream[i].sizes == wide and stream[i + 1].sizes == pair]
    assert at and vs.patch_count(wide, unit) == vs.patch_count(pair, unit)
    for name in EXT_ON:
        run, ref = ok(run_all, name), ok(run_all, run_all[name].config.reference)
        sub = [i + 1 for i in at]
        cmp = vs.compare([run.signatures[i] for i in sub], [ref.signatures[i] for i in sub], ATOL)
        print(f"[{kind}] (e) " + cmp.line(f"{name}: two {pair[0]} images right after one {wide[0]}"), flush=True)
        assert cmp.mismatches == 0, cmp


def test_f_unpatched_sglang_same_stream(kind, run_all):
    """Unpatched 0.5.17, graphs on: the run must have happened; its mismatches are reported, not judged."""
    for name in UPSTREAM:
        run = run_all[name]
        ref = ok(run_all, run.config.reference)
        assert run.startup_s is not None or run.error, f"{name} never ran"
        got = [s for s in run.signatures if s is not None]
        cmp = vs.compare(got, ref.signatures[:len(got)], ATOL) if got else None
        print(f"[{kind}] (f) {name}: " + (cmp.line(f"vs {ref.config.name}") if cmp else "no signature")
              + (f"; CRASH/ERROR: {run.error.splitlines()[0]}" if run.error else ""), flush=True)
        assert got or run.error, f"{name}: neither signatures nor a recorded failure"
        # Truly unpatched: no sglang-ext ViT graph cache in that server.
        assert not run.metrics_end.get("captures"), (name, run.metrics_end)


def test_g_reserved_memory_flat_after_warmup(kind, run_all):
    for name in EXT_ON:
        run = ok(run_all, name)
        warm, end = run.metrics_warm.get("reserved_bytes"), run.metrics_stream.get("reserved_bytes")
        assert warm is not None and end is not None, f"{name}: sglang_ext_cuda_memory_reserved_bytes missing"
        print(f"[{kind}] (g) {name}: reserved after warm-up {warm / 2**20:.1f} MiB, after {N_REQUESTS} "
              f"requests {end / 2**20:.1f} MiB, at the end {(run.metrics_end.get('reserved_bytes') or 0) / 2**20:.1f} MiB; "
              f"nvidia-smi (process group, MiB): {run.metrics_warm.get('nvidia_smi_mib')} -> "
              f"{run.metrics_stream.get('nvidia_smi_mib')} -> {run.metrics_end.get('nvidia_smi_mib')}", flush=True)
        assert warm > 0 and end - warm <= MEMORY_SLACK, (name, warm, end)


def check_concurrent_with_mm_cache(kind, run_all):
    """(h): 32 in flight, mm embedding cache on, images repeated: 0 corrupted vs sequential graphs-off.

    Batched prefill is not bitwise equal to batch-1 prefill, so the tolerance is the larger of ATOL
    and twice what batching alone does on the graphs-off server (same requests, same concurrency),
    unless SGX_CONCURRENT_ATOL fixes it; it must stay below what a changed image does (a).
    """
    for backend in BACKENDS:
        off = ok(run_all, f"ext-{backend or 'default'}-graphs-off")
        floor = vs.compare(off.concurrent, off.pool_sequential, 0.0)
        tol = CONCURRENT_ATOL if CONCURRENT_ATOL is not None else max(ATOL, 2 * floor.max_diff)
        image_change = vs.max_abs_diff(*off.probe)
        print(f"[{kind}] (h) " + floor.line(f"{off.config.name} {CONCURRENCY} concurrent vs its sequential "
                                              "(batching noise)") + f"; tolerance {tol:.6g}", flush=True)
        assert tol < image_change, f"tolerance {tol:.3g} would hide a changed image ({image_change:.3g})"
        for name in (c.name for c in CONFIGS if c.graphs and c.backend == backend):
            run = run_all[name]
            if run.error and run.config.upstream:
                print(f"[{kind}] (h) {name}: ERROR {run.error.splitlines()[0]}", flush=True)
                continue
            run = ok(run_all, name)
            cmp = vs.compare(run.concurrent, off.pool_sequential, tol)
            print(f"[{kind}] (h) " + cmp.line(f"{name} {CONCURRENCY} concurrent vs sequential graphs-off"),
                  flush=True)
            if not run.config.upstream:
                assert len(run.concurrent) == N_CONCURRENT and cmp.mismatches == 0, cmp


def model_unit_of(run_all) -> int:
    """The merged-patch size the module's stream was built with (from the tiny model's config)."""
    return next(iter(run_all.values())).unit
