"""Compile the Gluon attention kernels for sm_90a WITHOUT a GPU: errors, shared memory, registers, spills,
and whether ptxas keeps the wgmma products asynchronous.

    PYTHONPATH=. python benchmarks/gluon_compile_report.py '[{"KIND": "dkdv", "BM": 64, "STAGES": 2},
        {"KIND": "dq", "BM": 128, "BN": 64, "STAGES": 3, "GROUP": 4}]'

Keys: KIND (dkdv | dq | fwd), D, BM, BN, STAGES, GROUP (GQA),
RETIRE (dkdv: bwd_gluon_retire_first, default on as shipped), DQ_REDUCE (dkdv: dQ partials by TMA
bulk reduce, bwd_gluon_dq_reduce), CAUSAL (fwd), dump (writes
/tmp/gluon_dkdv.{ptx,ttgir,sass}). Uses triton's bundled ptxas / cuobjdump like
attention_compile_report.py; registers are the launch allocation (maxnreg), the consumers run at
240 after setmaxnreg.
"""
import json, re, sys

from flamia_pack.kernels.gluon_attention import compile_sm90


def run(D=128, BM=None, BN=None, STAGES=None, GROUP=1, dump=False, KIND="dkdv", CAUSAL=True, RETIRE=True,
        DQ_REDUCE=False):
    name = (f"{KIND} D{D} BM{BM or 'default'} BN{BN or 'default'} S{STAGES or 'default'} G{GROUP}"
            f"{' retire' if RETIRE and KIND == 'dkdv' else ''}{' dq_reduce' if DQ_REDUCE else ''}{' noncausal' if KIND == 'fwd' and not CAUSAL else ''}")
    try:
        r = compile_sm90(KIND, head_dim=D, block_m=BM, block_n=BN, stages=STAGES, group=GROUP,
                         causal=CAUSAL, retire_first=RETIRE, dq_reduce=DQ_REDUCE)
    except Exception as e:
        print(f"{name}: COMPILE ERROR {type(e).__name__}: {str(e)[:3000]}")
        return
    if dump:
        for ext in ("ptx", "ttgir", "sass"):
            with open(f"/tmp/gluon_dkdv.{ext}", "w") as f:
                f.write(r[ext])
    info = " ".join(l.strip() for l in r["ptxas"].splitlines() if "registers" in l or "spill" in l or "rror" in l)
    ops = {op: len(re.findall(op, r["sass"])) for op in ("HGMMA", "UTMALDG", "UTMAREDG", "LDL", "STL", "SYNCS", "USETMAXREG", "BAR.SYNC")}
    print(f"{name}: smem {r['shared']} | wgmma {'SERIALIZED' if r['serialized'] else 'async'} | {info} | {ops}")


if __name__ == "__main__":
    for cfg in json.loads(sys.argv[1]) if len(sys.argv) > 1 else [{}]:
        run(**cfg)
