#!/usr/bin/env bash
# Offline TileLang bundle for GPU nodes without network access.
#
#   tilelang_bundle.sh build OUTDIR [--python-version 3.12] [--platform TAG]...
#       On a connected machine: downloads the wheels of tilelang 0.1.15 and the packages it needs
#       besides torch and numpy (apache-tvm-ffi, torch-c-dlpack-ext, z3-solver, cloudpickle,
#       ml-dtypes, psutil, tqdm) for the target Python and platform, unpacks them into one site
#       directory and writes OUTDIR/tilelang-0.1.15-cpXY-<platform>.tar.xz (xz -9).
#       Default platform tags: manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64.
#       PIP overrides the pip command (default "python3 -m pip"), e.g. PIP=".venv/bin/python -m pip".
#   tilelang_bundle.sh install TARBALL DEST
#       On the offline node: checks that the bundle's CPython tag is the node's (PYTHON, default
#       python3), extracts it into DEST and prints the PYTHONPATH line to use (eval-safe quoting).
#
# The node must already have torch and numpy (the bundle never shadows them) and nvcc for JIT.
set -euo pipefail

TILELANG_PINS=(
  "tilelang==0.1.15"
  # tilelang 0.1.15 needs apache-tvm-ffi >=0.1.11,<0.1.13; pinned together (0.1.11 aborts at import).
  "apache-tvm-ffi==0.1.12"
  "torch-c-dlpack-ext"
  "z3-solver<4.15.5,>=4.13.0"
  # tilelang's small pure dependencies, absent from minimal torch images.
  "cloudpickle"
  "ml-dtypes"
  "psutil"
  "tqdm"
)
DEFAULT_PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)

usage() {
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

die() { echo "tilelang_bundle.sh: $*" >&2; exit 1; }

cmd_build() {
  [[ $# -ge 1 ]] || usage
  local outdir=$1; shift
  local pyver=3.12
  local platforms=()
  while [[ $# -gt 0 ]]; do
    case $1 in
      --python-version) [[ $# -ge 2 ]] || die "--python-version needs a value (e.g. 3.12)"; pyver=$2; shift 2 ;;
      --platform) [[ $# -ge 2 ]] || die "--platform needs a value (e.g. manylinux_2_28_x86_64)"; platforms+=("$2"); shift 2 ;;
      *) die "build: unknown argument '$1'" ;;
    esac
  done
  [[ $pyver =~ ^3\.[0-9]+$ ]] || die "--python-version: expected MAJOR.MINOR like 3.12, got '$pyver'"
  [[ ${#platforms[@]} -gt 0 ]] || platforms=("${DEFAULT_PLATFORMS[@]}")
  local pip=${PIP:-python3 -m pip}
  local abi=cp${pyver/./}
  local work
  work=$(mktemp -d)
  # shellcheck disable=SC2064  # expand now: $work is local and gone by the time EXIT fires
  trap "rm -rf '$work'" EXIT
  local platform_args=()
  for p in "${platforms[@]}"; do platform_args+=(--platform "$p"); done

  echo "downloading wheels for $abi ${platforms[*]}" >&2
  $pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version "$pyver" \
    "${platform_args[@]}" -d "$work/wheels" "${TILELANG_PINS[@]}"
  mkdir -p "$work/site"
  for whl in "$work"/wheels/*.whl; do
    python3 -m zipfile -e "$whl" "$work/site"
  done
  # Wheels do not keep the executable bit through zipfile; TileLang runs nothing from here but its
  # bundled tools, so restore +x on shared libraries and binaries.
  find "$work/site" -type f \( -name '*.so*' -o -path '*/bin/*' \) -exec chmod +x {} +
  ls -1 "$work/wheels" > "$work/site/BUNDLE_WHEELS.txt"

  mkdir -p "$outdir"
  local name="tilelang-0.1.15-${abi}-${platforms[0]}.tar.xz"
  tar -C "$work/site" -cf - . | xz -9 -T0 > "$outdir/$name"
  echo "wheels: $(du -sh "$work/wheels" | cut -f1)  unpacked: $(du -sh "$work/site" | cut -f1)  bundle: $(du -h "$outdir/$name" | cut -f1)" >&2
  echo "$outdir/$name"
}

cmd_install() {
  [[ $# -eq 2 ]] || usage
  local tarball=$1 dest=$2
  [[ -f $tarball ]] || die "install: no such bundle '$tarball'"
  # Version-specific wheels (tag cpXY-cpXY) only import on that CPython: refuse a mismatch up front.
  local wheels wanted node
  wheels=$(tar -xJOf "$tarball" ./BUNDLE_WHEELS.txt) \
    || die "install: '$tarball' has no BUNDLE_WHEELS.txt (not a bundle of this script?)"
  # none (abi3 / pure wheels only) is fine: grep's "no match" must not end the script under pipefail
  wanted=$(grep -o -- '-cp[0-9]*-cp[0-9]*-' <<<"$wheels" | cut -d- -f2 | sort -u || true)
  node=$(${PYTHON:-python3} -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")') \
    || die "install: cannot run ${PYTHON:-python3} (set PYTHON to the node's interpreter)"
  [[ -z $wanted || $wanted == "$node" ]] \
    || die "install: '$tarball' is built for $wanted, ${PYTHON:-python3} here is $node (build one with --python-version)"
  mkdir -p "$dest"
  tar -C "$dest" -xJf "$tarball"
  [[ -d $dest/tilelang ]] || die "install: '$tarball' holds no tilelang package"
  dest=$(cd "$dest" && pwd)
  # shellcheck disable=SC2016  # ${PYTHONPATH...} is for the shell that evaluates the printed line
  printf 'export PYTHONPATH=%q${PYTHONPATH:+:$PYTHONPATH}\n' "$dest"
}

[[ $# -ge 1 ]] || usage
sub=$1; shift
case $sub in
  build) cmd_build "$@" ;;
  install) cmd_install "$@" ;;
  *) usage ;;
esac
