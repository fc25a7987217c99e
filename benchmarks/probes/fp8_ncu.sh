#!/bin/bash
# Nsight Compute of an FP8 kernel on one workload row: warp-state stall reasons and the SASS
# instructions with the most stall samples (what limits the kernel).
#   bash benchmarks/probes/fp8_ncu.sh W1              # the forward kernel (_fp8_fwd_kernel)
#   PASS=bwd bash benchmarks/probes/fp8_ncu.sh W1     # the backward kernel (_fp8_bwd_kernel, block mode)
NCU=${NCU:-/usr/local/cuda/bin/ncu}
WL=${1:-W1}
OUT=${OUT:-/tmp}
PASS=${PASS:-fwd}
case "$PASS" in
  fwd) KERNEL=_fp8_fwd_kernel ;;
  bwd) KERNEL=_fp8_bwd_kernel ;;
  *) echo "error: PASS must be fwd or bwd, got '$PASS'" >&2; exit 2 ;;
esac
cat > /tmp/fp8_ncu_run.py <<PY
import torch
from benchmarks.probes.fp8_fwd_probe import _row
from flamia_pack.kernels.fp8_attention import build_fp8_work_list, fp8_attention_forward, fp8_quantize
from flamia_pack.scheduler.workloads import workload_lengths
lens = workload_lengths("$WL")
q, k, v, cu = _row(lens, 16, 4 if "$WL" == "W5" else 16)
if "$PASS" == "fwd":
    ops = fp8_quantize(q, k, v, cu); wl = build_fp8_work_list(cu, q.shape[0])
    run = lambda: fp8_attention_forward(ops, cu, work_list=wl)
else:
    from benchmarks.probes.fp8_bwd_probe import _kernel_only
    do = torch.randn_like(q)
    run = _kernel_only(q, k, v, do, cu)
for _ in range(3):
    run()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
run()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
PY
PYTHONPATH=. timeout 300 "$NCU" --profile-from-start off --kernel-name regex:$KERNEL --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  --section SourceCounters --import-source no -f -o "$OUT/fp8rep" python3 /tmp/fp8_ncu_run.py > /dev/null 2>&1
"$NCU" -i "$OUT/fp8rep.ncu-rep" --page details --csv 2>/dev/null | python3 -c "
import csv, sys
for r in csv.reader(sys.stdin):
    if len(r) > 14 and r[0] != 'ID':
        print(r[-4][:60], '|', r[-3][:50], '|', r[-2], r[-1])
" | grep -iv "^$" | head -90
"$NCU" -i "$OUT/fp8rep.ncu-rep" --page source --csv --print-source sass 2>/dev/null > "$OUT/fp8src.csv"
python3 benchmarks/probes/ncu_stalls.py "$OUT/fp8src.csv"
