#!/usr/bin/env python3
"""ViT CUDA graphs in the server users run: real `launch_server` processes under load, same run.

    python scripts/bench_vit_server.py --backends fa3,triton_attn --out docs/bench/vit_server.json

Per vision attention backend, one process per configuration, started one after another (each alone
while it loads and probes), all resident on the GPU at once and measured in interleaved passes (the
machine is shared and noisy: medians and spread are reported):
  graphs-off       `python -m sglang.launch_server`, SGLANG_VIT_ENABLE_CUDA_GRAPH=0 (the baseline)
  ext              `python -m sglang_ext.launch_server` with sglang-ext's default ViT graph mode
  upstream-graphs-on  `python -m sglang.launch_server`, SGLANG_VIT_ENABLE_CUDA_GRAPH=1 (unpatched; the sglang
                   on PYTHONPATH, recorded as config.sglang; `0517-graphs-on` in runs written before the rename)
  graphs-off-2     a second graphs-off process: the accuracy floor (its batches follow its own timing)
Every server holds a KV pool of the same size (`--kv-tokens`), so batching is equal between them.
The model is a random-weight checkpoint at real scale, written on the machine itself
(`--model qwen2_5_vl`: the 7B vision tower, a 3B-shaped text model; `qwen3_vl`: the 4B tower with
deepstack, a 4B-shaped text model). Load: `sglang.bench_serving`'s image dataset (random images of
random:224x224-896x896, 32 input / 8 output tokens), after a warm-up pass of the same dataset with
another seed (varied, not copies of one request) at the run's highest concurrency and image count
(runs with timed passes only), so reserved memory is judged after the largest calls were made once
(datasets take about 90 ms per request to build with one image, 230 ms with 1-4: built in a thread
while the servers start, or, where one has more than 256 requests, in slices by worker processes
before they start). Per pass, concurrency and image count (`1` = one image per request, `1-4` = one
to four): req/s, TTFT p50/p99. From `/metrics` at start and at the end: ViT graph captures (after
start-up: must be 0), hits, misses, eager fallbacks, padding, resident graph bytes and reserved
memory. `--accuracy`: input-token logprobs of a mixed-size stream (`--accuracy-sizes`) at concurrency 1 (each server
against graphs-off) and at 16 (against graphs-off, next to the floor: a second graphs-off process,
`graphs-off-2`, where it runs, else graphs-off's own later passes; each makes BATCHED_SAMPLES passes
there, the largest counts).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import bench_results  # noqa: E402
import server_trace  # noqa: E402

CONFIGS = bench_results.VIT_SERVER_CONFIGS  # name -> (launcher module, ViT graphs on, sglang-ext knobs)
# Real-scale shapes over the tiny model's folder (tokenizer, processor, chat template).
REAL_SCALE = {
    "qwen2_5_vl": dict(
        top=dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                 intermediate_size=11008, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
        vision=dict(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420, out_hidden_size=2048,
                    fullatt_block_indexes=[7, 15, 23, 31], window_size=112)),
    "qwen3_vl": dict(
        text=dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, intermediate_size=9728,
                  rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
        vision=dict(depth=24, hidden_size=1024, num_heads=16, intermediate_size=4096, out_hidden_size=2560,
                    deepstack_visual_indexes=[5, 11, 17])),
}
COUNTERS = ("graph_captures_total", "graph_hits_total", "graph_misses_total", "graph_padding_tokens_total",
            "graph_chunked_calls_total")


def log(msg: str) -> None:
    print(f"[bench_vit_server {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------


def build_model(kind: str, path: str, seed: int = 0) -> float:
    """The tiny model's folder at real scale with normal(0, 0.02) bf16 weights drawn on the GPU; billions of params."""
    import torch
    from safetensors.torch import save_file

    from sglang_ext_testkit import tiny_model

    done = os.path.join(path, ".real-scale")
    if os.path.exists(done):
        return float(open(done).read())
    tiny_model.ensure_tiny_model(kind, path, seed=seed, force=True)
    cfg_path = os.path.join(path, "config.json")
    config = json.load(open(cfg_path))
    shapes = REAL_SCALE[kind]
    config.update(shapes.get("top", {}))
    if "text" in shapes:
        config["text_config"].update(shapes["text"])
    config["vision_config"].update(shapes["vision"])
    json.dump(config, open(cfg_path, "w"), indent=2)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tensors, count = {}, 0
    for name, shape in sorted(tiny_model.parameter_shapes(kind, config).items()):
        if name.endswith(".bias"):
            value = torch.zeros(shape, dtype=torch.bfloat16)
        elif len(shape) == 1:
            value = torch.ones(shape, dtype=torch.bfloat16)
        else:
            value = torch.empty(shape, device="cuda").normal_(0.0, 0.02, generator=gen).to(torch.bfloat16).cpu()
        tensors[name] = value.contiguous()
        count += value.numel()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    billions = round(count / 1e9, 3)
    open(done, "w").write(str(billions))
    return billions


