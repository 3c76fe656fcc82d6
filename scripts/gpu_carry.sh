#!/usr/bin/env bash
# Build the ignored .carry/ parts that GPU-machine calls carry (docs/gpu-harness.md). Run here, with
# network, from anywhere in the checkout:   bash scripts/gpu_carry.sh
#   .carry/base/            real sgl_kernel (pruned for an H200, no FA3), flashinfer, the pinned server
#                           and Pi0.5 deps (requirements/gpu-carry.txt), sglang 0.5.17
#   .carry/sgl0519/         sglang 0.5.19 (+ its older compressed-tensors); rides with the last FA3 part
#   .carry/sgl0523/         sglang 0.5.23 (+ the pins it changed: transformers, ...); a call of its own
#   .carry/fa3-{1,2,3}/     sgl_kernel's FA3 library (flash_ops.abi3.so), xz, split in three
# Every part must stay <= 58 MiB (a call carries 64 MiB with the working tree). Incremental: downloads,
# staging and compression are skipped when their outputs exist and match. Cache: .cache/gpu-carry/
# (SGX_CARRY_CACHE). xz uses SGX_XZ_THREADS threads (default 2) under nice; the base takes xz -9 (its
# size is what limits), FA3 takes SGX_FA3_XZ (-9, the default for a new build: 133.5 MB; -3: 173 MB in a
# sixth of the CPU time; three parts either way; unset keeps parts built with either). `--base-only`
# skips FA3.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
CACHE="${SGX_CARRY_CACHE:-$REPO/.cache/gpu-carry}"
CARRY="$REPO/.carry"
REQ="$REPO/requirements/gpu-carry.txt"
THREADS="${SGX_XZ_THREADS:-2}"
export PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1
LIMIT=$((58 * 1024 * 1024))
SGLANG_VERSIONS="0.5.17 0.5.19 0.5.23"
FA3_PARTS=3                  # at most; parts are FA3_CHUNK bytes, the last one the rest
FA3_CHUNK=$((56 * 1024 * 1024))
FA3_XZ="${SGX_FA3_XZ:-}"     # empty: keep parts of any preset; compress with the last preset used, else -9
PY="${PYTHON:-python3}"
t0=$(date +%s)
mkdir -p "$CACHE/wheels" "$CACHE/fa3" "$CARRY"
say() { echo "gpu_carry: $*"; }
die() { echo "gpu_carry: ERROR: $*" >&2; exit 1; }
pip_quiet() { "$@" 2> >(grep -v "^WARNING: Location 'file:///" >&2); }
PLATFORMS=(--python-version 3.12 --implementation cp --only-binary=:all:)
for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 \
         manylinux_2_5 manylinux1; do PLATFORMS+=(--platform "${p}_x86_64"); done
PLATFORMS+=(--platform any)

