#!/usr/bin/env bash
# The GPU check, for anyone with an sm_90 GPU (H100/H200), run from the repository root with torch, nvcc and the
# CUTLASS headers installed (scripts/install.sh sets them up):
#   scripts/gpu_check.sh                     build in place, then the whole test suite
#   scripts/gpu_check.sh test,bench_ops      any stages, comma-separated
# Results go to $OUT (default /tmp/flash_epilogue_out), labelled with the git commit (else $FLASH_EPILOGUE_COMMIT).
# Stages:
#   build       the extension in place (MAX_JOBS, default 16), with the sm_80 code path that the tests run on the GPU
#               (FLASH_EPILOGUE_SM80_PATH, default 1 here) -> build.log
#   test        pytest, GPU tests included (TEST_FILES, default tests; TEST_ARGS, more pytest options split on
#               spaces, e.g. "-x"; TEST_TIMEOUT_S; TEST_MAXFAIL, default 30) -> junit.xml, tests.log, gpu_tests.json
#   no_kernels  the test command without the kernels, as a pure-Python install runs it (FLASH_EPILOGUE_DISABLE_KERNELS=1;
#               no build needed), on this machine's torch: where that is the oldest torch pyproject.toml claims, the
#               claim's check -> no_kernels.log, no_kernels.json (TEST_ARGS, TEST_TIMEOUT_S as for test)
#   sanitize    scripts/sanitize.sh: compute-sanitizer over every op -> sanitize.json (budget SANITIZE_BUDGET_S)
#   bench_host  benchmarks/bench_host.py: the wrappers' host time -> host_time.json
#   bench_ops   benchmarks/bench_ops.py: every op against its baselines -> h200.json/csv/png (BENCH_OPS_ARGS)
#   fa3         scripts/fa3_check.py: FlashAttention-3 as is and with the drop-in header (FA3_DIR: FA3's sources)
# GPU_CHECK_DEADLINE_S: the seconds the whole script may take; test, bench_ops and sanitize shrink to fit.
set -uo pipefail
STAGES=${1:-build,test}
COMMIT=${FLASH_EPILOGUE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/flash_epilogue_out}
mkdir -p "$OUT"
export FLASH_EPILOGUE_COMMIT=$COMMIT PYTHONUNBUFFERED=1
[ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ] && export CUDA_HOME=/usr/local/cuda
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
status=0
has() { [[ ",$STAGES," == *",$1,"* ]]; }
# fits_in NEED CAP prints min(CAP, what is left before GPU_CHECK_DEADLINE_S less a 15 s margin) and
# fails when that is under NEED, so a stage that cannot finish is skipped instead of cut off mid-way.
fits_in() {
  local need=$1 cap=$2
  [ -z "${GPU_CHECK_DEADLINE_S:-}" ] && { echo "$cap"; return 0; }
  local left=$(( GPU_CHECK_DEADLINE_S - SECONDS - 15 ))
  (( left < cap )) && cap=$left
  echo "$cap"
  (( cap >= need ))
}

if has build; then
  start=$(date +%s)
  if ! FLASH_EPILOGUE_SM80_PATH=${FLASH_EPILOGUE_SM80_PATH:-1} MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext \
       --inplace > "$OUT/build.log" 2>&1; then
    echo "BUILD FAILED"; tail -50 "$OUT/build.log"; exit 1
  fi
  echo "build: $(( $(date +%s) - start )) s"
fi

if has test && ! TEST_TIMEOUT_S=$(fits_in 60 "${TEST_TIMEOUT_S:-1800}"); then
  echo "test: skipped, ${TEST_TIMEOUT_S} s left before GPU_CHECK_DEADLINE_S"
elif has test; then
  # A hung test (a deadlocked spin-wait) must not take the rest of the call with it. SIGINT first:
  # pytest then still prints the failures so far and writes junit.xml (a SIGTERM'd run leaves
  # neither). TEST_MAXFAIL stops a run whose every test fails (a poisoned process) early, with the
  # first tracebacks in tests.log.
  rm -f "$OUT/junit.xml"
  # shellcheck disable=SC2086 (TEST_FILES and TEST_ARGS are lists)
  timeout -s INT -k 20 "${TEST_TIMEOUT_S}" python3 -m pytest ${TEST_FILES:-tests} ${TEST_ARGS:-} -q -rs \
    -p no:cacheprovider --durations=25 --maxfail="${TEST_MAXFAIL:-30}" --junitxml="$OUT/junit.xml" \
    > "$OUT/tests.log" 2>&1
  test_rc=$?
  (( test_rc != 0 )) && status=1
  tail -15 "$OUT/tests.log"
  python3 - "$OUT" "$COMMIT" "$test_rc" <<'PY'