# ---------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------


def server_env(name: str, workdir: str, trace: bool = False) -> Dict[str, str]:
    env = dict(os.environ)
    module, graphs, knobs = CONFIGS[name]
    env["SGLANG_VIT_ENABLE_CUDA_GRAPH"] = "1" if graphs else "0"
    for key in [k for k in env if k.startswith(("SGLANG_EXT", "SGX_SERVER_"))]:  # only this config's own
        del env[key]
    env.update(knobs)
    if module.startswith("sglang_ext"):
        env["SGLANG_EXT_ACTIVATION_DIR"] = os.path.join(workdir, f"activation-{name}")
    env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix=f"prom-{name}-", dir=workdir)
    # unpatched with graphs on: its captures counted by scripts/server_trace.py (no /metrics of ours)
    count_captures = graphs and not module.startswith("sglang_ext")
    if trace or count_captures or "SGX_SERVER_VIT_FREE" in knobs:  # server_trace.py, via sglang's plugin loader
        import server_trace

        if trace or count_captures:
            env["SGX_SERVER_TRACE_DIR"] = tempfile.mkdtemp(prefix=f"trace-{name}-", dir=workdir)
        if count_captures and not trace:
            env["SGX_SERVER_TRACE"] = "captures"
        dist = server_trace.write_dist_info(os.path.join(workdir, "trace-dist"))
        env["PYTHONPATH"] = os.pathsep.join([dist, os.path.join(REPO, "scripts")]
                                            + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def start(name: str, backend: str, model: str, workdir: str, args):
    from sglang_ext_testkit.server_process import free_port, start_server

    module = CONFIGS[name][0]
    port = free_port()
    argv = [sys.executable, "-m", module, "--model-path", model, "--port", str(port), "--host", "127.0.0.1",
            "--mm-attention-backend", backend, "--mem-fraction-static", str(args.mem_fraction),
            "--max-total-tokens", str(args.kv_tokens), "--enable-metrics", "--disable-radix-cache",
            "--log-level", "info"] + args.server_arg
    log_path = os.path.join(workdir, f"{backend}-{name}.log")
    env = server_env(name, workdir, args.trace)
    started = time.time()
    server = start_server(argv, env, port, log_path)
    server.trace_dir = env.get("SGX_SERVER_TRACE_DIR") if args.trace else None
    server.capture_dir, server.started = env.get("SGX_SERVER_TRACE_DIR"), started
    return server


def metrics(server) -> Dict[str, float]:
    """sglang-ext's ViT graph counters and the process's reserved memory from /metrics (0 where absent;
    with --trace every server's reserved memory as server_trace last wrote it)."""
    from sglang_ext_testkit import vl_stream as vs

    text = server.get_text("/metrics")
    out = {}
    for name in COUNTERS:
        out[name] = vs.metric_sum(text, "sglang_ext_" + name, cache="vit_cuda_graph") or 0.0
    out["graph_eager_fallbacks_total"] = vs.metric_sum(text, "sglang_ext_graph_eager_fallbacks_total",
                                                       cache="vit_cuda_graph") or 0.0
    out["graph_gate_fallbacks_total"] = vs.metric_sum(text, "sglang_ext_graph_eager_fallbacks_total",
                                                      cache="vit_cuda_graph", reason="gate") or 0.0
    out["graph_resident_bytes"] = vs.metric_sum(text, "sglang_ext_graph_resident_bytes", cache="vit_cuda_graph") or 0.0
    out["cuda_memory_reserved_bytes"] = vs.metric_sum(text, "sglang_ext_cuda_memory_reserved_bytes") or 0.0
    if getattr(server, "capture_dir", None):  # upstream's own captures (an unpatched graphs-on server)
        counted = server_trace.read_totals(server.capture_dir).get(server_trace.CAPTURES, [0.0])[0]
        out["graph_captures_total"] = max(out["graph_captures_total"], counted)
    if getattr(server, "trace_dir", None):  # --trace: every server's from one source, read every 0.25 s
        out["cuda_memory_reserved_bytes"] = server_trace.read_totals(server.trace_dir).get(server_trace.RESERVED,
                                                                                           [0.0])[0]
    return out


# ---------------------------------------------------------------------------
# Load: sglang.bench_serving
# ---------------------------------------------------------------------------


def _serving_module(workdir: str):
    """sglang.benchmark.serving, imported once (it imports `datasets`, which the image dataset never
    uses and the GPU machine lacks: a stub stands in when it is missing)."""
    import importlib.util

    if importlib.util.find_spec("datasets") is None:
        stub = os.path.join(workdir, "stubs")
        os.makedirs(os.path.join(stub, "datasets"), exist_ok=True)
        with open(os.path.join(stub, "datasets", "__init__.py"), "w") as f:
            f.write("def load_dataset(*args, **kwargs):\n    raise RuntimeError('datasets is not installed here')\n")
        sys.path.insert(0, stub)
    import sglang.benchmark.serving as serving

    if not hasattr(serving.get_dataset, "cache"):  # one dataset per (seed, size, images...), shared by the configs
        serving.get_dataset = _one_build_per_key(serving.get_dataset, lambda args: build_in_slices(args, workdir))
    return serving


# A dataset of more requests than this is built in slices of SLICE_REQUESTS by worker processes: one
# thread took 460 s for 2,000 requests of 1-4 images on the GPU machine (session 15).
PARALLEL_FROM = 256
SLICE_REQUESTS = 128  # <= PARALLEL_FROM: a worker builds its slice itself


def slice_args(args) -> list:
    """`args` cut into datasets of at most SLICE_REQUESTS requests, slice k seeded with seed * 1000 + k."""
    n = args.num_prompts
    return [argparse.Namespace(**{**vars(args), "num_prompts": min(SLICE_REQUESTS, n - start),
                                  "seed": args.seed * 1000 + k})
            for k, start in enumerate(range(0, n, SLICE_REQUESTS))]


def _build_slice(job):
    """One slice, in a worker process (its own sglang import and tokenizer)."""
    args, workdir = job
    serving = _serving_module(workdir)
    return serving.get_dataset(args, serving.get_tokenizer(args.tokenizer or args.model),
                               args.served_model_name or args.model)


# One thread per worker process (set before it imports torch or a tokenizer): with their thread pools a
# slice cost 45-70 % more CPU time (measured on 2 cores), which a pool of workers oversubscribes.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
              "RAYON_NUM_THREADS": "1"}


