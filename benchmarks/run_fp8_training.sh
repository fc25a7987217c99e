#!/usr/bin/env bash
# The training runs of issue 29 (examples/train_fp8.py) within a time budget: BF16 and FP8 block / token at
# seeds 0 and 1 (the seed-to-seed noise of each), and the leaking configuration; more seeds on request.
#
#   bash benchmarks/run_fp8_training.sh [BUDGET_SECONDS [RUNS_DIR]]      (default 540 s, out/fp8-train)
#   EXTRA="--steps 20" bash benchmarks/run_fp8_training.sh 120 /tmp/smoke   (extra flags for every run)
#   ONLY="bf16-s0 fp8-block" bash benchmarks/run_fp8_training.sh               (only these runs, in this order)
#   ONLY="bf16-s2 fp8-block-s2 fp8-token-s2" PARALLEL=3 bash benchmarks/run_fp8_training.sh
#
# Run names: the seven defaults (bf16-s0 fp8-leak fp8-block fp8-token bf16-s1 fp8-block-s1 fp8-token-s1;
# fp8-block / fp8-token are seed 0) or ATTN-sN for ATTN in bf16, fp8-block, fp8-token and any seed N.
# PARALLEL=N runs up to N at once on the one GPU (the 6-layer model leaves it mostly idle; time the
# tokens/s of each against a lone run before trusting the gain). Each run gets --max-minutes = the time
# left when it starts, so the script returns inside the budget with every run checkpointed; running it
# again resumes the unfinished ones and skips the complete ones. After each run its log.jsonl and
# summary.json are copied to $OUT/<run>/ when $OUT is set (the device tool's folder that comes back; the
# checkpoints are too large to come back and stay in RUNS_DIR). Set FLAMIA_COMMIT to the commit when the
# tree has no .git. Then, on any machine with matplotlib:
#   python benchmarks/plot_fp8_training.py RUNS_DIR/* --markdown
set -u
BUDGET=${1:-540}
DIR=${2:-out/fp8-train}
PY=${PYTHON:-python}
PARALLEL=${PARALLEL:-1}
export PYTHONPATH=${PYTHONPATH:-.}
case "$BUDGET" in ''|*[!0-9]*) echo "error: BUDGET_SECONDS must be a positive integer (seconds), got '$BUDGET'" >&2; exit 2;; esac
[ "$BUDGET" -ge 1 ] || { echo "error: BUDGET_SECONDS must be >= 1, got '$BUDGET'" >&2; exit 2; }
END=$((SECONDS + BUDGET))
case "$PARALLEL" in ''|*[!0-9]*|0) echo "error: PARALLEL must be a positive integer, got '$PARALLEL'" >&2; exit 2;; esac
if [ -e "$DIR" ] && [ ! -d "$DIR" ]; then
  echo "error: RUNS_DIR $DIR exists and is not a directory (the runs' checkpoints and logs go in it)" >&2; exit 2
fi
mkdir -p "$DIR" || { echo "error: cannot create RUNS_DIR $DIR" >&2; exit 2; }
RUNS=("bf16-s0|--attn bf16 --seed 0" "fp8-leak|--attn fp8-leak" "fp8-block|--attn fp8-block"
      "fp8-token|--attn fp8-token" "bf16-s1|--attn bf16 --seed 1" "fp8-block-s1|--attn fp8-block --seed 1"
      "fp8-token-s1|--attn fp8-token --seed 1")
if [ -n "${ONLY:-}" ]; then
  SEL=()
  for want in $ONLY; do
    found=0
    for r in "${RUNS[@]}"; do [ "${r%%|*}" = "$want" ] && SEL+=("$r") && found=1; done
    if [ "$found" = 0 ] && [[ "$want" =~ ^(bf16|fp8-block|fp8-token)-s([0-9]+)$ ]]; then
      SEL+=("$want|--attn ${BASH_REMATCH[1]} --seed ${BASH_REMATCH[2]}") && found=1
    fi
    if [ "$found" = 0 ]; then
      echo "error: ONLY names an unknown run '$want' (runs: bf16-s0 fp8-leak fp8-block fp8-token bf16-s1 fp8-block-s1" \
           "fp8-token-s1, or ATTN-sN with ATTN in bf16, fp8-block, fp8-token)" >&2
      exit 2
    fi
  done
  RUNS=("${SEL[@]}")
fi

run_one() {  # name, flags, seconds left: one run, its tail, its logs to $OUT; exit code 1 if it failed
  local name=$1 flags=$2 left=$3 rc
  echo "== $name: python examples/train_fp8.py $flags ${EXTRA:-} --out $DIR/$name (${left} s left)"
  $PY examples/train_fp8.py $flags ${EXTRA:-} --out "$DIR/$name" --max-minutes "$(awk "BEGIN{print ($left - 5) / 60}")" \
    > "$DIR/$name.console" 2>&1
  rc=$?
  { grep -v "^\s*$" "$DIR/$name.console" | tail -n 14 | sed "s/^/[$name] /"
    if [ "$rc" != 0 ]; then echo "== $name: FAILED (exit $rc; the whole output: $DIR/$name.console)"; fi; }
  if [ -n "${OUT:-}" ] && [ -f "$DIR/$name/log.jsonl" ]; then
    mkdir -p "$OUT/$name" && cp "$DIR/$name/log.jsonl" "$OUT/$name/" && cp -f "$DIR/$name/summary.json" "$OUT/$name/" 2>/dev/null
  fi
  [ "$rc" = 0 ]
}

FAILED=0
running=0
for r in "${RUNS[@]}"; do
  name=${r%%|*}
  flags=${r#*|}
  if grep -qs '"complete": true' "$DIR/$name/summary.json"; then echo "== $name: complete"; continue; fi
  while [ "$running" -ge "$PARALLEL" ]; do
    wait -n || FAILED=$((FAILED + 1))
    running=$((running - 1))
  done
  left=$((END - SECONDS))
  if [ "$left" -lt 45 ]; then echo "== $name: not started (${left} s left of the budget)"; continue; fi
  run_one "$name" "$flags" "$left" &
  running=$((running + 1))
done
while [ "$running" -gt 0 ]; do
  wait -n || FAILED=$((FAILED + 1))
  running=$((running - 1))
done
echo "== $(( SECONDS )) s used"
if [ "$FAILED" != 0 ]; then echo "== $FAILED run(s) failed" >&2; exit 1; fi
