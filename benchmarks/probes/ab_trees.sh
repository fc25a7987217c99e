#!/usr/bin/env bash
# A/B of two whole trees of flamia_pack (H200): OLD (a folder holding another version's flamia_pack/,
# e.g. `git archive REV flamia_pack | tar -x -C ab/old`) vs this tree, in alternating fresh processes,
# two rounds, our op's forward and training call per workload (bench_attention.measure, rep 100).
# For changes spanning several kernel files (ab_kernel_file.py swaps one). Run from the repository root:
#   bash benchmarks/probes/ab_trees.sh ab/old        (carry ab/ to the device machine)
set -u
old=${1:?usage: ab_trees.sh OLD_TREE_DIR}
child='import json, sys, torch
sys.path.insert(0, "benchmarks")
import flamia_pack, bench_attention as B
from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths
out = {"pkg": flamia_pack.__file__}
for n in sys.argv[1].split(","):
    inp = B.make_inputs(workload_lengths(n), WORKLOADS[n]["num_heads"], WORKLOADS[n]["num_kv_heads"], seed=3, device="cuda", head_dim=int(sys.argv[2]))
    out[n] = B.measure("ours", B.ours, inp, rep=100)
print("AB " + json.dumps(out))'
for r in 1 2; do
  for tree in old new; do
    for d in 128 64; do
      wl=W2,W6,W7,S1,W1; [ $d = 64 ] && wl=W7,W1
      if [ $tree = old ]; then pp=$old; else pp=.; fi
      echo "round $r tree $tree D $d: $(PYTHONPATH=$pp timeout 200 python3 -P -c "$child" $wl $d 2>&1 | grep '^AB ')"
    done
  done
done