def _one_thread() -> None:
    os.environ.update(ONE_THREAD)


def build_in_slices(args, workdir: str, worker=_build_slice, workers=None) -> list:
    """The dataset `args` names, its slices built in parallel by spawned processes (no fork beside the
    threads that poll the servers) of one thread each, in slice order; `workers` defaults to the usable
    cores but two."""
    jobs = [(a, workdir) for a in slice_args(args)]
    workers = min(len(jobs), workers or max(1, len(os.sched_getaffinity(0)) - 2))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_one_thread) as pool:
        return [row for part in pool.map(worker, jobs) for row in part]


def _one_build_per_key(make, build_large=None):
    """`make` (bench_serving's get_dataset) cached per dataset; a build under way in another thread
    (prebuild_datasets) is waited for, not repeated; one of more than PARALLEL_FROM requests goes to
    `build_large` where given."""
    def get_dataset(args, tokenizer, model_id=None):
        key = (args.dataset_name, args.num_prompts, args.image_count, args.random_image_count, args.seed,
               args.image_resolution, args.random_input_len, args.random_output_len, model_id)
        with get_dataset.lock:
            entry = get_dataset.cache.setdefault(key, {"lock": threading.Lock()})
        with entry["lock"]:
            if "dataset" not in entry:
                large = build_large is not None and args.num_prompts > PARALLEL_FROM
                entry["dataset"] = build_large(args) if large else make(args, tokenizer, model_id)
        return entry["dataset"]

    get_dataset.cache, get_dataset.lock = {}, threading.Lock()
    return get_dataset


