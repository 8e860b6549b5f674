# Sourced (not run) by scripts/build_variant.sh and scripts/prebuild_wheel.sh: what a named build
# variant builds and from where, in one place.
#   variant_env NAME
# checks NAME, exports FA3_HEAD_DIMS / FA3_DTYPES / FA3_DIRECTIONS from the same knob with _NAME
# appended where that is set (e.g. FA3_HEAD_DIMS_h64="64" narrows variant h64), and sets
# variant_src to the variant's source tree: VARIANT_SRC_NAME, default the current directory.
variant_env() {
  local name=$1 knob own src
  [[ "$name" =~ ^[A-Za-z0-9_-]+$ ]] || { echo "bad variant name '$name'" >&2; return 2; }
  for knob in FA3_HEAD_DIMS FA3_DTYPES FA3_DIRECTIONS; do
    own=${knob}_$name
    [ -z "${!own:-}" ] || export "$knob=${!own}"
  done
  src=VARIANT_SRC_$name
  variant_src=${!src:-.}
}
