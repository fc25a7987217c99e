"""Summarise an Nsight Compute --csv --page details dump: every kernel with its duration, all metrics of the attention kernels."""
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr = None
data = collections.OrderedDict()
for r in rows:
    if r and r[0] == "ID":
        hdr = r; continue
    if hdr is None or len(r) < 15:
        continue
    d = dict(zip(hdr, r))  # rows without a rule stop after "Metric Value"
    key = (d["ID"], d["Kernel Name"][:60])
    data.setdefault(key, []).append((d["Section Name"], d["Metric Name"], d["Metric Unit"], d["Metric Value"]))
for (i, name), ms in data.items():
    dur = [m for m in ms if m[1] == "Duration"]
    print(f"== {i} {name} {dur[0][3] if dur else ''} {dur[0][2] if dur else ''}")
    if any(s in name for s in ("bwd_kernel", "backward", "_fwd_kernel", "forward", "flex", "fprop", "dgrad")):
        for s, m, u, v in ms:
            print(f"   {m} [{u}] = {v}")