def _serving_argv(port: int, model: str, concurrency: int, images: str, requests: int, seed: int, resolution: str,
                  out: str) -> List[str]:
    argv = ["bench_serving", "--backend", "sglang-oai-chat", "--host", "127.0.0.1",
            "--port", str(port), "--model", model, "--tokenizer", model, "--dataset-name", "image",
            "--image-count", images.split("-")[-1], "--image-resolution", resolution, "--image-content", "random",
            "--random-input-len", "32", "--random-output-len", "8", "--num-prompts", str(requests),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--seed", str(seed),
            "--warmup-requests", "1", "--disable-tqdm", "--output-file", out]
    return argv + (["--random-image-count"] if "-" in images else [])


def _parsed_args(serving, argv: List[str]):
    """The namespace `sglang.bench_serving` parses from `argv` (its parser lives inside cli_main)."""
    captured, real, saved = [], serving.run_benchmark, sys.argv
    serving.run_benchmark, sys.argv = captured.append, argv
    try:
        serving.cli_main()
    finally:
        serving.run_benchmark, sys.argv = real, saved
    if not captured:
        raise RuntimeError("sglang.bench_serving's cli_main did not reach run_benchmark")
    return captured[0]


def prebuild_datasets(model: str, plan: List[tuple], workdir: str, resolution: str) -> threading.Thread:
    """Build the image datasets of `plan` ((concurrency, images, requests, seed) each) in a thread (while
    the servers start, unless main joins it first). Call from the main thread and join the thread before
    the first run: a build seeds the process's `random` / `np.random`, which a run reseeds. A failure here
    only leaves the runs to build what is missing."""
    def build():
        started = time.time()
        try:
            tokenizer = serving.get_tokenizer(model)
            for args in namespaces:
                serving.get_dataset(args, tokenizer, args.served_model_name or args.model)
            log(f"datasets: {len(namespaces)} built in {time.time() - started:.0f} s")
        except Exception as exc:  # noqa: BLE001
            log(f"datasets: prebuild stopped: {type(exc).__name__}: {exc}")

    try:
        serving = _serving_module(workdir)
        namespaces = [_parsed_args(serving, _serving_argv(0, model, *item, resolution, os.devnull)) for item in plan]
    except Exception as exc:  # noqa: BLE001
        log(f"datasets: not prebuilt: {type(exc).__name__}: {exc}")
        namespaces = []
    thread = threading.Thread(target=build if namespaces else (lambda: None), name="prebuild-datasets", daemon=True)
    thread.start()
    return thread