# --- 1. wheels (cp312, x86_64, --no-deps) --------------------------------------------------------
# spec lines: "name==version" (site) or "name==version  # 0519" (that sglang tree only, ahead of site)
mapfile -t SITE_SPECS < <(grep -v '# 05[0-9][0-9]' "$REQ" | sed 's/#.*//; s/[[:space:]]//g' | grep .)
overlay_specs() { grep "# $1\$" "$REQ" | sed 's/#.*//; s/[[:space:]]//g' | grep .; }  # tag -> its specs
mapfile -t OVERLAY_SPECS < <(grep '# 05[0-9][0-9]' "$REQ" | sed 's/#.*//; s/[[:space:]]//g' | grep .)
SGLANG_SPECS=(); for v in $SGLANG_VERSIONS; do SGLANG_SPECS+=("sglang==$v"); done
wheel_of() {  # spec -> the cached wheel's path (empty if absent)
  local name=${1%%==*} ver=${1#*==}
  name=$(echo "$name" | tr 'A-Z' 'a-z' | sed 's/[-_.]\+/_/g')
  find "$CACHE/wheels" -maxdepth 1 -iname "${name}-${ver}-*.whl" | head -1
}
missing=()
for s in "${SITE_SPECS[@]}" "${OVERLAY_SPECS[@]}" "${SGLANG_SPECS[@]}"; do
  [ -n "$(wheel_of "$s")" ] || missing+=("$s")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "downloading ${#missing[@]} wheels"
  # one pip call per spec whose name repeats (pip refuses two versions of one name in one call)
  declare -A seen=(); batch=(); later=()
  for s in "${missing[@]}"; do n=${s%%==*}; n=${n,,}; if [ -n "${seen[$n]:-}" ]; then later+=("$s"); else seen[$n]=1; batch+=("$s"); fi; done
  pip_quiet "$PY" -m pip download -q --no-deps "${PLATFORMS[@]}" -d "$CACHE/wheels" "${batch[@]}"
  for s in "${later[@]}"; do pip_quiet "$PY" -m pip download -q --no-deps "${PLATFORMS[@]}" -d "$CACHE/wheels" "$s"; done
fi
for s in "${SITE_SPECS[@]}" "${OVERLAY_SPECS[@]}" "${SGLANG_SPECS[@]}"; do
  [ -n "$(wheel_of "$s")" ] || die "no cp312 x86_64 wheel for $s in $CACHE/wheels"
done
KERNEL_WHL=$(wheel_of "sglang-kernel==$(grep -o '^sglang-kernel==[^ #]*' "$REQ" | cut -d= -f3)")
say "wheels ready ($(( $(date +%s) - t0 )) s)"

# --- 2. stage with pip --target (stamped: wheel files + requirements list), prune ----------------
STAGE="$CACHE/stage"
stamp=$( { for s in "${SITE_SPECS[@]}" "${OVERLAY_SPECS[@]}" "${SGLANG_SPECS[@]}"; do basename "$(wheel_of "$s")"; done
           sha256sum "$REQ" | cut -d' ' -f1; } | sha256sum | cut -c1-16)
if [ "$(cat "$STAGE/.stamp" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$STAGE" && mkdir -p "$STAGE"
  install_to() {  # dir wheel...
    local dir=$1; shift
    pip_quiet "$PY" -m pip install -q --no-deps --no-compile --no-index --target "$dir" "${PLATFORMS[@]}" "$@"
  }
  site_whls=(); for s in "${SITE_SPECS[@]}"; do site_whls+=("$(wheel_of "$s")"); done
  install_to "$STAGE/site" "${site_whls[@]}"
  for v in $SGLANG_VERSIONS; do
    tag=${v//./}                                                 # 0.5.17 -> 0517
    extra=(); while read -r s; do [ -n "$s" ] && extra+=("$(wheel_of "$s")"); done < <(overlay_specs "$tag")
    install_to "$STAGE/sgl$tag" "$(wheel_of "sglang==$v")" "${extra[@]}"
  done
  echo "$stamp" > "$STAGE/.stamp"
fi
# Prune (idempotent): FA3 travels on its own; flashmla/infllm/spatial/sm100 libraries are not used on
# an H200 (sm90/common_ops is what loads there); sgl_kernel's dist-info stays (sglang checks its version).
k="$STAGE/site/sgl_kernel"
rm -f "$k"/flash_ops.*.so "$k"/flashmla_ops.*.so "$k"/infllm_ops.*.so "$k"/spatial_ops.*.so "$k"/sm100/*.so
[ -f "$k/sm90/common_ops.abi3.so" ] || die "sgl_kernel/sm90/common_ops.abi3.so missing from $KERNEL_WHL"
rm -f "$STAGE/site/xgrammar/lib/libxgrammar.a"        # static archive, only for building against it
rm -rf "$STAGE"/*/bin                                  # console scripts with this machine's python path
rm -rf "$STAGE/site/jedi/third_party"                  # typeshed/django stubs: jedi's completions only
find "$STAGE" -name __pycache__ -type d -prune -exec rm -rf {} +
find "$STAGE" -name '*.pyc' -delete
find "$STAGE/site" -type d -name tests -prune -exec rm -rf {} +   # third-party test suites (sglang's own stay)

# --- 3. pack tar | xz : base (site + sglang 0.5.17), sgl0519, sgl0523 ------------------------------
# They do not fit one 58 MiB part; sgl0519 is small and travels beside the last FA3 part.
pack() {  # name xz-preset tree...
  local name=$1 preset=$2; shift 2
  local out="$CARRY/$name" pstamp
  pstamp=$(echo "$stamp pack-1 $preset $*" | sha256sum | cut -c1-16)
  if [ -f "$out/$name.tar.xz" ] && [ "$(cat "$out/stamp" 2>/dev/null)" = "$pstamp" ] \
     && (cd "$out" && sha256sum -c --quiet "$name.sha256"); then
    say "$name up to date"
  else
    rm -rf "$out" && mkdir -p "$out"
    (cd "$STAGE" && find "$@" -type f -o -type l) | LC_ALL=C sort > "$CACHE/$name.list"
    say "packing $name ($(cd "$STAGE" && du -smc "$@" | tail -1 | cut -f1) MB staged) with xz $preset -T$THREADS"
    tar -C "$STAGE" --no-recursion --owner=0 --group=0 --numeric-owner -cf - -T "$CACHE/$name.list" \
      | nice -n 10 xz "$preset" -T"$THREADS" > "$out/$name.tar.xz.tmp"
    mv "$out/$name.tar.xz.tmp" "$out/$name.tar.xz"
    (cd "$out" && sha256sum "$name.tar.xz" > "$name.sha256")
    local t; for t in "$@"; do (cd "$STAGE" && ls -d "$t"/*.dist-info); done | sed 's|\.dist-info$||' > "$out/contents.txt"
    echo "$pstamp" > "$out/stamp"
  fi
  local size; size=$(stat -c %s "$out/$name.tar.xz")
  [ "$size" -le "$LIMIT" ] || die "$name.tar.xz is $size bytes > 58 MiB: prune more (requirements/gpu-carry.txt)"
}
pack base -9 site sgl0517     # its size is what limits
pack sgl0519 -3 sgl0519       # small, and it shares a call with the last FA3 part
pack sgl0523 -9 sgl0523       # a call of its own (with the tree) after the base's

[ "${1:-}" = --base-only ] && { say "base only: $(( $(date +%s) - t0 )) s"; exit 0; }

# --- 4. FA3: flash_ops.abi3.so, xz $FA3_XZ, split into <= $FA3_PARTS parts + sha256 manifest -----------
F="$CACHE/fa3"
raw="$F/flash_ops.abi3.so"
kernel_tag=$(basename "$KERNEL_WHL" | cut -d- -f1-2)          # sglang_kernel-0.4.5
parts_ok() {
  local i n; n=$(grep -c ' fa3.xz.part' "$CARRY/fa3-1/fa3.sha256" 2>/dev/null) || return 1
  for i in $(seq 1 "$n"); do
    [ -f "$CARRY/fa3-$i/fa3.sha256" ] && (cd "$CARRY/fa3-$i" && grep " fa3.xz.part$i\$" fa3.sha256 | sha256sum -c --quiet -) \
      && grep -q "^# $kernel_tag xz ${FA3_XZ:--[0-9]e*}\$" "$CARRY/fa3-$i/fa3.sha256" || return 1
  done
}
if parts_ok; then
  say "FA3 parts up to date ($(head -1 "$CARRY/fa3-1/fa3.sha256" | cut -d' ' -f3-))"
else
  [ -n "$FA3_XZ" ] || FA3_XZ=$(cut -d' ' -f3 "$F/flash_ops.abi3.so.xz.ok" 2>/dev/null || true)
  FA3_XZ=${FA3_XZ:--9}
  if ! { [ -f "$raw" ] && [ -f "$raw.sha256" ] && grep -q "$kernel_tag" "$raw.sha256"; }; then
    unzip -q -o -j "$KERNEL_WHL" 'sgl_kernel/flash_ops.abi3.so' -d "$F"
    (cd "$F" && { sha256sum flash_ops.abi3.so; echo "# $kernel_tag"; } > flash_ops.abi3.so.sha256)
    rm -f "$raw.xz" "$raw.xz.ok"
  fi
  raw_sha=$(head -1 "$raw.sha256" | cut -d' ' -f1)
  # .xz.ok: "<raw sha> <xz size> <preset>"; another preset means compress again. An .xz left without
  # one (made by hand with SGX_FA3_XZ's preset) counts once it is proven to decompress to the library.
  ok=$(cat "$raw.xz.ok" 2>/dev/null || true)
  if [ -f "$raw.xz" ] && [ -n "$ok" ] && [ "$ok" != "$raw_sha $(stat -c %s "$raw.xz") $FA3_XZ" ]; then
    rm -f "$raw.xz" "$raw.xz.ok"
  elif [ -f "$raw.xz" ] && [ -z "$ok" ]; then
    say "checking existing $(basename "$raw").xz"
    if [ "$(xz -dc -T"$THREADS" "$raw.xz" | sha256sum | cut -d' ' -f1)" = "$raw_sha" ]; then
      echo "$raw_sha $(stat -c %s "$raw.xz") $FA3_XZ" > "$raw.xz.ok"
    else rm -f "$raw.xz"; fi
  fi
  if [ ! -f "$raw.xz" ]; then
    say "compressing FA3 ($(( $(stat -c %s "$raw") / 1048576 )) MiB) with xz $FA3_XZ -T$THREADS (minutes)"
    nice -n 10 xz "$FA3_XZ" -T"$THREADS" -c "$raw" > "$raw.xz.tmp" && mv "$raw.xz.tmp" "$raw.xz"
    echo "$raw_sha $(stat -c %s "$raw.xz") $FA3_XZ" > "$raw.xz.ok"
  fi
  xz_size=$(stat -c %s "$raw.xz")
  n=$(( (xz_size + FA3_CHUNK - 1) / FA3_CHUNK ))
  [ "$n" -le "$FA3_PARTS" ] || die "FA3 xz is $xz_size bytes: more than $FA3_PARTS parts of $FA3_CHUNK"
  rm -rf "$F/split" "$CARRY"/fa3-* && mkdir -p "$F/split"
  split -b "$FA3_CHUNK" -a 1 --numeric-suffixes=1 "$raw.xz" "$F/split/fa3.xz.part"
  manifest="$F/split/fa3.sha256"
  { echo "# $kernel_tag xz $FA3_XZ"
    (cd "$F/split" && sha256sum fa3.xz.part*)
    echo "$(cut -d' ' -f1 <<<"$(sha256sum "$raw.xz")")  fa3.xz"
    echo "$raw_sha  flash_ops.abi3.so"; } > "$manifest"
  for i in $(seq 1 "$n"); do
    mkdir -p "$CARRY/fa3-$i" && mv "$F/split/fa3.xz.part$i" "$CARRY/fa3-$i/" && cp "$manifest" "$CARRY/fa3-$i/"
  done
  parts_ok || die "FA3 parts failed their own check"
fi

# --- 5. size table ---------------------------------------------------------------------------------
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
tree=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
echo
printf '%-14s %10s %10s  %s\n' part MiB "with tree" "(limit 64 MiB per call; tree = tracked files, $(mib "$tree") MiB)"
for d in base sgl0519 sgl0523 $(cd "$CARRY" && ls -d fa3-* 2>/dev/null); do
  b=$(du -cb "$CARRY/$d"/* | tail -1 | cut -f1)
  printf '%-14s %10s %10s\n' ".carry/$d" "$(mib "$b")" "$(mib $((b + tree)))"
done
[ -d "$CACHE/stage" ] && printf '%-14s %10s  (unpacked base: %s)\n' staged "$(du -sm "$CACHE/stage" | cut -f1)" \
  "$(cd "$CACHE/stage" && du -sm site/sgl_kernel site/flashinfer sgl0517 sgl0519 sgl0523 | awk '{ printf "%s%s %s MB", (NR > 1 ? ", " : ""), $2, $1 }')"
say "done in $(( $(date +%s) - t0 )) s"
