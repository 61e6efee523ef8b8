#!/usr/bin/env bash
# The GPU check: run from the repository root on a lent GPU machine, after `make gpu-kit` here.
#
#   scripts/gpu_check.sh [--dry-run] [--part 1|2|all] [--steps "b a d e c"] [--budget SECONDS] [OUTDIR]
#
# Installs .gpu-kit offline over the machine's own torch (pip --no-index --no-deps --target), then
# runs each step under `timeout`, going on past a failing one:
#   (b) engine vs HF greedy on CUDA, with and without CUDA graphs   scripts/gpu_greedy.py
#   (e) offline throughput, Llama-3-8B shapes, random bf16 weights  scripts/gpu_throughput.py
#   (d) decode attention per backend vs torch_native                 scripts/gpu_attention.py
#   (a) pytest -m gpu over the test files of tests/ and plugins/ that hold a gpu mark, then the
#       unmarked files whose tests run on the GPU when there is one (GPU_DEVICE_TESTS)
#   (c) benchmarks/cuda_graphs.py at batch 1/32/128
# and writes OUTDIR (default $OUT, else ./gpu-check-out): gpu-report.md (one page), gpu-results.json
# and gpu-check.log (every step's output): three files, within what a lent machine sends back.
# --part 1 runs kit, b, e, c; --part 2 runs kit, d, a (two calls of under 10 minutes each); the
# default runs all of them within --budget seconds (default 570: one 10-minute call), each step's
# timeout cut to what is left.
# --steps runs the steps named, in the order named (after the kit), instead of --part's.
# --dry-run (a CPU machine): checks the kit against its manifest and the 60 MiB cap, installs its
# wheels into a temporary folder (the cp312 binaries with pip's --platform/--python-version), and
# writes the report with every GPU step skipped for the reason found; exit 1 only if the kit fails.
# --rehearse (a CPU machine, for this script's own plumbing): every step runs, on the CPU and small
# (--device cpu, a tiny model; pytest's gpu tests skip, cuda_graphs.py says it needs CUDA).
# Environment: PYTHON (default python3), GPU_KIT (default .gpu-kit), GPU_THROUGHPUT_ARGS (more
# arguments for step (e); default "--overlap --profile 10", empty for none), GPU_PYTEST_ARGS (more for step (a)'s pytest, e.g.
# "-n 8" with pytest-xdist), GPU_DEVICE_TESTS (step (a)'s unmarked files).
set -u
cd "$(dirname "$0")/.."

DRY=0 REHEARSE=0 STEPS_ARG="" PART=all BUDGET=${GPU_CHECK_BUDGET:-570} OUTDIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --rehearse) REHEARSE=1 ;;
    --part) PART=$2; shift ;;
    --part=*) PART=${1#--part=} ;;
    --budget) BUDGET=$2; shift ;;
    --budget=*) BUDGET=${1#--budget=} ;;
    --steps) STEPS_ARG=$2; shift ;;
    --steps=*) STEPS_ARG=${1#--steps=} ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1" >&2; exit 2 ;;
    *) OUTDIR=$1 ;;
  esac
  shift
done
# the steps in the order they run, and the longest each may take (then cut to what is left)
T_B=130 T_E=170 T_D=70 T_A=300 T_C=150
case "$PART" in
  1) STEPS="b e c" T_C=240 ;;
  2) STEPS="d a" T_A=420 ;;
  all) STEPS="b e d a c" ;;
  *) echo "gpu_check.sh: --part takes 1, 2 or all" >&2; exit 2 ;;
esac
if [ -n "$STEPS_ARG" ]; then  # the steps named, in that order (e.g. --steps "b a d")
  STEPS=$(echo "$STEPS_ARG" | tr ',' ' ')
  for id in $STEPS; do
    case "$id" in b|e|d|a|c) ;; *) echo "gpu_check.sh: --steps takes b, e, d, a, c" >&2; exit 2 ;; esac
  done
fi

