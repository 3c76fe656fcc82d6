# Source first thing in every GPU-machine call, from the repository root (docs/gpu-harness.md):
#     source scripts/gpu_env.sh                  # sglang 0.5.17
#     SGX_SGLANG=0519 source scripts/gpu_env.sh  # sglang 0.5.19 (0523: sglang 0.5.23, with 0.5.17's kernels)
# Installs whatever .carry/ parts this call brought into $SGX_ROOT (default /tmp/sgx, which persists
# while the machine is held): unpacks .carry/base and .carry/sgl05xx when new, keeps FA3 parts as they arrive and
# joins + verifies them once all are there, installs this checkout as a distribution (so sglang's
# load_plugins() sees its entry points), exports PYTHONPATH and the JIT cache folders, and prints one
# `sgx:` line saying what is real. Idempotent; a repeat call does only the checks.
# SGX_PYTHON (default python3) is the interpreter; SGX_STANDINS names stand-in packages that every process
# started after the source sees, sglang's spawned servers too (see the doc).
# Sourced: never `exit`s the caller; returns non-zero (with one `sgx: ERROR` line) when unusable.

_sgx_setup() {
  local repo root carry py tag t0 here d f i n
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  root=${SGX_ROOT:-/tmp/sgx}
  carry=$repo/.carry
  py=${SGX_PYTHON:-python3}
  tag=${SGX_SGLANG:-0517}
  t0=$(date +%s)
  _sgx_err() { echo "sgx: ERROR: $*" >&2; }
  _sgx_same() { [ -f "$1" ] && [ -f "$2" ] && [ "$(sha256sum < "$1")" = "$(sha256sum < "$2")" ]; }  # coreutils only
  case $tag in 0517|0519|0523) ;; *) _sgx_err "SGX_SGLANG=$tag: allowed 0517, 0519, 0523"; return 2 ;; esac
  mkdir -p "$root/parts" "$root/fa3" "$root/cache" || return 1

  # tarball parts (.carry/base: site + sgl0517; .carry/sgl0519, .carry/sgl0523): unpack one when it
  # differs from what was unpacked; each top folder (site, sgl05xx) replaces its namesake under $root
  for n in base sgl0519 sgl0523; do
    d=$carry/$n
    [ -f "$d/$n.sha256" ] || continue
    _sgx_same "$d/$n.sha256" "$root/$n.sha256" && continue
    (cd "$d" && sha256sum -c --quiet "$n.sha256") || { _sgx_err ".carry/$n/$n.tar.xz fails its sha256"; return 1; }
    rm -rf "$root/unpack" "$root/$n.sha256" && mkdir -p "$root/unpack"
    xz -dc -T0 "$d/$n.tar.xz" | tar -x -C "$root/unpack" || { _sgx_err "unpacking .carry/$n failed"; return 1; }
    # byte-compile once here (all cores) rather than in every fresh process (imports 3x slower without)
    "$py" -m compileall -q -j 0 "$root/unpack" >/dev/null 2>&1
    for f in "$root/unpack"/*; do rm -rf "$root/${f##*/}" && mv "$f" "$root/"; done
    rmdir "$root/unpack" && cp "$d/$n.sha256" "$root/$n.sha256"
    echo "sgx: unpacked $n ($(du -smc "$root"/site "$root"/sgl05* 2>/dev/null | tail -1 | cut -f1) MB in all) in $(( $(date +%s) - t0 )) s"
  done
  [ -d "$root/site" ] && [ -d "$root/sgl0517" ] || { _sgx_err "no base in $root: carry .carry/base in this call first"; return 1; }
  [ -d "$root/sgl$tag" ] || { _sgx_err "SGX_SGLANG=$tag but no sgl$tag in $root: carry .carry/sgl$tag"; return 1; }

  # FA3 parts: keep each verified part (carried paths are replaced by the next call)
  for d in "$carry"/fa3-*; do
    [ -f "$d/fa3.sha256" ] || continue
    _sgx_same "$d/fa3.sha256" "$root/parts/fa3.sha256" || { rm -f "$root/parts"/*; cp "$d/fa3.sha256" "$root/parts/"; }
    for f in "$d"/fa3.xz.part*; do
      [ -f "$f" ] || continue
      _sgx_same "$f" "$root/parts/${f##*/}" && continue
      if (cd "$d" && grep " ${f##*/}\$" fa3.sha256 | sha256sum -c --quiet -); then cp "$f" "$root/parts/"
      else _sgx_err "${f#"$repo"/} fails its sha256 (not kept)"; fi
    done
  done
  local want have kernel parts_here=0 parts_all=0
  if [ -f "$root/parts/fa3.sha256" ]; then
    want=$(awk '$2 == "flash_ops.abi3.so" { print $1 }' "$root/parts/fa3.sha256")
    parts_all=$(grep -c ' fa3.xz.part' "$root/parts/fa3.sha256" || true)
    parts_here=$(ls "$root/parts"/fa3.xz.part* 2>/dev/null | wc -l)
    have=$(cat "$root/fa3/verified" 2>/dev/null || true)
    if [ "$parts_here" = "$parts_all" ] && [ "$have" != "$want" ]; then
      (cd "$root/parts" && grep ' fa3.xz.part' fa3.sha256 | sha256sum -c --quiet -) || { _sgx_err "FA3 parts fail sha256"; return 1; }
      rm -f "$root/fa3"/*
      for i in $(seq 1 "$parts_all"); do cat "$root/parts/fa3.xz.part$i"; done | xz -dc -T0 > "$root/fa3/flash_ops.abi3.so.tmp"
      if [ "$(sha256sum < "$root/fa3/flash_ops.abi3.so.tmp" | cut -d' ' -f1)" = "$want" ]; then
        mv "$root/fa3/flash_ops.abi3.so.tmp" "$root/fa3/flash_ops.abi3.so" && echo "$want" > "$root/fa3/verified"
        head -1 "$root/parts/fa3.sha256" | awk '{ print $2 }' > "$root/fa3/kernel"
        echo "sgx: joined and verified FA3 ($parts_all parts) in $(( $(date +%s) - t0 )) s"
      else rm -f "$root/fa3/flash_ops.abi3.so.tmp"; _sgx_err "joined FA3 fails its sha256"; return 1; fi
    fi
  fi
  # FA3 goes into the installed sgl_kernel only when it was built from that same sglang-kernel wheel
  kernel=$(cd "$root/site" && ls -d sglang_kernel-*.dist-info 2>/dev/null | sed 's/\.dist-info$//')
  if [ -f "$root/fa3/flash_ops.abi3.so" ] && [ "$(cat "$root/fa3/kernel" 2>/dev/null)" = "$kernel" ]; then
    ln -f "$root/fa3/flash_ops.abi3.so" "$root/site/sgl_kernel/flash_ops.abi3.so" 2>/dev/null \
      || cp "$root/fa3/flash_ops.abi3.so" "$root/site/sgl_kernel/flash_ops.abi3.so"
  fi

  # this checkout as an installed distribution; reinstalled whenever its python tree or setup.py changed
  here=$(cd "$repo" && find setup.py python -type f ! -name '*.pyc' ! -path '*/__pycache__/*' ! -path '*.egg-info/*' \
         | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
  if [ "$here" != "$(cat "$root/ext/.tree" 2>/dev/null)" ]; then
    rm -rf "$root/ext.src" "$root/ext.new" && mkdir -p "$root/ext.src"
    tar -C "$repo" --exclude=__pycache__ --exclude='*.egg-info' -cf - setup.py python | tar -x -C "$root/ext.src"
    (cd "$root/ext.src" && env -u PYTHONPATH "$py" -m pip install -q --no-deps --no-index --no-build-isolation \
       --target "$root/ext.new" . >"$root/ext.log" 2>&1) || { _sgx_err "installing this checkout failed ($root/ext.log)"; return 1; }
    echo "$here" > "$root/ext.new/.tree"
    rm -rf "$root/ext" "$root/ext.src" && mv "$root/ext.new" "$root/ext"
  fi

  # environment: PYTHONPATH is rebuilt from what it was before the first source (repeatable)
  export SGX_PYTHONPATH0="${SGX_PYTHONPATH0-${PYTHONPATH:-}}"
  export SGX_ROOT="$root" SGX_SGLANG="$tag" SGX_SGLANG_DIR="$root/sgl$tag"
  # 0.5.23 on 0.5.17's kernels: its engine asserts sglang-kernel >= 0.4.9, and its FA3 would first try a kernel hub
  [ "$tag" = 0523 ] && export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 SGLANG_USE_SGL_FA3_KERNEL=1
  # SGX_STANDINS: a folder per name, first on PYTHONPATH, so every process (sglang's spawned servers
  # too) imports that package as a stand-in (test/sglang_ext_testkit/stand_ins.py)
  local standins="" s
  export SGX_STANDINS="${SGX_STANDINS:-}"                 # what the summary line and bench results report
  for s in $(echo "${SGX_STANDINS:-}" | tr ',' ' '); do
    case $s in *[!A-Za-z0-9_]*) _sgx_err "SGX_STANDINS: '$s' is not a top-level package name"; return 2 ;; esac
    mkdir -p "$root/stand-ins/$s/$s" || return 1
    printf '%s\n' "# stand-in written by scripts/gpu_env.sh for SGX_STANDINS (harness only)" "import sys" \
      "from sglang_ext_testkit.stand_ins import stand_in_package" "sys.modules[__name__] = stand_in_package(__name__)" \
      > "$root/stand-ins/$s/$s/__init__.py"
    standins="$standins$root/stand-ins/$s:"
  done
  # $repo/test: the test tooling (sglang_ext_testkit), never installed
  export PYTHONPATH="$standins$root/ext:$repo/test:$root/sgl$tag:$root/site${SGX_PYTHONPATH0:+:$SGX_PYTHONPATH0}"
  export TVM_FFI_CACHE_DIR="$root/cache/tvm-ffi" TRITON_CACHE_DIR="$root/cache/triton"
  export TORCHINDUCTOR_CACHE_DIR="$root/cache/inductor"
  export FLASHINFER_WORKSPACE_BASE="$root/cache"          # flashinfer/jit/env.py: <base>/.cache/flashinfer
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1               # no network there: fail fast instead of retrying
  if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDA_HOME=/usr/local/cuda PATH="/usr/local/cuda/bin:$PATH"
  fi

  # one line: what is real in this environment
  local glibc
  glibc=$(ldd --version 2>/dev/null | head -1 | grep -o '[0-9]\+\.[0-9]\+$')
  [ -n "$glibc" ] && [ "$(printf '%s\n' 2.34 "$glibc" | sort -V | head -1)" = 2.34 ] && glibc="$glibc ok" \
    || glibc="${glibc:-unknown} (< 2.34: sglang's _core extensions will not load)"
  SGX_FA3_PARTS="$parts_here/$parts_all" SGX_GLIBC="$glibc" timeout 300 "$py" - <<'EOF' || echo "sgx: (probe failed: $py)"
import importlib.metadata as md, os, sys
root = os.environ["SGX_ROOT"]
def where(mod):
    f = getattr(mod, "__file__", None) or ""
    return "" if f.startswith(root) else f" NOT FROM {root}: {f}"
def ver(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "absent"
out = []
try:
    import sglang
    out.append(f"sglang {ver('sglang')}{where(sglang)}")
except Exception as e:
    out.append(f"sglang no ({type(e).__name__}: {e})"[:160])
cuda = False
try:
    import torch
    cuda = torch.cuda.is_available()
    out.append(f"torch {torch.__version__} cuda={'yes' if cuda else 'no'}")
except Exception as e:
    out.append(f"torch no ({type(e).__name__})")
stand = [s for s in os.environ.get("SGX_STANDINS", "").split(",") if s]
try:
    import sgl_kernel
    ops = getattr(sgl_kernel, "common_ops", None)
    if ops is None or not str(getattr(ops, "__file__", "")).endswith(".so"):
        raise ImportError("sgl_kernel imported but loaded no common_ops library")
    arch = os.path.basename(os.path.dirname(ops.__file__))
    out.append(f"sgl_kernel {ver('sglang-kernel')} common_ops=yes({arch}){where(sgl_kernel)}")
except Exception as e:
    out.append(f"sgl_kernel common_ops=no ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})"[:200])
fa3 = os.path.join(root, "site", "sgl_kernel", "flash_ops.abi3.so")
parts = os.environ.get("SGX_FA3_PARTS", "0/0")
if not os.path.exists(fa3):
    out.append(f"FA3=no (parts {parts} here)")
else:
    mark = os.path.join(root, "fa3", "loaded")
    if not os.path.exists(mark) and cuda and "sgl_kernel" in sys.modules:
        try:
            import sgl_kernel.flash_attn  # noqa: F401  (loads flash_ops, as sglang's fa3 backend does)
            open(mark, "w").write("ok\n")
        except Exception as e:
            out.append(f"FA3=no (verified but does not load: {type(e).__name__}: {e})"[:200])
    if os.path.exists(mark):
        out.append("FA3=yes")
    elif not any(s.startswith("FA3=") for s in out):
        out.append("FA3=present (not loaded: no CUDA here)")
try:
    import flashinfer
    out.append(f"flashinfer=yes {ver('flashinfer-python')}{where(flashinfer)}")
except Exception as e:
    out.append(f"flashinfer=no ({type(e).__name__}: {e})"[:160])
out.append(f"transformers {ver('transformers')}")
eps = [e.name for e in md.entry_points(group="sglang.srt.plugins")]
out.append(f"plugin={'yes' if 'sglang_ext' in eps else 'no'} sglang-ext {ver('sglang-ext')}")
out.append(f"glibc {os.environ.get('SGX_GLIBC')}")
out.append(f"stand-ins: {','.join(stand) + ' (every process)' if stand else 'none'}")
if os.environ.get("SGX_SGLANG") == "0523":  # imported by a 0.5.23 server at start (docs/gpu-harness.md)
    import importlib.util
    need = {n: "stand-in" if n in stand else ("yes" if importlib.util.find_spec(n) else "NO: its server dies at start")
            for n in ("cutlass", "imageio_ffmpeg")}
    out.append("0523 needs " + " ".join(f"{n}={v}" for n, v in need.items()))
print("sgx: " + " | ".join(out), flush=True)
EOF
  unset -f _sgx_err _sgx_same
}
_sgx_setup; _sgx_rc=$?; unset -f _sgx_setup
return $_sgx_rc 2>/dev/null || { echo "sgx: source this file (source scripts/gpu_env.sh), do not run it" >&2; exit 2; }
