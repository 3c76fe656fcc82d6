#!/usr/bin/env bash
# Apply the sglang-ext fork patch series to an sglang source tree.
#
#   scripts/apply_patches.sh [--check] [--layout auto|checkout|wheel] [--series DIR] TREE
#
# TREE is either an sglang git checkout (holds python/sglang/; patches apply with -p1,
# exactly as `git apply -p1` or `quilt push -a` would) or an unpacked wheel / a copy of
# site-packages (holds sglang/; patches apply with -p2). --layout auto (default) tells
# them apart.
#
# The tree's sglang version is checked first (sglang/_version.py; in a checkout without a
# build, `git describe --tags`): it picks the series (patches/sglang-<release>; --series: that
# one), each for one release, and a release without one is refused before anything is touched. Then the whole series is checked (`git apply --check`, patch
# by patch, on a scratch copy of the files it touches) and only then applied. git discovery is fenced
# off at TREE, so a TREE nested inside another repository is still patched in place
# (`git apply` inside a foreign work tree would silently skip the files).
#
# A tree that already carries the whole series (it reverse-applies) is reported as
# "already applied" with exit status 0.
#
# --check: stop after `git apply --check`.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
series_dir=""  # default: patches/sglang-<the tree's release>
layout=auto
check_only=0
tree=""

die() { echo "apply_patches: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --check) check_only=1 ;;
    --layout) shift; layout="${1:-}" ;;
    --layout=*) layout="${1#--layout=}" ;;
    --series) shift; series_dir="${1:-}" ;;
    --series=*) series_dir="${1#--series=}" ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1" ;;
    *) [ -z "$tree" ] || die "one TREE only"; tree="$1" ;;
  esac
  shift
done
[ -n "$tree" ] || die "usage: $0 [--check] [--layout auto|checkout|wheel] [--series DIR] TREE"
[ -d "$tree" ] || die "$tree is not a directory"
tree="$(cd "$tree" && pwd)"
available="$(ls "$here/../patches" | sed -n 's/^sglang-//p' | xargs)"

if [ "$layout" = auto ]; then
  if [ -d "$tree/python/sglang" ]; then layout=checkout
  elif [ -d "$tree/sglang" ]; then layout=wheel
  else die "$tree holds neither python/sglang/ (a checkout) nor sglang/ (a wheel or site-packages copy)"
  fi
fi
case "$layout" in
  checkout) pkg="$tree/python/sglang"; strip=1 ;;
  wheel) pkg="$tree/sglang"; strip=2 ;;
  *) die "--layout must be auto, checkout or wheel (got '$layout')" ;;
esac
[ -d "$pkg" ] || die "$pkg not found (layout $layout)"

# --- version gate ---------------------------------------------------------
tree_version=""
if [ -f "$pkg/_version.py" ]; then
  tree_version="$(sed -n "s/^__version__ *= *\(version *= *\)\{0,1\}['\"]\([^'\"]*\)['\"].*/\2/p" "$pkg/_version.py" | head -n1)"
fi
if [ -z "$tree_version" ] && [ "$layout" = checkout ] && [ -d "$tree/.git" ]; then
  tree_version="$(git -C "$tree" describe --tags --exact-match 2>/dev/null | sed 's/^v//')" || true
fi
[ -n "$tree_version" ] || die "cannot tell the sglang version of $tree (no sglang/_version.py, no exact release tag); \
patch series exist for sglang $available only"
if [ -z "$series_dir" ]; then
  series_dir="$here/../patches/sglang-${tree_version%%+*}"
  [ -d "$series_dir" ] || die "no patch series for sglang $tree_version (series exist for sglang $available); \
refusing to apply. Use the sglang-ext runtime plugin, or a tree of one of those releases."
fi
series_dir="$(cd "$series_dir" && pwd)"
[ -f "$series_dir/series" ] || die "$series_dir/series not found"
series_version="$(sed -n 's/^# sglang-version: *//p' "$series_dir/series" | head -n1)"
[ -n "$series_version" ] || die "$series_dir/series has no '# sglang-version:' line"
if [ "${tree_version%%+*}" != "$series_version" ]; then
  die "this patch series is for sglang $series_version, but $tree is sglang $tree_version; refusing to apply. \
Use the sglang-ext runtime plugin, or a $series_version tree."
fi

# --- check, then apply ------------------------------------------------------
patches=()
while IFS= read -r line; do
  line="${line%%#*}"; line="$(echo "$line" | xargs)"
  [ -n "$line" ] || continue
  name="${line%% *}"  # quilt allows options after the name (e.g. -p1); ours carry none
  [ -f "$series_dir/$name" ] || die "$series_dir/$name is listed in series but missing"
  patches+=("$series_dir/$name")
done < "$series_dir/series"
[ ${#patches[@]} -gt 0 ] || die "$series_dir/series lists no patches"

# One `git apply` call cannot take two patches of the same file, so the series is first
# applied in order to a scratch copy of the files it touches (git apply --check before
# each): the real tree is changed only once the whole series is known to apply.
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch" "$scratch.err"' EXIT
export GIT_CEILING_DIRECTORIES="$(dirname "$tree"):$(dirname "$scratch")"
fresh_scratch() {  # scratch := copies of the tree's files that the series touches
  rm -rf "$scratch" && mkdir -p "$scratch"
  for patch in "${patches[@]}"; do
    sed -n 's|^diff --git a/\([^ ]*\) b/.*|\1|p' "$patch" | cut -d/ -f"$strip"-
  done | sort -u | while IFS= read -r rel; do
    if [ -f "$tree/$rel" ]; then mkdir -p "$scratch/$(dirname "$rel")"; cp "$tree/$rel" "$scratch/$rel"; fi
  done
}
already_applied() {  # the whole series reverse-applies, last patch first
  fresh_scratch
  local i
  for ((i = ${#patches[@]} - 1; i >= 0; i--)); do
    (cd "$scratch" && git apply -R --check -p"$strip" "${patches[$i]}" 2>/dev/null \
      && git apply -R -p"$strip" "${patches[$i]}") || return 1
  done
}
fresh_scratch
for patch in "${patches[@]}"; do
  if ! (cd "$scratch" && git apply --check -p"$strip" "$patch" 2>"$scratch.err" && git apply -p"$strip" "$patch"); then
    if already_applied; then
      echo "apply_patches: $tree (sglang $tree_version) already has every patch of $(basename "$series_dir") applied; nothing to do"
      exit 0
    fi
    cat "$scratch.err" >&2
    die "$(basename "$patch") does not apply cleanly to $tree (sglang $tree_version, $layout layout), and the series is not already applied either; nothing was changed"
  fi
done
echo "apply_patches: ${#patches[@]} patches apply cleanly to $tree (sglang $tree_version, $layout layout, -p$strip)"
[ "$check_only" = 1 ] && exit 0
cd "$tree"
for patch in "${patches[@]}"; do
  git apply -p"$strip" "$patch" || die "$(basename "$patch") failed on $tree after a clean check (tree changed meanwhile?)"
done
echo "apply_patches: applied $(basename "$series_dir") to $tree"