OUTDIR=${OUTDIR:-${OUT:-gpu-check-out}}
PY=${PYTHON:-python3}
KIT=${GPU_KIT:-.gpu-kit}
mkdir -p "$OUTDIR"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
LOG=$OUTDIR/gpu-check.log
: > "$LOG"
START=$(date +%s)
REPORT_RESERVE=15
export PYTHONUNBUFFERED=1

title() {
  $PY -c "import sys; sys.path[:0] = ['scripts']; import gpu_report as r; print(r.TITLES['$1'])"
}

# run_step ID SECONDS [--parse KIND] -- COMMAND...: bounded by min(SECONDS, what is left)
run_step() {
  local id=$1 want=$2 parse=()
  shift 2
  if [ "$1" = "--parse" ]; then parse=(--parse "$2"); shift 2; fi
  [ "$1" = "--" ] && shift
  local left=$(( BUDGET - REPORT_RESERVE - ($(date +%s) - START) ))
  local t=$(( want < left ? want : left ))
  local name; name=$(title "$id")
  if [ "$t" -lt 20 ]; then
    $PY scripts/gpu_report.py skip --work "$WORK" --id "$id" --title "$name" \
      --reason "no time left in the ${BUDGET} s budget (run it with --part)" | tee -a "$LOG"
    return
  fi
  echo "=== [$id] $name: timeout ${t}s: $*" | tee -a "$LOG"
  local s; s=$(date +%s)
  timeout --kill-after=10 "$t" "$@" > "$WORK/$id.log" 2>&1
  local rc=$?
  cat "$WORK/$id.log" >> "$LOG"
  $PY scripts/gpu_report.py record --work "$WORK" --id "$id" --title "$name" --rc "$rc" \
    --seconds $(( $(date +%s) - s )) --timeout "$t" "${parse[@]}" | tee -a "$LOG"
}

# ---- the kit ---------------------------------------------------------------------------------
kit_step() {
  local s; s=$(date +%s)
  local rc=0
  {
    echo "=== [kit] $(title kit) (${KIT})"
    if [ ! -f "$KIT/MANIFEST.json" ]; then
      echo "no $KIT/MANIFEST.json: run 'make gpu-kit' on the CPU machine and carry $KIT"
      rc=3
      local why="no $KIT/MANIFEST.json: run make gpu-kit on the CPU machine and carry $KIT"
      [ "$DRY" = 0 ] && why="$why (own wheels built here instead; no third-party wheels)"
      $PY scripts/gpu_report.py note --work "$WORK" --id kit --status fail --reason "$why"
      if [ "$DRY" = 0 ]; then  # go on with this repository's own wheels, built here offline
        echo "building this repository's own wheels here (no third-party wheels)"
        KIT=$WORK/kit
        $PY scripts/gpu_kit.py build --own-only --kit "$KIT" > /dev/null || rc=1
      fi
    fi
    if [ -f "$KIT/MANIFEST.json" ]; then
      $PY scripts/gpu_kit.py verify --kit "$KIT" --json "$WORK/kit-verify.json" || rc=1
      if [ "$DRY" = 1 ]; then
        $PY scripts/gpu_kit.py install --kit "$KIT" --target "$WORK/site" --dry-run \
          --json "$WORK/kit-install.json" || rc=1
      else
        $PY scripts/gpu_kit.py install --kit "$KIT" --target "$WORK/site" \
          --json "$WORK/kit-install.json" || rc=1
      fi
    fi
  } > "$WORK/kit.log" 2>&1
  if [ "$DRY" = 0 ] && [ -d "$WORK/site" ]; then
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
    {
      $PY scripts/gpu_kit.py unmet --kit "$KIT" --json "$WORK/kit-unmet.json"
      echo "--- engine plugins"
      timeout 60 $PY -c "from engine_cli.main import cli; cli(['plugins'])"
    } >> "$WORK/kit.log" 2>&1
  fi
  cat "$WORK/kit.log" >> "$LOG"
  $PY scripts/gpu_report.py record --work "$WORK" --id kit --title "$(title kit)" --rc "$rc" \
    --seconds $(( $(date +%s) - s )) --timeout 0 --parse kit | tee -a "$LOG"
  return $rc
}

