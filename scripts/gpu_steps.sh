#!/usr/bin/env bash
# The GPU runs behind docs/gpu-notes.md, as named steps, on the GPU machine after
# `source scripts/gpu_env.sh` (docs/gpu-harness.md). Steps given together run CONCURRENTLY on the
# one GPU (tiny servers and unit tests fit beside each other); each step's log and its test
# artefacts go to one tarball under $OUT, so a call brings back few files.
#   bash scripts/gpu_steps.sh STEP [STEP ...]
# Steps:
#   server-q25 / server-q3   real-server ViT tests (tiny Qwen2.5-VL / Qwen3-VL), SGX_BACKENDS selects backends
#   pi05-server              Pi0.5 through sglang_ext.serve and unpatched sglang serve
#   pi05-fast                the pi05_fast path (Triton kernels, 32 requests vs the exact path), real-size model
#   unit                     the module-level GPU tests (graph core, ViT, Pi0.5, prefill CP) on real kernels
#   sanitizer                graph-core, ViT and Pi0.5 GPU tests under compute-sanitizer memcheck
#   bench-vit                scripts/bench_vit.py (BENCH_VIT_ARGS)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT is the folder that comes back}"
export PYTHONUNBUFFERED=1
LIMIT="${SGX_STEP_TIMEOUT:-540}"
work=/tmp/sgx-steps
mkdir -p "$work"

step_cmd() {
  case "$1" in
    server-q25) echo "python3 -m pytest -s -v -p no:cacheprovider test/registered/server/test_qwen2_5_vl_server_cuda.py" ;;
    server-q3) echo "python3 -m pytest -s -v -p no:cacheprovider test/registered/server/test_qwen3_vl_server_cuda.py" ;;
    pi05-server) echo "python3 -m pytest -x -q -s -p no:cacheprovider test/registered/pi05/test_pi05_server_cuda.py" ;;
    pi05-fast) echo "python3 -m pytest -q -s -rA -p no:cacheprovider test/registered/pi05/test_pi05_fast_cuda.py" ;;
    unit) echo "python3 -m pytest -q -rA -p no:cacheprovider test/registered/graphs/test_graph_core_cuda.py \
test/registered/vit/test_vit_cuda_graph_cuda.py test/registered/pi05/test_pi05_graphs_cuda.py \
test/registered/pi05/test_pi05_fused_norms_cuda.py test/registered/cp/test_prefill_cp_graph_1gpu.py" ;;
    # Default subset: fits ~5 min under memcheck. Left out: the failed-capture tests (they raise CUDA
    # API errors 900/901 on purpose, which memcheck counts) and two memory-accounting tests whose
    # numbers memcheck's own allocations change (all pass in `unit`).
    sanitizer) echo "compute-sanitizer --tool memcheck --error-exitcode 7 --print-limit 20 python3 -m pytest -q -rA \
-p no:cacheprovider ${SANITIZER_TESTS:-test/registered/graphs/test_graph_core_cuda.py \
test/registered/vit/test_vit_cuda_graph_cuda.py test/registered/pi05/test_pi05_graphs_cuda.py -k \
'(test_graph_core_cuda or replays_current or rotary_buffer or capacity_overflow or evicting_gemm \
or (graph_mode_matches_eager and full and 17) or consecutive_requests) and not failed_capture \
and not return_pool_memory and not workspace_growth'}" ;;
    bench-vit) echo "python3 scripts/bench_vit.py ${BENCH_VIT_ARGS:-} --out $OUT/vit.json" ;;
    *) echo "unknown step: $1 (allowed: server-q25, server-q3, pi05-server, pi05-fast, unit, sanitizer, bench-vit)" >&2; return 2 ;;
  esac
}

pids=()
names=()
for step in "$@"; do
  cmd=$(step_cmd "$step") || exit 2
  mkdir -p "$work/$step"
  # Test artefacts (server logs, activation records) under $work/$step via OUT / SGX_TEST_LOG_DIR.
  ( OUT="$work/$step" SGX_TEST_LOG_DIR="$work/$step" timeout -k 10 "$LIMIT" bash -c "$cmd" \
      >"$work/$step/log.txt" 2>&1; echo "step $step rc=$?" >>"$work/$step/log.txt" ) &
  pids+=($!)
  names+=("$step")
  sleep "${SGX_STEP_STAGGER:-20}"  # let the first step's processes start (JIT caches) before the next
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  tar czf "$OUT/${names[$i]}.tgz" -C "$work" "${names[$i]}" 2>/dev/null
  echo "===== ${names[$i]} ====="
  grep -E "^\[|passed|failed|error|rc=|^(FAILED|ERROR)" "$work/${names[$i]}/log.txt" | tail -n "${SGX_TAIL:-40}"
done
