#!/usr/bin/env bash
# Nsight Compute on the served kernels of the 256-sequence decode step (benchmarks/ncu_targets.py): for each, the
# speed-of-light summary, the warps' stall reasons (sampled) and the SASS lines where most samples fell. Writes
# $OUT/ncu_<name>_{details,stalls}.txt (the reports, raw and source CSVs and logs too with KEEP=1: the device call brings
# back a limited number of files).
# `step`: every kernel of one graphed 256-sequence decode step (decode_step_bound.py --ncu-range), per kernel name.
#   OUT=$OUT ./benchmarks/ncu_stalls.sh mla experts step   (on the GPU host; PYTHONPATH as gpu_pending.sh sets it)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="$(realpath -m "${OUT:-out/ncu}")"
mkdir -p "$OUT"
profile() {  # profile NAME KERNEL_REGEX ARGS...: the launch after NCU_SKIP (2) of the kernel (experts: gate/up, down alternate)
  local name=$1 regex=$2; shift 2
  timeout "${NCU_TIMEOUT:-150}" ncu -k "regex:$regex" -s "${NCU_SKIP:-2}" -c 1 --set full --import-source yes -f -o "$OUT/ncu_$name" \
    python3 benchmarks/ncu_targets.py "$@" > "$OUT/ncu_$name.log" 2>&1 || { tail -5 "$OUT/ncu_$name.log"; return; }
  ncu --import "$OUT/ncu_$name.ncu-rep" --page details > "$OUT/ncu_${name}_details.txt" 2>&1
  grep -E 'Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|L2 Hit' \
    "$OUT/ncu_${name}_details.txt" | sed "s/^/$name /"
  ncu --import "$OUT/ncu_$name.ncu-rep" --page raw --csv > "$OUT/ncu_${name}_raw.csv" 2>&1
  python3 - "$OUT/ncu_${name}_raw.csv" "$name" <<'PY' | tee "$OUT/ncu_${name}_stalls.txt"
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head, values = rows[0], rows[-1]
stalls = {h.replace("smsp__pcsamp_warps_issue_stalled_", ""): float(v.replace(",", "") or 0)
          for h, v in zip(head, values) if h.startswith("smsp__pcsamp_warps_issue_stalled_") and not h.endswith("_not_issued")}
total = sum(stalls.values()) or 1
for key, count in sorted(stalls.items(), key=lambda kv: -kv[1])[:10]:
    print(f"{sys.argv[2]} stall {key:32s} {100 * count / total:5.1f} %")
PY
  ncu --import "$OUT/ncu_$name.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_${name}_source.csv" 2>&1
  python3 - "$OUT/ncu_${name}_source.csv" "$name" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
head = next((i for i, r in enumerate(rows) if any("Source" == c or c.startswith("Source") for c in r)), None)
if head is None:
    print(sys.argv[2], "source page: no header", rows[:2]); sys.exit()
cols = rows[head]
sample = next((i for i, c in enumerate(cols) if c.startswith("Warp Stall Sampling (All")), None)
source = next(i for i, c in enumerate(cols) if c.startswith("Source"))
if sample is None:
    print(sys.argv[2], "columns:", cols[:30]); sys.exit()
body = [r for r in rows[head + 1:] if len(r) > sample]
num = lambda r: float(r[sample].replace(",", "") or 0)
total = sum(num(r) for r in body) or 1
for r in sorted(body, key=num, reverse=True)[:25]:
    print(f"{sys.argv[2]} {100 * num(r) / total:5.1f} %  {r[source][:110]}")
PY
}
step() {  # every kernel of one replay of the graphed decode step at BATCH sequences (decode_step_bound.py's NVTX
  # range), GPU clocks left free: per kernel name, launches, µs, DRAM bytes and bandwidth, SM throughput
  local batch=${BATCH:-256}
  timeout "${NCU_TIMEOUT:-400}" ncu --nvtx --nvtx-include "ncu_step_$batch/" --clock-control none -f -o "$OUT/ncu_step$batch" \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    python3 benchmarks/decode_step_bound.py --model-dir "${MODEL_DIR:-/tmp/bench-ds3}" --batches "$batch" --context 96 \
    --iters 10 --ncu-range > "$OUT/ncu_step$batch.log" 2>&1 || { tail -5 "$OUT/ncu_step$batch.log"; return; }
  ncu --import "$OUT/ncu_step$batch.ncu-rep" --page raw --csv --print-units base > "$OUT/ncu_step${batch}_raw.csv" 2>&1
  python3 - "$OUT/ncu_step${batch}_raw.csv" <<'PY' | tee "$OUT/ncu_step${batch}_kernels.txt"
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head, units = rows[0], rows[1]
col = {name: head.index(name) for name in head}
SCALE = {"": 1, "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "ns": 1e-3, "nsecond": 1e-3, "us": 1, "usecond": 1,
         "ms": 1e3, "msecond": 1e3, "%": 1}
value = lambda r, m: float(r[col[m]].replace(",", "") or 0) * SCALE[units[col[m]]]  # bytes, µs, %
by_name = {}
for r in rows[2:]:
    if len(r) < len(head):
        continue
    name = r[col["Kernel Name"]][:70]
    entry = by_name.setdefault(name, [0, 0.0, 0.0, 0.0])
    entry[0] += 1
    us = value(r, "gpu__time_duration.sum")
    entry[1] += us
    entry[2] += (value(r, "dram__bytes_read.sum") + value(r, "dram__bytes_write.sum")) / 1e6  # MB
    entry[3] += value(r, "sm__throughput.avg.pct_of_peak_sustained_elapsed") * us
total_us = sum(e[1] for e in by_name.values())
total_mb = sum(e[2] for e in by_name.values())
print(f"kernels {sum(e[0] for e in by_name.values())}, {total_us:.1f} us serialised, {total_mb:.1f} MB DRAM, "
      f"{total_mb / total_us:.2f} TB/s")
for name, (n, us, mb, sm) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]:
    print(f"{us:8.1f} us {n:4d}x {mb:8.1f} MB {mb / us if us else 0:5.2f} TB/s  SM {sm / us if us else 0:5.1f} %  {name}")
PY
}
trap '[ -n "${KEEP:-}" ] || rm -f "$OUT"/ncu_*_raw.csv "$OUT"/ncu_*_source.csv "$OUT"/*.ncu-rep "$OUT"/*.log' EXIT
for target in "$@"; do
  case "$target" in
    mla) profile mla _mla_decode_kernel --kernel mla --batch "${BATCH:-256}" ;;
    experts) profile experts _grouped_gemm_row_tile_kernel --kernel experts --batch "${BATCH:-256}" ;;
    experts_down) NCU_SKIP=3 profile experts_down _grouped_gemm_row_tile_kernel --kernel experts --batch "${BATCH:-256}" ;;
    step) step ;;
    experts_skewed) profile experts_skewed _grouped_gemm_row_tile_kernel --kernel experts --batch "${BATCH:-256}" --skewed ;;
  esac
done
