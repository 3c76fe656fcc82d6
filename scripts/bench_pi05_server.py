#!/usr/bin/env python3
"""Pi0.5 as a robot sees it: per-request latency through the real server, and where it goes.

Starts each server itself (one process each, one after another, one run id), on the random-weight
Pi0.5 checkpoint at the real size of the server tests (sglang_ext_testkit.pi05_checkpoint: cameras
base_0_rgb, left_wrist_0_rgb), and drives it like a robot: one request at a time, the next when
the answer is back, after --warmup requests.

Motions (--motion), one row each (sglang_ext_testkit.pi05_clients.robot_stream): every request is a new
control step, never a repeat.
  random   a new state drawn in [-1, 1]^8 every step (the prompt, which carries the discretized
           state, changes length from step to step)
  smooth   every joint on its own slow sine
  fixed    one state, one task, both cameras: a single prompt length (one row, not the headline)
Moving robots switch task every --task-every steps and with it the cameras they send (both, or one).
With the upstream server in the run, the first camera is always sent: unpatched 0.5.17 ends in a CUDA
device-side assert (an out-of-bounds rotary gather in the prefix) on an observation without it.
Per row: p50/p90/p99/max, graphs captured after the server reported healthy and requests that ran
eager since the load-time capture (both read from the server's log), and the worst difference from
the exact server's answer to the same observation, over every answer.

Servers (--servers):
  upstream              unpatched `sglang serve` of the sglang on PYTHONPATH (the report's `sglang`;
                        `0517` in runs written before the rename)
  ext-no-transport      `python -m sglang_ext.serve` (exact path) with the transport patches off
                        (mg_scheduler_client_reuse, pi05_action_transport, pi05_observation_device,
                        mg_worker_request_overhead): sglang's request path, against ext-exact
  ext-exact             sglang-ext, exact path, transport patches on
  ext-fast              ext-exact plus --ext-pi05-fast
Wires (--wires), each with this script's own client (sglang_ext_testkit.pi05_clients):
  openpi   the OpenPI websocket /openpi/policy, msgpack with numpy arrays (2 uint8 cameras 224x224,
           state 8, noise 50x32), actions back as a numpy array
  json     POST /v1/actions/generations, cameras as base64 PNG (encoded once per observation, not
           timed: `client_png_encode_ms` says what it costs), state and noise as JSON lists
  sglang   sglang's own benchmarks/bench_pi05_openpi.py --sglang-api openpi_ws (its observations,
           server-sampled noise); its p50/p90 only. Its LIBERO profile names the cameras `image`,
           `image2`; sglang 0.5.17's HTTP process matches `observation.images.<key>` against the
           default image_keys (the checkpoint's config is applied in the worker only), so those frames
           are dropped and the prefix is masked: the latency of that workload, not of the others.
           Not in the default --wires: on the H200 (random-weight checkpoint, torch_sdpa) its first
           request ends every server, unpatched 0.5.17 included, in a CUDA device-side assert (an
           out-of-bounds gather in the prefix), and the server is unusable after it
Latency = from the payload (dict) ready to the actions as a numpy array: the client's encode and
decode included. Per request the breakdown splits it into client encode/decode, the pipeline stages
(sglang's timings) and the rest (outside the pipeline); p50 of each is reported. The server's hops are
not measured (`-` in the breakdown table; older runs' files carry them).
Accuracy: every server sees the same observations and noise; each answer is compared with the
ext-exact server's answer to the same observation (max|a - ref| / max|ref|).

On the GPU machine (docs/gpu-harness.md), about 2 min per server after the checkpoint exists:
  source scripts/gpu_env.sh && python3 scripts/bench_pi05_server.py --out $OUT/server_pi05.json
then copy the file into docs/bench/ and run scripts/gen_performance_doc.py.
--cpu-logic-check runs the whole script here on sglang's server with a stand-in policy
(sglang_ext_testkit.fake_pi05_server; numbers meaningless).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import bench_results  # noqa: E402
from sglang_ext_testkit import pi05_checkpoint  # noqa: E402
from sglang_ext_testkit import pi05_clients as clients  # noqa: E402

SERVERS = ("upstream", "ext-no-transport", "ext-exact", "ext-fast")
WIRES = ("openpi", "json", "sglang")
TRANSPORT_PATCHES = ",".join(("mg_scheduler_client_reuse", "pi05_action_transport", "pi05_observation_device",
                              "mg_worker_request_overhead"))
REFERENCE_SERVER = "ext-exact"
SGLANG_UNPATCHED = "import sys; from sglang.cli.main import main; sys.argv = ['sglang', 'serve', *sys.argv[1:]]; main()"


def log(message: str) -> None:
    print(message, flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated subset of {', '.join(SERVERS)}")
    ap.add_argument("--wires", default="openpi,json", help=f"comma-separated subset of {', '.join(WIRES)}")
    ap.add_argument("--motion", default=",".join(clients.MOTIONS),
                    help=f"comma-separated subset of {', '.join(clients.MOTIONS)}")
    ap.add_argument("--task-every", type=int, default=50, help="a moving robot's steps per task")
    ap.add_argument("--requests", type=int, default=300, help="timed requests (control steps) per server, wire, motion")
    ap.add_argument("--warmup", type=int, default=8, help="untimed control steps first")
    ap.add_argument("--steps", type=int, default=10, help="denoise steps")
    ap.add_argument("--checkpoint", default=pi05_checkpoint.CHECKPOINT_DIR,
                    help="random-weight checkpoint folder (written if missing, reused while the machine is held)")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--log-dir", default=os.environ.get("SGX_TEST_LOG_DIR", ""),
                    help="server logs (default: a tmp dir)")
    ap.add_argument("--out", default="", help="write the results as JSON here (after every server)")
    ap.add_argument("--cpu-logic-check", action="store_true",
                    help="run on the CPU against sglang's server with a stand-in policy (checks the script)")
    return ap


def _choices(text: str, allowed, what: str) -> List[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise SystemExit(f"--{what}: {', '.join(bad) or 'empty'} not allowed; allowed: {', '.join(allowed)}")
    return names


def clean_env(**extra) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k != "SGLANG_EXT" and not k.startswith("SGLANG_EXT_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1", **extra)
    # The servers import this checkout's package and testkit (the stand-in policy, --cpu-logic-check).
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "python"), os.path.join(REPO, "test")]
                                        + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def prepare_model(args, workdir: str) -> str:
    """The folder the servers load: the checkpoint (written if missing); assets only for the stand-in."""
    from sglang_ext_testkit import pi05_checkpoint

    if args.cpu_logic_check:
        return str(pi05_checkpoint.write_pi05_assets(os.path.join(workdir, "random-pi05")))
    if not os.path.exists(os.path.join(args.checkpoint, "COMPLETE")):
        log(f"[bench] writing the random checkpoint {args.checkpoint}")
        done = subprocess.run([sys.executable, "-m", "sglang_ext_testkit.pi05_checkpoint", args.checkpoint],
                              env=clean_env(), timeout=1200)
        if done.returncode != 0:
            raise SystemExit(f"checkpoint synthesis failed (exit {done.returncode})")
    return args.checkpoint


def server_command(name: str, args) -> tuple:
    """(argv, extra env) of one server."""
    py = sys.executable
    if args.cpu_logic_check:  # the launchers need a GPU: sglang's server with the stand-in policy
        base = [py, "-m", "sglang_ext_testkit.fake_pi05_server"]
        return {
            "upstream": (base, {"SGLANG_EXT": "0"}),
            "ext-no-transport": (base + ["--ext"], {"SGLANG_EXT_DISABLE": TRANSPORT_PATCHES}),
            "ext-exact": (base + ["--ext"], {}),
            "ext-fast": (base + ["--ext"], {"SGLANG_EXT_PI05_FAST": "1"}),
        }[name]
    ext = [py, "-m", "sglang_ext.serve", "--ext-strict"]
    env = {}
    from sglang_ext.versions import installed_sglang_version, source_tree_version

    if installed_sglang_version() is None:  # unpacked source tree on the GPU machine
        import sglang

        version = source_tree_version(os.path.dirname(os.path.dirname(sglang.__file__)))
        if version:
            env["SGLANG_EXT_ASSUME_SGLANG"] = version
    return {
        "upstream": ([py, "-c", SGLANG_UNPATCHED], {"SGLANG_EXT": "0"}),
        "ext-no-transport": (ext + ["--ext-disable", TRANSPORT_PATCHES], env),
        "ext-exact": (ext, env),
        "ext-fast": (ext + ["--ext-pi05-fast"], env),
    }[name]


def summarize(server: str, wire: str, records: List[clients.Record], reference) -> Dict[str, Any]:
    """One row; `reference`: the exact server's actions for the same observations, in order (or None)."""
    totals = [r.total_ms for r in records]
    parts = [clients.breakdown(r) for r in records]
    keys = [k for k in parts[0] if all(k in p for p in parts)]
    breakdown = {k: round(statistics.median(p[k] for p in parts), 3) for k in keys if k != "total"}
    p50 = clients.percentile(totals, 50)
    row = {"server": server, "wire": wire, "client": "own", "requests": len(records),
           "p50_ms": p50, "p90_ms": clients.percentile(totals, 90), "p99_ms": clients.percentile(totals, 99),
           "mean_ms": statistics.fmean(totals), "max_ms": max(totals),
           "p99_over_p50": clients.percentile(totals, 99) / p50 if p50 > 0 else None,
           "stage_sum_p50_ms": breakdown.get("pipeline"), "outside_pipeline_p50_ms": breakdown.get("outside_pipeline"),
           "breakdown_p50_ms": breakdown}
    if reference:
        worst = 0.0
        for r, ref in zip(records, reference):
            worst = max(worst, float(abs(r.actions - ref).max()) / max(float(abs(ref).max()), 1e-6))
        row["max_rel_diff_vs_exact"], row["checked_requests"] = worst, min(len(records), len(reference))
    return row