def bench_serving(server, model: str, concurrency: int, images: str, requests: int, seed: int, workdir: str,
                  resolution: str) -> dict:
    """One `sglang.bench_serving` run (its own command line, in this process: no import per run)."""
    serving = _serving_module(workdir)
    out = os.path.join(workdir, f"bs-{server.port}-{concurrency}-{images}-{seed}.jsonl")
    argv = _serving_argv(server.port, model, concurrency, images, requests, seed, resolution, out)
    saved = sys.argv
    sys.argv = argv
    try:
        serving.cli_main()
    except SystemExit as exc:  # it exits on an unready server: a failed run, not the end of the benchmark
        raise RuntimeError(f"bench_serving exited with {exc.code}") from None
    finally:
        sys.argv = saved
    with open(out) as f:
        row = json.loads(f.read().strip().splitlines()[-1])
    if not row.get("completed"):
        raise RuntimeError(f"bench_serving completed no request ({out})")
    return dict(req_s=round(row["request_throughput"], 3), ttft_p50_ms=round(row["median_ttft_ms"], 2),
                ttft_p99_ms=round(row["p99_ttft_ms"], 2), completed=row.get("completed"))


# ---------------------------------------------------------------------------
# Accuracy: input-token logprobs of a mixed-size stream
# ---------------------------------------------------------------------------


def signatures(server, specs, concurrency: int) -> List[List[float]]:
    from sglang_ext_testkit import vl_stream as vs

    def one(spec):
        body = vs.generate_body(spec, max_new_tokens=1)
        return vs.generate_signature(server.post("/generate", body, timeout=300))

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, specs))


BATCHED_SAMPLES = 3  # passes of each server at concurrency 16: batch composition varies, so one sample decides nothing


def _error(exc) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


# Left out of the accuracy rows: the reference itself, and vit-free, whose tower answers zeros by design.
NOT_COMPARED = ("graphs-off", "vit-free")


def accuracy(servers: Dict[str, object], backend: str, unit: int, n: int, sizes: str = "random") -> List[dict]:
    """Per request, max |dlogprob| against graphs-off's first pass. At concurrency 16 each server and the
    floor (graphs-off-2 where it runs, else graphs-off again) make BATCHED_SAMPLES passes; a row keeps
    the largest max and, apart, the largest count beyond 0.05 of them (`requests` is per pass)."""
    from sglang_ext_testkit import vl_stream as vs

    specs = (vs.random_size_stream if sizes == "random" else vs.build_stream)(unit, n, seed=7)

    def worst_of(server, reference, concurrency, samples):
        """(max |d|, requests beyond 0.05), each the largest over `samples` passes of `server`."""
        diffs = [[vs.max_abs_diff(a, b) for a, b in zip(signatures(server, specs, concurrency), reference)]
                 for _ in range(samples)]
        return round(max(max(d) for d in diffs), 4), max(sum(x > 0.05 for x in d) for d in diffs)

    rows = []
    floor_server = "graphs-off-2" if "graphs-off-2" in servers else "graphs-off"
    for concurrency in (1, 16):
        samples, batched = (1, False) if concurrency == 1 else (BATCHED_SAMPLES, True)

        def row(config, **more):
            return dict(dict(backend=backend, config=config, concurrency=concurrency, requests=n, samples=samples,
                             max_abs=None, beyond_0_05=None, floor_max_abs=None, floor_beyond_0_05=None,
                             floor_server=floor_server if batched else None, error=None), **more)

        try:
            reference = signatures(servers["graphs-off"], specs, concurrency)
        except Exception as exc:  # noqa: BLE001 - reported in the table; nothing to compare with
            rows.append(row("graphs-off", error=_error(exc)))
            continue
        floor = (None, None)
        if batched:
            try:
                floor = worst_of(servers[floor_server], reference, concurrency, samples)
            except Exception as exc:  # noqa: BLE001 - the others are still compared, without a floor
                rows.append(row(floor_server, error=_error(exc)))
        for name in [n for n in servers if n not in NOT_COMPARED]:  # the run's order; diagnostics too
            if name == floor_server and batched:  # its floor passes are its row
                if floor[0] is not None:
                    rows.append(row(name, max_abs=floor[0], beyond_0_05=floor[1], floor_max_abs=floor[0],
                                    floor_beyond_0_05=floor[1]))
                continue
            entry = row(name, floor_max_abs=floor[0], floor_beyond_0_05=floor[1])
            try:
                entry["max_abs"], entry["beyond_0_05"] = worst_of(servers[name], reference, concurrency, samples)
            except Exception as exc:  # noqa: BLE001 - a crash is a result (0.5.17 graphs on)
                entry["error"] = _error(exc)
            rows.append(entry)
    return rows


