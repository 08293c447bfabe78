#!/usr/bin/env bash
# One command for a fresh GPU machine: kspec's GPU checks from a checkout plus prebuilt artifacts.
#
#   bench/gpu_check.sh [SUMMARY_FILE]          (default: $OUT/summary.txt, else ./gpu_check_summary.txt)
#
# Needs only Python with numpy, torch and cuda-python; no network, nothing kspec-specific installed,
# no nvcc.  Artifacts come prebuilt from a CPU machine (`python bench/prebuild.py --wheels`, which
# writes bench/prebuilt/ for sm90a and sm100a and the wheels of lark/networkx/ml_dtypes/pytest into
# .whl/); modules missing here are installed from .whl/ into a temporary folder, offline.
# Steps (each time-boxed; the whole run stays under 10 minutes on one H200):
#   1. pytest -m "gpu and not nvcc": the GPU tests that need no compiler (tests/test_prebuilt_gpu.py),
#   2. kspec selftest on every prebuilt artifact (reference comparison at several sizes + torch bench),
#   3. bench/bench.py --quick on the prebuilt artifacts,
#   4. the issues' benchmarks on the prebuilt artifacts (decode attention, RoPE, derived backwards).
# The summary file lists pass/fail per spec, each step's time and rc, and the benchmark ratios.
# Exit status: 0 all passed; 1 a failure; 3 no usable CUDA device (summary says so).
# Rehearsal on a CPU machine: KSPEC_GPU_CHECK_FAKE=sm90a|sm100a runs step 2 as `kspec selftest
# --fake` (launch-ABI checks, no numbers) and skips the steps that need a device.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
SUMMARY="${1:-${OUT:+$OUT/summary.txt}}"
SUMMARY="${SUMMARY:-$ROOT/gpu_check_summary.txt}"
PREBUILT="${KSPEC_PREBUILT:-$ROOT/bench/prebuilt}"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d /tmp/kspec-gpu-check.XXXXXX)"
START=$(date +%s)
mkdir -p "$(dirname "$SUMMARY")"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

note "kspec gpu_check $(date -u +%FT%TZ) on $(hostname)"
note "python: $($PY -c 'import sys; print(sys.version.split()[0])' 2>&1)"

