#!/bin/bash
# Kernel durations, DRAM and L2 throughput (Nsight Compute, SpeedOfLight) of our kernels in one
# training call, per workload row and kernel config, for A/B runs of two trees on the GPU machine.
#
#   SPECS="W7:small_fwd_pers W3:default" KERNELS="_fwd_kernel" COUNT=2 bash benchmarks/probes/ncu_kernel_times.sh TREE
#
# TREE: a checkout (e.g. `git archive <commit> | tar -x -C ab/base`; `.` for this one). SPECS: WORKLOAD:CONFIG
# pairs, CONFIG a kernels.config CANDIDATES name or `default` (the max_seqlen rule). KERNELS: ncu's
# --kernel-name regex (`_fwd_kernel`, or `_dkdv_kernel|_dq_kernel` for the backward). COUNT: launches
# profiled per call. Prints one line per spec: `ID:Dura=<ns> ID:DRAM=<%> ID:L2 C=<%>` per launch.
# ncu runs with --clock-control none (the clocks the benchmarks see); used in benchmarks/RESULTS.md
# (2026-11-30 (third) run 3, (fourth) runs 2-3).
NCU=${NCU:-/usr/local/cuda/bin/ncu}
SPECS=${SPECS:-"W7:default W3:default W1:default W8:default"}
KERNELS=${KERNELS:-_fwd_kernel}
COUNT=${COUNT:-2}
HERE=$(cd "$(dirname "$0")" && pwd)   # this checkout's probes; the profiled package is TREE's
cd "${1:?usage: ncu_kernel_times.sh TREE}" || exit 2
for spec in $SPECS; do
  wl=${spec%%:*}; cfg=${spec#*:}; [ "$cfg" = default ] && cfg=""
  FLAMIA_ATTN_CONFIG=$cfg PYTHONPATH=. timeout 120 "$NCU" --profile-from-start off --clock-control none \
    --kernel-name regex:"$KERNELS" --launch-count "$COUNT" --section SpeedOfLight --csv --page details \
    python3 "$HERE/ncu_bwd_profile.py" --workload "$wl" --impls ours 2>/dev/null | SPEC="$spec" python3 -c "
import csv, os, sys
rows = [r for r in csv.reader(sys.stdin) if len(r) >= 15]
out = []
if rows:
    h = rows[0]
    for r in rows[1:]:
        d = dict(zip(h, r))
        if d['Metric Name'] in ('Duration', 'DRAM Throughput', 'L2 Cache Throughput'):
            out.append(d['ID'] + ':' + d['Metric Name'][:4] + '=' + d['Metric Value'])
print(os.environ['SPEC'], ' '.join(out) or '(no kernel profiled)')"
done