def timed_slots(concurrencies: List[int], image_counts: List[str], mixed_at: set, requests: int) -> List[tuple]:
    """(concurrency, image count, requests, seed) of each timed run of a pass: a range like 1-4 runs only at
    the mixed-at concurrencies; concurrency 1 runs a quarter of the requests."""
    return [(c, images, max(requests // 4, 16) if c == 1 else requests, 1000 + c)
            for c in concurrencies for images in image_counts if "-" not in images or c in mixed_at]


def warm_up_slot(passes: int, concurrencies: List[int], image_counts: List[str]):
    """(concurrency, images, requests, seed) of the untimed warm-up: the run's largest ViT calls, made once
    before reserved memory is judged, in a varied stream (another seed); None for a run without timed
    passes (accuracy only: no memory claim, and about a minute less per server)."""
    if not passes:
        return None
    top = max(concurrencies)
    return top, image_counts[-1], max(64, 2 * top), 999


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(REAL_SCALE), default="qwen2_5_vl")
    ap.add_argument("--model-dir", default=None, help="where the real-scale checkpoint is (written if absent)")
    ap.add_argument("--backends", default="fa3,triton_attn")
    ap.add_argument("--configs", default=",".join(n for n in CONFIGS if n != "graphs-off-2"),
                    help="default: all but graphs-off-2 (asked for with --accuracy: the floor at concurrency 16)")
    ap.add_argument("--concurrencies", default="1,8,32,64")
    ap.add_argument("--image-counts", default="1,1-4", help="per request: N, or 1-N (random)")
    ap.add_argument("--requests", type=int, default=128, help="per pass (concurrency 1: a quarter)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--resolution", default="random:224x224-896x896")
    ap.add_argument("--accuracy", type=int, default=0, help="requests of the logprob comparison (0: none)")
    ap.add_argument("--accuracy-sizes", choices=("random", "layouts"), default="random",
                    help="random: 1-2 images of random sides (224-896 px), like the timed passes; layouts: the "
                    "tiny-server tests' 13 layouts (9 patch counts, all multiples of 64)")
    ap.add_argument("--mem-fraction", type=float, default=0.85,
                    help="each server's --mem-fraction-static, high because --kv-tokens caps the pool: sglang's "
                    "budget is what is free when the server profiles minus (1 - this) x what was free before it "
                    "loaded, and each server loads after the one before it is up")
    ap.add_argument("--kv-tokens", type=int, default=98304,
                    help="every server's KV pool (--max-total-tokens). sglang sizes a pool from the memory free "
                    "when the server profiles it, so servers started beside each other got unequal pools (and "
                    "unequal batching at high concurrency) before this cap; the servers table shows each pool")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "bench", "vit_server.json"))
    ap.add_argument("--server-arg", action="append", default=[], help="extra launch_server argument (repeatable)")
    ap.add_argument("--mixed-at", default="8", help="concurrencies that also run the 1-N image count")
    ap.add_argument("--trace", action="store_true", help="per pass: where each server's scheduler spent its time "
                    "(scripts/server_trace.py); during the warm-up, every device sync inside a forward by call site")
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    if not configs or set(configs) - set(CONFIGS):
        ap.error(f"--configs: {args.configs!r}; allowed: names from {', '.join(CONFIGS)}")
    concurrencies = [int(c) for c in args.concurrencies.split(",")]
    image_counts = args.image_counts.split(",")
    slots = timed_slots(concurrencies, image_counts, {int(c) for c in args.mixed_at.split(",") if c}, args.requests)
    if args.passes and not slots:
        ap.error(f"--image-counts {args.image_counts}: nothing runs; a range like 1-4 runs only at the --mixed-at "
                 f"concurrencies ({args.mixed_at}), none of which is in --concurrencies ({args.concurrencies})")
    import signal

    # A time limit still stops the servers (finally); give `timeout -k` at least 30 s for that.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.time()
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-vit-server-")
    os.makedirs(workdir, exist_ok=True)
    model = args.model_dir or os.path.join(workdir, f"{args.model}-real")
    import torch

    params = build_model(args.model, model)
    log(f"model {model}: {params} B parameters")
    report = {"run_id": bench_results.RUN_ID, "kernels": None, "attention": args.backends,
              "config": dict(device=torch.cuda.get_device_name(0), model=f"{args.model} real-scale random",
                             parameters_b=params, requests=args.requests, passes=args.passes,
                             concurrencies=concurrencies, image_counts=image_counts, resolution=args.resolution,
                             command="python scripts/bench_vit_server.py " + " ".join(argv or sys.argv[1:]),
                             seconds=None, sglang=None,
                             accuracy_sizes=args.accuracy_sizes if args.accuracy else None,
                             stand_ins=bench_results.stand_ins()),
              "servers": [], "passes": [], "accuracy": []}
    import importlib.metadata as md

    try:
        report["config"]["sglang"] = md.version("sglang")
    except md.PackageNotFoundError:
        import sglang

        report["config"]["sglang"] = getattr(sglang, "__version__", None)
    report["kernels"] = {n: _package_version(n) for n in bench_results.KERNELS_SCHEMA}

    warm_up = warm_up_slot(args.passes, concurrencies, image_counts)
    plan = [warm_up] + slots if warm_up else []
    prebuild = prebuild_datasets(model, plan, workdir, args.resolution)
    if any(n > PARALLEL_FROM for _, _, n, _ in plan):
        prebuild.join()  # its worker processes would load the host while a server probes

    def save():
        report["config"]["seconds"] = round(time.time() - t0)
        bench_results.write(args.out, report, bench_results.VIT_SERVER_SCHEMA)

    for backend in args.backends.split(","):
        servers, records = {}, {}
        try:  # every server started is stopped (finally), a failure or a time limit in start-up too
            # Every server starts alone: sglang-ext's load-time probe times graph against eager (host-bound),
            # and two ext servers loading together ended their ladders at 5184 and 8256 tokens (run
            # 20261203T132116Z-1635).
            healthy_at, failed = {}, {}
            for name in configs:
                servers[name] = start(name, backend, model, workdir, args)
                try:
                    servers[name].wait_healthy(timeout=900)
                    healthy_at[name] = time.time()
                except Exception as exc:  # noqa: BLE001 - reported below; stopped so the next loads alone
                    failed[name] = exc
                    servers[name].stop()
            for name, server in servers.items():
                rec = dict(backend=backend, config=name, startup_s=None, error=None, metrics_start=None,
                           metrics_end=None, vit_calls=None, captures_after_start=None)
                try:
                    if name in failed:
                        raise failed[name]
                    server.wait_healthy(timeout=30)  # still up after the others loaded
                    rec["startup_s"] = round(healthy_at[name] - server.started, 1)
                    rec["metrics_start"] = metrics(server)
                except Exception as exc:  # noqa: BLE001 - reported
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[-400:]}"
                try:  # a diagnostic: its failure leaves the server in the run (the column then says "-")
                    rec["kv_tokens"] = json.loads(server.get_text("/server_info")).get("max_total_num_tokens")
                except Exception as exc:  # noqa: BLE001
                    log(f"{backend} {name}: /server_info: {type(exc).__name__}: {exc}")
                records[name] = rec
                log(f"{backend} {name}: " + (rec["error"] or f"healthy after {rec['startup_s']} s, KV pool "
                                             f"{rec.get('kv_tokens')} tokens (asked {args.kv_tokens})"))
            live = {n: s for n, s in servers.items() if not records[n]["error"]}
            prebuild.join()  # no build beside a run (they share the random generators and the interpreter)
            for name, server in (live.items() if warm_up else ()):  # warm-up
                flag = os.path.join(server.trace_dir, server_trace.SYNCS_FLAG) if server.trace_dir else None
                if flag:  # where the forward syncs: counted in the warm-up only (the debug mode costs time)
                    open(flag, "w").close()
                try:
                    bench_serving(server, model, *warm_up, workdir, args.resolution)
                except Exception as exc:  # noqa: BLE001
                    records[name]["error"] = f"warm-up: {exc}"[:400]
                if flag:
                    os.remove(flag)
                if server.trace_dir:
                    time.sleep(0.6)  # the trace files are rewritten every 0.25 s
                try:  # reserved memory from here on must stay flat
                    records[name]["metrics_warm"] = metrics(server)
                except Exception:  # noqa: BLE001 - the growth column then says "-"
                    pass
                if flag:
                    records[name]["warmup_syncs"] = {k[5:]: v[1] for k, v in
                                                     server_trace.read_totals(server.trace_dir).items()
                                                     if k.startswith("sync@")}
            for p in range(args.passes):
                for c, images, n, seed in slots:
                    # interleaved: every config in every slot, the order reversed every other pass
                    for name, server in (list(live.items()) if p % 2 == 0 else list(live.items())[::-1]):
                        row = dict(backend=backend, config=name, concurrency=c, images=images,
                                   error=None, req_s=None, ttft_p50_ms=None, ttft_p99_ms=None, completed=None)
                        row["pass"] = p
                        before = server_trace.read_totals(server.trace_dir) if server.trace_dir else None
                        try:
                            row.update(bench_serving(server, model, c, images, n, seed, workdir,
                                                     args.resolution))
                        except Exception as exc:  # noqa: BLE001 - reported
                            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                        if before is not None:
                            time.sleep(0.6)  # the trace files are rewritten every 0.25 s
                            row["trace"] = server_trace.difference(server_trace.read_totals(server.trace_dir),
                                                                   before)
                        report["passes"].append(row)
                        log(f"{backend} pass {p} c={c} img={images} {name}: {row['req_s']} req/s "
                            f"{row['error'] or ''}")
                collect_metrics(live, records, after_pass=True)
                report["servers"] = [r for r in report["servers"] if r["backend"] != backend] + list(records.values())
                save()
            for record in records.values():  # memory growth is judged over the timed passes only
                record["metrics_after_passes"] = record.get("metrics_end")
            if args.accuracy and "graphs-off" in live:
                unit = 28 if args.model == "qwen2_5_vl" else 32
                report["accuracy"] += accuracy(live, backend, unit, args.accuracy, args.accuracy_sizes)
            collect_metrics(live, records)
        finally:
            for server in servers.values():
                server.stop()
            report["servers"] = [r for r in report["servers"] if r["backend"] != backend] + list(records.values())
            save()
    print(bench_results.vit_server_table(report))
    return 0