KIT_RC=0
kit_step || KIT_RC=$?

# "1" where torch sees a CUDA device, else what it found instead
HAS_CUDA=$($PY scripts/gpu_report.py env --work "$WORK" 2>>"$LOG" | tail -n 1)
REASON=""
SMALL_B=() SMALL_E=() SMALL_D=()
if [ "$REHEARSE" = 1 ]; then
  SMALL_B=(--device cpu --backends torch_native --new-tokens 4)
  SMALL_E=(--device cpu --preset tiny --batch-sizes 1,4 --steps 3 --prompt-len 16)
  SMALL_D=(--device cpu --backends cpu --batch 4 --layers 1 --steps 2 --max-ctx 128)
elif [ "$HAS_CUDA" != 1 ]; then
  REASON="no CUDA device present: ${HAS_CUDA:-torch did not answer}"
elif [ "$DRY" = 1 ]; then
  REASON="dry run (a CUDA device is present: run without --dry-run)"
fi

GPU_TEST_FILES=$(grep -rlE --include='test_*.py' 'mark\.gpu' tests plugins 2>/dev/null | sort |
  tr '\n' ' ')
# unmarked tests that run on the GPU when torch sees one (on a CPU: Triton's interpreter)
GPU_DEVICE_TESTS=${GPU_DEVICE_TESTS:-plugins/attention_triton/tests tests/test_moe_triton.py
  tests/test_fused_triton.py}
# (e) also measures the overlap scheduler at batch 1 and profiles 10 steps a batch size
GPU_THROUGHPUT_ARGS=${GPU_THROUGHPUT_ARGS---overlap --profile 10}
PYTEST_TIMEOUT=""
$PY -c "import pytest_timeout" 2>/dev/null && PYTEST_TIMEOUT="--timeout=120"
PYTEST="$PY -m pytest -q -p no:cacheprovider --continue-on-collection-errors $PYTEST_TIMEOUT \
  ${GPU_PYTEST_ARGS:-}"

for id in $STEPS; do
  if [ -n "$REASON" ]; then
    $PY scripts/gpu_report.py skip --work "$WORK" --id "$id" --title "$(title "$id")" \
      --reason "$REASON" | tee -a "$LOG"
    continue
  fi
  case "$id" in
    b) run_step b $T_B -- $PY scripts/gpu_greedy.py --json "$WORK/b.json" "${SMALL_B[@]}" ;;
    e) run_step e $T_E -- $PY scripts/gpu_throughput.py --json "$WORK/e.json" "${SMALL_E[@]}" \
         $GPU_THROUGHPUT_ARGS ;;
    d) run_step d $T_D -- $PY scripts/gpu_attention.py --json "$WORK/d.json" "${SMALL_D[@]}" ;;
    a) run_step a $T_A --parse pytest -- bash -c "$PYTEST -m gpu --junitxml=$WORK/a1.xml \
         $GPU_TEST_FILES; $PYTEST --junitxml=$WORK/a2.xml $GPU_DEVICE_TESTS" ;;
    c) run_step c $T_C --parse cuda_graphs -- $PY benchmarks/cuda_graphs.py \
         --batch-sizes 1,32,128 --steps 30 ;;
  esac
done

MODE=gpu
[ "$DRY" = 1 ] && MODE=dry-run
[ "$REHEARSE" = 1 ] && MODE="rehearsal on the CPU"
[ "$PART" != all ] && MODE="$MODE, part $PART"
$PY scripts/gpu_report.py report --work "$WORK" --out "$OUTDIR" --kit "$KIT" --mode "$MODE" \
  >> "$LOG" 2>&1
echo "=== report: $OUTDIR/gpu-report.md ($(( $(date +%s) - START )) s in all)" | tee -a "$LOG"
cat "$OUTDIR/gpu-report.md"
if [ "$DRY" = 1 ] && [ "$KIT_RC" != 0 ]; then
  exit 1
fi
exit 0
