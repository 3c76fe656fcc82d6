#!/usr/bin/env bash
# The GPU runs behind docs/gpu-notes.md, as named steps, on the GPU machine after
# `source scripts/gpu_env.sh` (docs/gpu-harness.md). Steps given together run CONCURRENTLY on the
# one GPU (tiny servers and unit tests fit beside each other); each step's log goes to $OUT/STEP.log as
# it is written and its test artefacts to one tarball under $OUT, so a call brings back few files.
#   bash scripts/gpu_steps.sh STEP [STEP ...]
# Steps:
#   server-q25 / server-q3   real-server ViT tests (tiny Qwen2.5-VL / Qwen3-VL), SGX_BACKENDS selects backends
#   pi05-server              Pi0.5 through sglang_ext.serve and unpatched sglang serve
#   pi05-fast                the pi05_fast path (Triton kernels, 32 requests vs the exact path), real-size model
#   unit                     the module-level GPU tests (graph core, ViT, Pi0.5, prefill CP) on real kernels
#   sanitizer                graph-core, ViT and Pi0.5 GPU tests under compute-sanitizer memcheck
#   bench-vit                scripts/bench_vit.py (BENCH_VIT_ARGS)
#   bench-vit-server         scripts/bench_vit_server.py (BENCH_VIT_SERVER_ARGS; the real-scale checkpoint is
#                            kept in /tmp/sgx/models while the machine is held); the servers' ViT graph lines
#                            and errors in server_log_excerpts.txt
#   pi05-loop                robot closed loop over /openpi/policy (200 steps, fast path vs exact server) and the
#                            observation-on-device GPU test; needs `websockets` (requirements/gpu-carry.txt)
#   bench-pi05-server        scripts/bench_pi05_server.py: upstream, ext-no-transport, ext-exact, ext-fast servers one
#                            after another (BENCH_PI05_SERVER_ARGS), JSON in the step's tarball (server_pi05.json)
#   bench-pi05               scripts/bench_pi05.py: 0.5.17, 0.5.19, then sglang-ext (all modes), one
#                            process each, one after another, one run id; then docs/performance.md's
#                            Pi0.5 section rendered from them ($OUT/performance.md). 4.5-6 min on an H200.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT is the folder that comes back}"
export PYTHONUNBUFFERED=1
LIMIT="${SGX_STEP_TIMEOUT:-540}"
work=/tmp/sgx-steps
mkdir -p "$work"

# bench-pi05. 0.5.17 saves its eager actions; 0.5.19 and sglang-ext compare every mode with them
# (same inputs and weights, checked). Each process has its own time limit and writes its JSON after
# every mode, so a failure or a kill costs only the rest of that process. BENCH_PI05_ARGS is added
# to every process (e.g. "--attention fa"); PI05_REQUESTS >= 32 for the accuracy claims.
bench_pi05_all() {
  export SGX_BENCH_RUN_ID="${SGX_BENCH_RUN_ID:-$(date -u +%Y%m%dT%H%M%SZ)-bench-pi05}"
  local common="--requests ${PI05_REQUESTS:-32} --warmup ${PI05_WARMUP:-2} --profile-requests ${PI05_PROFILE:-2} ${BENCH_PI05_ARGS:-}"
  local ref="$OUT/pi05_0517_eager_actions.pt" rc
  rm -f "$ref"
  echo "[bench-pi05] run id $SGX_BENCH_RUN_ID: 0517"
  timeout -k 10 "${PI05_LIMIT_0517:-140}" python3 scripts/bench_pi05.py --impl 0517 $common \
    --save-actions "$ref" --out "$OUT/pi05_0517.json"
  echo "[bench-pi05] 0517 rc=$?"
  # 0.5.19 in a subshell: its environment must not leak into the sglang-ext process
  ( SGX_SGLANG=0519 source scripts/gpu_env.sh || { echo "[bench-pi05] 0519: gpu_env.sh failed (see its sgx: line)"; exit 3; }
    timeout -k 10 "${PI05_LIMIT_0519:-120}" python3 scripts/bench_pi05.py --impl 0519 \
      --modes "${PI05_0519_MODES:-graph}" $common --compare-actions "$ref" --out "$OUT/pi05_0519.json" )
  echo "[bench-pi05] 0519 rc=$?"
  timeout -k 10 "${PI05_LIMIT_EXT:-380}" python3 scripts/bench_pi05.py --impl 0517-ext \
    --modes "${PI05_EXT_MODES:-eager,graph,graph-fast,graph-fused,graph-bucket,graph-fast-nopdl,graph-fast-exact-vision}" $common \
    --compare-actions "$ref" --out "$OUT/pi05_0517-ext.json"
  echo "[bench-pi05] 0517-ext rc=$?"
  python3 scripts/gen_performance_doc.py --bench-dir "$OUT" --doc "$OUT/performance.md"; rc=$?
  [ "$rc" = 0 ] && sed -n '/^Kernels:/,/^Commands/p' "$OUT/performance.md" | sed 's/^/[pi05] /'
  echo "[bench-pi05] summary rc=$rc; copy $OUT/pi05_*.json into docs/bench/ and run scripts/gen_performance_doc.py"
}
export -f bench_pi05_all

