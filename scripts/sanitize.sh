#!/usr/bin/env bash
# compute-sanitizer over every op: memcheck, synccheck, racecheck and initcheck, each one run of
# scripts/sanitize_workload.py (the ops on small shapes, every result checked against the
# reference). The `sanitize` stage of scripts/gpu_check.sh; alone:
#   scripts/sanitize.sh [OUT_DIR]    (default $OUT, else /tmp/flash_epilogue_out)
# Writes OUT_DIR/sanitize.json ({commit, date, gpu, <tool>: {runs, errors, ...}, ok}) and
# OUT_DIR/sanitize_logs.tgz (one log per tool). Exit status 1 unless every tool ran to the end
# with 0 errors and every configuration matched the reference.
#
# What runs (scripts/sanitize_workload.py --list --tool T prints it):
#   memcheck, synccheck: the full set (48 configurations: store at every head dim 64..256 batched
#     and varlen+seqused, store_zero, atomic and deterministic gqa_accumulate + postprocess +
#     to_dense, gqa_reduce, the _arch=80 path);
#   racecheck, initcheck: a reduced set (14 configurations: every op, both paths, swapAB head dims,
#     varlen+seqused, deterministic mode), because they are several times slower per kernel.
# memcheck, synccheck and racecheck instrument our kernels only (--kernel-name
# kns=epilogue_device_kernel, every driver's entry point): torch's own kernels are not ours to
# check and would cost most of the time. initcheck instruments every kernel, because the writes of
# an uninstrumented kernel (torch filling the inputs) would be invisible to it; the workload never
# reads memory it did not initialize (outputs canary-filled, inputs views whose surrounding padding
# is left uninitialized on purpose), so a report there means one of our kernels read memory
# outside its inputs (or a torch kernel did: the log names the kernel, and sanitize.json counts
# the reports in our kernels separately).
#
# Knobs: SANITIZE_TOOLS (default memcheck,synccheck,racecheck,initcheck), SANITIZE_BUDGET_S
# (default 290: the stage's wall-time budget; each run gets min(its cap, what is left) and runs
# left without time are recorded as skipped), SANITIZE_ALL_KERNELS=1 (no kernel filter),
# SANITIZE_EXTRA_ARGS (more compute-sanitizer options), COMPUTE_SANITIZER (its path; default
# $CUDA_HOME/bin, then PATH, then /usr/local/cuda/bin).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/flash_epilogue_out}}
COMMIT=${FLASH_EPILOGUE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
TOOLS=${SANITIZE_TOOLS:-memcheck,synccheck,racecheck,initcheck}
BUDGET=${SANITIZE_BUDGET_S:-290}
mkdir -p "$OUT"
LOGDIR=$(mktemp -d /tmp/sanitize_logs.XXXXXX)
RUNS="$LOGDIR/runs.tsv"
: > "$RUNS"

CS=${COMPUTE_SANITIZER:-}
if [ -z "$CS" ]; then
  for c in "${CUDA_HOME:-/nonexistent}/bin/compute-sanitizer" "$(command -v compute-sanitizer 2>/dev/null)" \
           /usr/local/cuda/bin/compute-sanitizer; do
    if [ -n "$c" ] && [ -x "$c" ]; then CS=$c; break; fi
  done
fi

# per-run caps in seconds (the budget bounds their sum)
declare -A CAP=([memcheck]=110 [synccheck]=70 [racecheck]=70 [initcheck]=70)
export PYTORCH_NO_CUDA_MEMORY_CACHING=1  # every tensor its own allocation: exact bounds for memcheck/initcheck
export CUDA_MODULE_LOADING=LAZY PYTHONUNBUFFERED=1
start=$(date +%s)

if [ -z "$CS" ]; then
  echo "sanitize: compute-sanitizer not found (COMPUTE_SANITIZER, \$CUDA_HOME/bin, PATH, /usr/local/cuda/bin)"
else
  "$CS" --version > "$LOGDIR/version.txt" 2>&1
  IFS=, read -ra tool_list <<< "$TOOLS"
  for tool in "${tool_list[@]}"; do
    left=$(( BUDGET - ($(date +%s) - start) ))
    cap=${CAP[$tool]:-70}
    if (( left < 20 )); then
      printf '%s\tskipped\t0\t0\n' "$tool" >> "$RUNS"
      echo "sanitize: $tool skipped (budget of ${BUDGET} s spent)"
      continue
    fi
    limit=$(( cap < left ? cap : left ))
    filter=(--kernel-name kns=epilogue_device_kernel)
    if [ "$tool" = initcheck ] || [ "${SANITIZE_ALL_KERNELS:-0}" = 1 ]; then filter=(); fi
    t0=$(date +%s)
    # shellcheck disable=SC2086 (SANITIZE_EXTRA_ARGS is a list of options)
    timeout --kill-after=10 "$limit" "$CS" --tool "$tool" "${filter[@]}" --report-api-errors no \
      --check-exit-code no --print-limit 100 ${SANITIZE_EXTRA_ARGS:-} \
      python3 scripts/sanitize_workload.py --tool "$tool" > "$LOGDIR/$tool.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - t0 ))
    printf '%s\t%s\t%s\t%s\n' "$tool" "$rc" "$secs" "$limit" >> "$RUNS"
    summary=$(grep -h 'ERROR SUMMARY' "$LOGDIR/$tool.log" | tail -1)
    echo "sanitize: $tool: exit $rc after $secs s (limit $limit s); $summary"
  done
fi

python3 - "$OUT" "$COMMIT" "$LOGDIR" "${CS:-}" "$BUDGET" "$start" "${SANITIZE_ALL_KERNELS:-0}" <<'PY'
import datetime, json, os, re, subprocess, sys, time

out, commit, logdir, cs, budget, start, all_kernels = sys.argv[1:8]
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30).stdout.strip().splitlines()[0]
except Exception:  # noqa: BLE001
    gpu = "unknown"