import datetime, json, re, sys, xml.etree.ElementTree as ET
import torch
out, commit, rc = sys.argv[1], sys.argv[2], int(sys.argv[3])
summary = {"commit": commit, "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__}
try:
    suite = ET.parse(f"{out}/junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    summary.update(passed=total - failed - errors - skipped, failed=failed + errors, skipped=skipped)
except FileNotFoundError:
    # No report: pytest crashed, or was killed at TEST_TIMEOUT_S (rc 124/137) inside a call that ignored SIGINT.
    # Count what its progress lines show ('.' passed, 's' skipped, anything else failed), and say it was cut.
    marks = "".join(m.group(1) for m in re.finditer(r"^([.sxXFE]+)\s*(?:\[\s*\d+%\])?$",
                                                   open(f"{out}/tests.log").read(), re.M))
    summary.update(passed=marks.count("."), failed=sum(map(marks.count, "FEX")), skipped=sum(map(marks.count, "sx")),
                   interrupted=f"no junit.xml (pytest rc {rc}): counted from the progress of the {len(marks)} "
                   "tests that finished; the rest did not run")
json.dump(summary, open(f"{out}/gpu_tests.json", "w"), indent=1)
print(summary)
PY
fi

if has no_kernels; then
  # shellcheck disable=SC2086 (TEST_ARGS is a list)
  FLASH_EPILOGUE_DISABLE_KERNELS=1 timeout -s INT -k 20 "$(fits_in 30 "${TEST_TIMEOUT_S:-1800}")" python3 -m pytest tests \
    ${TEST_ARGS:-} -q -p no:cacheprovider > "$OUT/no_kernels.log" 2>&1
  rc=$?
  (( rc != 0 )) && status=1
  tail -3 "$OUT/no_kernels.log"
  python3 -c "import json, sys, torch; json.dump({'commit': sys.argv[1], 'torch': torch.__version__, 'rc': int(sys.argv[2]),
    'summary': open(sys.argv[3]).read().strip().splitlines()[-1]}, open(sys.argv[4], 'w'), indent=1)" \
    "$COMMIT" "$rc" "$OUT/no_kernels.log" "$OUT/no_kernels.json"
fi

if has sanitize; then
  export SANITIZE_BUDGET_S=$(fits_in 0 "${SANITIZE_BUDGET_S:-290}")
  [ -n "${GPU_CHECK_DEADLINE_S:-}" ] && echo "sanitize budget: ${SANITIZE_BUDGET_S} s"
  bash scripts/sanitize.sh "$OUT" || status=1
fi

if has bench_host; then
  python3 benchmarks/bench_host.py --json "$OUT/host_time.json" 2>&1 | tee "$OUT/bench_host.log" || status=1
fi

if has bench_ops && ! BENCH_TIMEOUT_S=$(fits_in 120 "${BENCH_TIMEOUT_S:-400}"); then
  echo "bench_ops: skipped, ${BENCH_TIMEOUT_S} s left before GPU_CHECK_DEADLINE_S (it needs about 110)"
elif has bench_ops; then
  # Bounded like the tests: a kernel that hangs must leave the call's other results to come back.
  # shellcheck disable=SC2086 (BENCH_OPS_ARGS is a list of options)
  timeout -s INT -k 30 "${BENCH_TIMEOUT_S}" python3 benchmarks/bench_ops.py --out "$OUT" --commit "$COMMIT" \
    ${BENCH_OPS_ARGS:-} 2>&1 | tee "$OUT/bench_ops.log" || status=1
fi
if has fa3; then
  # shellcheck disable=SC2086 (FA3_CHECK_ARGS is a list of options)
  python3 scripts/fa3_check.py --fa3 "${FA3_DIR:-.fa3}" --work "${FA3_WORK:-/tmp/fa3_check}" \
    --out "$OUT/fa3_check.json" --jobs "${MAX_JOBS:-16}" ${FA3_CHECK_ARGS:-} 2>&1 | tee "$OUT/fa3_check.log" || status=1
  (cd "${FA3_WORK:-/tmp/fa3_check}" && tail -c 20000 compat.build.log > "$OUT/fa3_compat_build.log" 2>/dev/null; true)
fi
exit $status