step_cmd() {
  case "$1" in
    server-q25) echo "python3 -m pytest -s -v -p no:cacheprovider test/registered/server/test_qwen2_5_vl_server_cuda.py" ;;
    server-q3) echo "python3 -m pytest -s -v -p no:cacheprovider test/registered/server/test_qwen3_vl_server_cuda.py" ;;
    pi05-server) echo "python3 -m pytest -x -q -s -p no:cacheprovider test/registered/pi05/test_pi05_server_cuda.py" ;;
    pi05-fast) echo "python3 -m pytest -q -s -rA -p no:cacheprovider test/registered/pi05/test_pi05_fast_cuda.py" ;;
    unit) echo "python3 -m pytest -q -rA -p no:cacheprovider test/registered/graphs/test_graph_core_cuda.py \
test/registered/vit/test_vit_cuda_graph_cuda.py test/registered/pi05/test_pi05_graphs_cuda.py \
test/registered/pi05/test_pi05_fused_norms_cuda.py test/registered/cp/test_prefill_cp_graph_1gpu.py \
test/registered/cp/test_prefill_bcg_break_inputs_cuda.py test/registered/vit/test_mm_embedding_sync_free_cuda.py" ;;
    # Default subset: fits ~5 min under memcheck. Left out: the failed-capture tests (they raise CUDA
    # API errors 900/901 on purpose, which memcheck counts) and two memory-accounting tests whose
    # numbers memcheck's own allocations change (all pass in `unit`).
    sanitizer) echo "compute-sanitizer --tool memcheck --error-exitcode 7 --print-limit 20 python3 -m pytest -q -rA \
-p no:cacheprovider ${SANITIZER_TESTS:-test/registered/graphs/test_graph_core_cuda.py \
test/registered/vit/test_vit_cuda_graph_cuda.py test/registered/pi05/test_pi05_graphs_cuda.py -k \
'(test_graph_core_cuda or replays_current or rotary_buffer or capacity_overflow or evicting_gemm \
or (graph_mode_matches_eager and full and 17) or consecutive_requests) and not failed_capture \
and not return_pool_memory and not workspace_growth'}" ;;
    pi05-loop) echo "python3 -m pytest -x -q -s -rA -p no:cacheprovider test/registered/pi05/test_pi05_observation_device_cuda.py \
test/registered/pi05/test_pi05_robot_loop_cuda.py" ;;
    bench-pi05-server) echo "python3 scripts/bench_pi05_server.py ${BENCH_PI05_SERVER_ARGS:-} --log-dir \$OUT --out \$OUT/server_pi05.json" ;;
    bench-vit) echo "python3 scripts/bench_vit.py ${BENCH_VIT_ARGS:-} --out $OUT/vit.json" ;;
    bench-vit-server) echo "python3 scripts/bench_vit_server.py ${BENCH_VIT_SERVER_ARGS:-} --workdir /tmp/sgx/vit-server \
--model-dir /tmp/sgx/models/${VIT_SERVER_MODEL:-qwen2_5_vl}-real --model ${VIT_SERVER_MODEL:-qwen2_5_vl} \
--out $OUT/vit_server.json; rc=\$?; grep -H -E 'ViT CUDA graph|Traceback|Error' /tmp/sgx/vit-server/*.log 2>/dev/null \
| tail -n 300 >\$OUT/server_log_excerpts.txt; exit \$rc" ;;
    bench-pi05) echo "bench_pi05_all" ;;
    *) echo "unknown step: $1 (allowed: server-q25, server-q3, pi05-server, pi05-fast, pi05-loop, unit, sanitizer, bench-vit, bench-vit-server, bench-pi05, bench-pi05-server)" >&2; return 2 ;;
  esac
}

pids=()
names=()
for step in "$@"; do
  cmd=$(step_cmd "$step") || exit 2
  mkdir -p "$work/$step"
  # Test artefacts (server logs, activation records) under $work/$step via OUT / SGX_TEST_LOG_DIR.
  # The log is written straight into $OUT: a call cut off by its time limit still brings it back.
  ( OUT="$work/$step" SGX_TEST_LOG_DIR="$work/$step" timeout -k 10 "$LIMIT" bash -c "$cmd" \
      >"$OUT/$step.log" 2>&1; echo "step $step rc=$?" >>"$OUT/$step.log" ) &
  pids+=($!)
  names+=("$step")
  sleep "${SGX_STEP_STAGGER:-20}"  # let the first step's processes start (JIT caches) before the next
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  tar czf "$OUT/${names[$i]}.tgz" -C "$work" "${names[$i]}" 2>/dev/null
  echo "===== ${names[$i]} ====="
  grep -E "^\[|passed|failed|error|rc=|^(FAILED|ERROR)" "$OUT/${names[$i]}.log" | tail -n "${SGX_TAIL:-40}"
done