def collect_metrics(live: dict, records: dict, after_pass: bool = False) -> None:
    """Counters now (after every pass, so a run cut short keeps them); after_pass: the reserved memory
    is also added to the server's per-pass series (a step after a larger call, or steady growth; None
    where there was no reading)."""
    for name, server in live.items():
        if after_pass:
            records[name].setdefault("reserved_mib_after_pass", []).append(None)
        try:
            end = records[name]["metrics_end"] = metrics(server)
            if after_pass and end["cuda_memory_reserved_bytes"]:
                records[name]["reserved_mib_after_pass"][-1] = round(end["cuda_memory_reserved_bytes"] / 2**20)
            start_m = records[name]["metrics_start"]
            # every ViT call (each chunk of a split call) replays or falls back to eager
            records[name]["vit_calls"] = end["graph_hits_total"] + end["graph_eager_fallbacks_total"]
            records[name]["captures_after_start"] = end["graph_captures_total"] - start_m["graph_captures_total"]
        except Exception as exc:  # noqa: BLE001 - a server that died keeps its last counters
            records[name]["error"] = f"metrics: {exc}"[:400]


def _package_version(name: str) -> str:
    try:
        module = __import__(name)
    except Exception:  # noqa: BLE001
        return "not loaded"
    return str(getattr(module, "__version__", "version unknown"))


if __name__ == "__main__":
    sys.exit(main())
