#!/usr/bin/env bash
# The example LM trained with each attention implementation for the same steps, same seed:
#   scripts/train_compare.sh OUT_DIR [STEPS] [IMPLS...]      (default 300 steps, fa3 cudnn)
# Needs jax_fa3 installed (scripts/gpu_cycle.sh with SKIP_SANITIZE=1 SKIP_TESTS=1 SKIP_BENCH=1 builds it).
# OUT_DIR/<impl>/ gets metrics.jsonl, loss.png and summary.json; OUT_DIR/train_<impl>.log the
# run's output. Checkpoints go to /tmp (a 125M model with AdamW state is ~1.5 GB).
# Knobs: PRESET (default h200-125m), RUN_TIMEOUT (seconds per run, default 240).
set -uo pipefail
OUT=${1:?usage: scripts/train_compare.sh OUT_DIR [STEPS] [IMPLS...]}
STEPS=${2:-300}
shift $(( $# >= 2 ? 2 : $# ))
IMPLS=("$@")
[ ${#IMPLS[@]} -eq 0 ] && IMPLS=(fa3 cudnn)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
status=0
for impl in "${IMPLS[@]}"; do
  echo "== $impl: ${PRESET:-h200-125m}, $STEPS steps"
  timeout "${RUN_TIMEOUT:-240}" python3 -P examples/train_llm.py --preset "${PRESET:-h200-125m}" \
    --attention "$impl" --steps "$STEPS" --warmup-steps $(( STEPS / 10 )) --eval-every $(( STEPS / 3 )) \
    --ckpt-every 0 --no-progress --out-dir "$OUT/$impl" --ckpt-dir "/tmp/ckpt_$impl" \
    >"$OUT/train_$impl.log" 2>&1 || { status=1; echo "$impl: run failed or timed out"; }
  tail -4 "$OUT/train_$impl.log"
done
exit $status