# kspec from this checkout: the package maps top-level folders under `kspec` (pyproject.toml), so
# lay them out as one package of symlinks instead of installing anything.
mkdir -p "$WORK/src/kspec"
for f in "$ROOT"/kspec/*; do ln -s "$f" "$WORK/src/kspec/$(basename "$f")"; done
ln -s "$ROOT/spec_lang" "$WORK/src/kspec/spec_lang"
ln -s "$ROOT/compiler" "$WORK/src/kspec/compiler"
ln -s "$ROOT/backends" "$WORK/src/kspec/backends"
ln -s "$ROOT/specs" "$WORK/src/kspec/specs"
export PYTHONPATH="$WORK/src${PYTHONPATH:+:$PYTHONPATH}"
# run Python from outside the checkout, so `import kspec` finds the mapped package, not ./kspec
cd "$WORK"

# offline dependencies: only what is missing, only from carried wheels (pytest's own needs included)
for pair in lark:lark networkx:networkx ml_dtypes:ml_dtypes pytest:pytest iniconfig:iniconfig pluggy:pluggy \
            packaging:packaging; do
  m=${pair%%:*}; w=${pair##*:}
  $PY -c "import $m" 2>/dev/null && continue
  wheel=$(ls "$ROOT"/.whl/"$w"-*.whl 2>/dev/null | head -n 1)
  if [ -n "$wheel" ] && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" \
       "$wheel" >>"$WORK/pip.log" 2>&1; then
    note "installed $m from $(basename "$wheel") (offline)"
  else
    note "warning: python module $m is missing and no carried wheel installs here (python bench/prebuild.py --wheels)"
  fi
done
export PYTHONPATH="$PYTHONPATH:$WORK/site"

FAKE="${KSPEC_GPU_CHECK_FAKE:-}"
[ -n "$FAKE" ] && note "rehearsal: fake driver for $FAKE (no GPU used; launch-ABI checks only)"

# a device?
$PY - <<'PYEOF' >"$WORK/device.txt" 2>&1
import sys
try:
    from kspec.runtime import cuda_available
except Exception as e:
    print(f"device: not checked, kspec does not import: {type(e).__name__}: {e}")
    sys.exit(1)
ok, why = cuda_available()
print("device: ok" if ok else f"device: none ({why})")
sys.exit(0 if ok else 3)
PYEOF
rc=$?
note "$(cat "$WORK/device.txt")"
if [ $rc -ne 0 ] && [ -z "$FAKE" ]; then
  if [ $rc -eq 3 ]; then note "result: NO GPU - nothing was run"; else note "result: FAIL - setup"; rc=1; fi
  note "total time: $(( $(date +%s) - START ))s"
  rm -rf "$WORK"
  exit $rc
fi

status=0
step() {  # step NAME SECONDS CMD...  -> runs with a time box, logs to $WORK/NAME.log
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  timeout --signal=TERM --kill-after=10 "$secs" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  note "step $name: rc=$rc time=${dt}s$([ $rc -eq 124 ] && echo ' (TIMED OUT)')"
  [ $rc -ne 0 ] && status=1
  return 0
}

# 1. GPU tests that need no compiler (the reference comparison itself is step 2)
export KSPEC_PREBUILT="$PREBUILT"
[ -n "$FAKE" ] && note "step pytest_gpu: skipped (rehearsal)" || step pytest_gpu 60 $PY -m pytest -q -m "gpu and not nvcc" -p no:cacheprovider -k "not test_prebuilt_matches_reference" \
  "$ROOT/tests/test_prebuilt_gpu.py"
[ -f "$WORK/pytest_gpu.log" ] && tail -n 3 "$WORK/pytest_gpu.log" | sed 's/^/  /' | tee -a "$SUMMARY"

# 2. selftest on every prebuilt artifact
arts=()
for d in "$PREBUILT"/*/; do [ -f "$d/manifest.json" ] && arts+=("${d%/}"); done
if [ ${#arts[@]} -eq 0 ]; then
  note "step selftest: no prebuilt artifacts in $PREBUILT (run python bench/prebuild.py on a CPU machine)"
  status=1
else
  step selftest 200 $PY -m kspec selftest "${arts[@]}" --reps 10 --json "$WORK/selftest.json" ${FAKE:+--fake "$FAKE"}
  $PY - "$WORK/selftest.json" <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"  selftest wrote no results ({e})"); raise SystemExit(0)
per = {}
for c in r["checks"]:
    a = per.setdefault(c["artifact"], [0, 0, 0.0, [], "", 0])
    a[0 if c["ok"] else 1] += 1
    a[2] += c["seconds"]
    a[5] += bool(c.get("open"))
    if c.get("risk") and not c["variant"].endswith("=0"):
        a[4] = c["risk"]
    if not c["ok"]:
        a[3].append(f'{c["kernel"]}/{c["sizes"]}/{c["variant"]}: {c["detail"]}')
for art, (ok, bad, secs, why, risk, opened) in sorted(per.items()):
    more = f", {opened} open" if opened else ""
    print(f"  {'PASS' if not bad else 'FAIL'} {art:<28} {ok} passed, {bad} failed{more}, {secs:.1f}s")
    if risk:   # the issue-22 risk this artifact settles (kspec.selftest.RISKS)
        verdict = "NO" if bad else "open" if opened else "rehearsed (launch ABI only)" if r.get("fake") else "yes"
        print(f"       settles: {risk}: {verdict}")
    for w in why[:3]:
        print(f"       {w}")
for b in r["bench"]:
    if b["kspec_ms"] is None:
        print(f"  bench {b['artifact']}/{b['kernel']}: {b['note']}")
    else:
        t = f"{b['torch_ms']:.3f} ms" if b["torch_ms"] else "-"
        ratio = f"x{b['ratio']:.2f}" if b["ratio"] else "-"
        print(f"  bench {b['artifact']}/{b['kernel']}: kspec {b['kspec_ms']:.3f} ms, {b['baseline']} {t}, ratio {ratio}")
PYEOF
fi

# 3. bench/ in quick mode on the prebuilt artifacts
if [ -n "$FAKE" ]; then
  note "step bench_quick: skipped (rehearsal)"
else
  step bench_quick 100 $PY "$ROOT/bench/bench.py" --quick --reps 10 --prebuilt "$PREBUILT"
  grep -E "kspec|speed-up|failed|skipped|no CUDA" "$WORK/bench_quick.log" | sed 's/^/  /' | tee -a "$SUMMARY"
fi

# 4. the issues' own benchmarks on the prebuilt artifacts: decoding attention (issue 25), RoPE
#    (issue 23), the derived row backwards (issue 26); each prints ratios against baselines in the same run
if [ -n "$FAKE" ]; then
  note "step bench_issues: skipped (rehearsal)"
else
  step bench_decode 75 $PY "$ROOT/bench/attention_decode.py" --prebuilt "$PREBUILT" --batches 1,8,64 --kv 4096,32768 --reps 10
  grep -E "^(dense|paged|kspec|device|note)" "$WORK/bench_decode.log" | sed 's/^/  /' | tee -a "$SUMMARY"
  step bench_rope 45 $PY "$ROOT/bench/rope.py" --prebuilt "$PREBUILT" --no-compile --batches 1,8 --seqlens 4096 --reps 10
  grep -vE "^\s*$" "$WORK/bench_rope.log" | tail -n 12 | sed 's/^/  /' | tee -a "$SUMMARY"
  step bench_grad 90 $PY "$ROOT/bench/grad.py" --gpu --prebuilt "$PREBUILT" --rows 8192 --cols 4096 --reps 10
  grep -E "kspec backward|failed|Error" "$WORK/bench_grad.log" | sed 's/^/  /' | tee -a "$SUMMARY"
fi

note "total time: $(( $(date +%s) - START ))s"
note "result: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
mkdir -p "$(dirname "$SUMMARY")/gpu_check_logs" 2>/dev/null && cp "$WORK"/*.log "$WORK"/*.json "$(dirname "$SUMMARY")/gpu_check_logs/" 2>/dev/null
rm -rf "$WORK"
exit $status