def drive(client_infer, payloads, args) -> List[clients.Record]:
    """The first --warmup payloads untimed, then the rest timed, one at a time (a closed loop)."""
    for payload in payloads[:args.warmup]:
        client_infer(payload)
    records = []
    for i, payload in enumerate(payloads[args.warmup:]):
        record = client_infer(payload)
        if record.actions.shape != (50, 7) or not bool(abs(record.actions).max() < float("inf")):
            raise RuntimeError(f"request {i}: actions of shape {record.actions.shape}, finite "
                               f"{bool(abs(record.actions).max() < float('inf'))}")
        records.append(record)
    return records


def run_sglang_bench(url: str, args, workdir: str) -> Dict[str, Any]:
    out = os.path.join(workdir, f"sglang-bench-{time.time_ns()}.json")
    argv = [sys.executable, "-m", "sglang.multimodal_gen.benchmarks.bench_pi05_openpi", "--skip-openpi",
            "--sglang-api", "openpi_ws", "--sglang-url", url, "--batch-size", "1", "--num-samples", "16",
            "--repeats", str(args.requests), "--warmup", str(args.warmup), "--disable-prefix-cache",
            "--num-inference-steps", str(args.steps), "--output-file", out]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"bench_pi05_openpi.py exit {done.returncode}: {done.stderr[-1500:]}")
    with open(out, encoding="utf-8") as f:
        single = json.load(f)["sglang"]["single"]
    return {"client": "sglang bench_pi05_openpi.py (openpi_ws)", "requests": int(single["count"]),
            "p50_ms": single["p50_ms"], "p90_ms": single["p90_ms"], "mean_ms": single["mean_ms"],
            "max_ms": single["max_ms"],
            "note": "sglang's observations, server-sampled noise; no p99, no breakdown"}