summary = {"commit": commit, "date": datetime.date.today().isoformat(), "gpu": gpu, "compute_sanitizer": None,
           "budget_s": int(budget), "elapsed_s": int(time.time()) - int(start),
           "env": {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, "logs": "sanitize_logs.tgz"}
if not cs:
    summary["error"] = "compute-sanitizer not found"
else:
    try:
        version = open(os.path.join(logdir, "version.txt")).read().strip().splitlines()
        summary["compute_sanitizer"] = version[-1] if version else None
    except OSError:
        pass
ok = bool(cs)
runs_path = os.path.join(logdir, "runs.tsv")
for line in open(runs_path).read().splitlines() if os.path.exists(runs_path) else []:
    tool, rc, secs, limit = line.split("\t")
    entry = {"runs": 0, "errors": None}
    if rc == "skipped":
        entry["skipped"] = "no time left in the budget"
        summary[tool] = entry
        ok = False
        continue
    log = open(os.path.join(logdir, f"{tool}.log"), errors="replace").read()
    m = re.findall(r"ERROR SUMMARY: (\d+) errors?", log)
    entry["errors"] = int(m[-1]) if m else None
    # reports: a "========= <header>" line, then its indented "=========     <detail>" lines
    reports, cur = [], None
    for ln in log.splitlines():
        if not ln.startswith("========="):
            continue
        body = ln[len("========="):]
        if not body.strip():
            cur = None
        elif body.startswith("  "):
            if cur is not None:
                cur.append(body.strip())
        elif body.strip().startswith(("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY")):
            cur = None
        else:
            cur = [body.strip()]
            reports.append(cur)
    entry["reports"] = len(reports)
    entry["reports_in_our_kernels"] = sum(1 for r in reports if any("epilogue_device_kernel" in ln for ln in r))
    entry["first_reports"] = [" | ".join(r[:3]) for r in reports[:5]]
    race = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", log)
    if race:
        entry["hazards"], race_errors, entry["hazard_warnings"] = (int(x) for x in race[-1])
        if entry["errors"] is None:  # racecheck prints its own summary line instead of ERROR SUMMARY
            entry["errors"] = race_errors
    done = re.findall(r"^\[(\d+)/(\d+)\] (ok|FAILED)", log, flags=re.M)
    entry["runs"] = len(done)  # op configurations run under the tool
    entry["configs_failed"] = sum(1 for d in done if d[2] == "FAILED")
    total = re.findall(r"^\[\d+/(\d+)\] ", log, flags=re.M)
    entry["configs_total"] = int(total[0]) if total else None
    entry["seconds"] = int(secs)
    entry["limit_s"] = int(limit)
    entry["timed_out"] = rc in ("124", "137")
    entry["exit"] = int(rc)
    entry["kernel_filter"] = ("none" if tool == "initcheck" or all_kernels == "1"
                              else "kns=epilogue_device_kernel")
    summary[tool] = entry
    ok = ok and entry["errors"] == 0 and not entry["timed_out"] and entry["configs_failed"] == 0 \
        and entry["runs"] == entry["configs_total"] and rc == "0"
summary["ok"] = ok
with open(os.path.join(out, "sanitize.json"), "w") as f:  # a line per entry: compact and diffable
    f.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in summary.items()) + "\n}\n")
print(json.dumps(summary, indent=1))
sys.exit(0 if ok else 1)
PY
status=$?
tar czf "$OUT/sanitize_logs.tgz" -C "$LOGDIR" . 2>/dev/null
rm -rf "$LOGDIR"
exit $status