def run_server(name: str, args, model_dir: str, workdir: str, streams, reference_actions, report) -> None:
    from sglang_ext_testkit.server_process import free_port, start_server

    argv, extra = server_command(name, args)
    port = free_port()
    log_path = os.path.join(args.log_dir or workdir, f"server-{name}.log")
    full = [*argv, "--model-path", model_dir, "--pipeline-config-path", os.path.join(model_dir, "pipeline_config.json"),
            "--host", "127.0.0.1", "--port", str(port), "--num-gpus", "1", "--warmup-mode", "off",
            *report["_attention_args"]]
    entry = report["servers"][name] = {"argv": " ".join(full[1:]), "env": extra, "log": log_path}
    server = start_server(full, clean_env(**extra), port, log_path)
    try:
        entry["start_s"] = round(server.wait_healthy(args.start_timeout), 1)
        log(f"[bench] {name}: healthy after {entry['start_s']} s")
        at_start = clients.graph_log_counts(log_path)
        wires = _choices(args.wires, WIRES, "wires")
        for wire in wires:
            for motion, observations in streams.items() if wire != "sglang" else [("sglang's", None)]:
                row = run_wire(name, wire, motion, observations, server, port, args, workdir, reference_actions,
                               report)
                now = clients.graph_log_counts(log_path)
                row["captures_after_start"] = now["captures"] - at_start["captures"]
                row["eager_after_load"] = sum(v for k, v in now.items() if k.startswith("eager_after_load"))
                report["results"].append(row)
                log(f"[bench] {name} {wire} {motion}: p50 {row.get('p50_ms')} ms, p99 {row.get('p99_ms')} ms, "
                    f"captures after start {row['captures_after_start']}")
    except Exception as exc:  # noqa: BLE001 - a server that does not start is recorded, the next one runs
        entry["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        log(f"[bench] {name}: {entry['error']}")
    finally:
        server.stop()


def run_wire(name, wire, motion, observations, server, port, args, workdir, reference_actions, report):
    """One (wire, motion) loop against a running server: its row."""
    row = {"server": name, "wire": wire, "motion": motion}
    try:
        if wire == "openpi":
            client = clients.OpenPIClient(server.url)
            try:
                records = drive(client.infer, [clients.openpi_payload(o, steps=args.steps) for o in observations],
                                args)
            finally:
                client.close()
        elif wire == "json":
            client = clients.JsonActionClient("127.0.0.1", port)
            try:
                pngs = report["_pngs"][motion]
                payloads = [clients.json_body(o, steps=args.steps, pngs=p) for o, p in zip(observations, pngs)]
                records = drive(client.infer, payloads, args)
            finally:
                client.close()
        else:
            row.update(run_sglang_bench(server.url, args, workdir))
            return row
        if name == REFERENCE_SERVER and wire == "openpi":
            reference_actions[motion] = [r.actions for r in records]
        row.update(summarize(name, wire, records, reference_actions.get(motion)))
    except Exception as exc:  # noqa: BLE001 - one failing loop becomes a row, the rest still runs
        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        log(f"[bench] {name} {wire} {motion}: {row['error']}\n{server.log_tail(3000)}")
    return row


def main() -> int:
    args = build_parser().parse_args()
    servers = _choices(args.servers, SERVERS, "servers")
    _choices(args.wires, WIRES, "wires")
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_logic_check:
        raise SystemExit("bench_pi05_server needs a CUDA device (or --cpu-logic-check)")
    needs_ws = {"sglang", "openpi"} & set(_choices(args.wires, WIRES, "wires"))
    if needs_ws and importlib.util.find_spec("websockets") is None:
        raise SystemExit("--wires openpi / sglang need the `websockets` package (requirements/gpu-carry.txt)")
    import sglang

    workdir = tempfile.mkdtemp(prefix="bench-pi05-server-")
    model_dir = prepare_model(args, workdir)
    from sglang_ext_testkit.pi05_checkpoint import CAMERAS

    from sglang_ext_testkit.pi05_checkpoint import serve_attention_args

    attention_args = [] if args.cpu_logic_check else serve_attention_args()
    motions = _choices(args.motion, clients.MOTIONS, "motion")
    # every server sees the same stream: one the unpatched server survives (it needs the first camera)
    streams = {m: clients.robot_stream(args.warmup + args.requests, CAMERAS, motion=m, seed=i, task_every=args.task_every,
                                       keep_first_camera="upstream" in servers)
               for i, m in enumerate(motions)}
    started = time.perf_counter()
    pngs = {m: [{name: clients.png_b64(image) for name, image in o.images.items()} for o in stream]
            for m, stream in streams.items()}
    frames = sum(len(o.images) for stream in streams.values() for o in stream)
    report: Dict[str, Any] = {
        "run_id": bench_results.RUN_ID, "device": torch.cuda.get_device_name() if cuda else "cpu (logic check)",
        "torch": torch.__version__, "sglang": getattr(sglang, "__version__", "?"), "kernels": bench_results.kernels(),
        "stand_ins": bench_results.stand_ins(),
        "attention": " ".join(attention_args[1:]) or "server default (FA3)", "command": " ".join(["python3", *sys.argv]),
        "client_png_encode_ms": (time.perf_counter() - started) * 1e3 / frames,
        "settings": {k: v for k, v in vars(args).items() if k != "out"}, "servers": {}, "results": [],
        "_pngs": pngs, "_attention_args": attention_args}
    # the reference server runs first so every other answer can be compared with it
    order = sorted(servers, key=lambda s: s != REFERENCE_SERVER)
    reference_actions: Dict[str, Any] = {}  # motion -> the exact server's answers, in order
    for name in order:
        run_server(name, args, model_dir, workdir, streams, reference_actions, report)
        if args.out:
            bench_results.write(args.out, {k: v for k, v in report.items() if not k.startswith("_")},
                                bench_results.PI05_SERVER_SCHEMA, default=str)
    report["results"].sort(key=lambda r: (SERVERS.index(r["server"]), WIRES.index(r["wire"]),
                                          clients.MOTIONS.index(r["motion"]) if r.get("motion") in clients.MOTIONS else -1))
    if args.out:
        bench_results.write(args.out, {k: v for k, v in report.items() if not k.startswith("_")},
                            bench_results.PI05_SERVER_SCHEMA, default=str)
    bench_results.print_pi05_server_table(report["results"])
    for label, value, op, bound in bench_results.pi05_server_targets(report["results"]):
        met = value is not None and value <= bound
        value = bench_results.format_or_dash(value, "{:.3g}")
        print(f"target: {label} {value} {op} {bound:.3g}: {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
