"""Compile the Gluon attention kernels for sm_90a WITHOUT a GPU: errors, shared memory, registers, spills,
and whether ptxas keeps the wgmma products asynchronous.

    PYTHONPATH=. python benchmarks/probes/gluon_compile_report.py '[{"KIND": "dkdv", "BM": 64, "STAGES": 2},
        {"KIND": "dq", "BM": 128, "BN": 64, "STAGES": 3, "GROUP": 4}]'

Keys: KIND (dkdv | dq | fwd | fp8_fwd | fp8_bwd), D, BM, BN, STAGES, GROUP (GQA),
DQ_REDUCE (dkdv: dQ partials by TMA bulk reduce, GluonBwdConfig.dq_reduce), PERSISTENT (dkdv / dq), PINGPONG
(fwd / fp8_fwd: the partitions take turns, as the long-row config ships; off by default, as small_fwd_pers), CAUSAL (fwd /
fp8_fwd), PV_PROMOTE (fp8_fwd), QK_LO (fp8_fwd / fp8_bwd), PV_LO (fp8_fwd / fp8_bwd), COLD_CALL (fp8_bwd), dump (writes
/tmp/gluon_dkdv.{ptx,ttgir,sass}). Uses triton's bundled ptxas / cuobjdump like
attention_compile_report.py; registers are the launch allocation (maxnreg), the consumers run at
240 after setmaxnreg. The last column lists the loops that touch local memory (spill traffic that
runs per iteration: ptxas's spill bytes count spill sites, not where they run;
``gluon_compile.sass_loops``); "steps" lists the key-tile step loops
(``gluon_compile.mma_step_loops``: static instructions, wgmma instructions, LDL, STL each; the forward
kernels: per consumer partition the mask-free loop, then the masked one); "chains" their longest dependent
FMNMX / FADD chains and the latency-weighted register path (``gluon_compile.loop_chains``, a screen).
"""
import json, re, sys

from flamia_pack.kernels.gluon_compile import compile_sm90, loop_chains, mma_step_loops, sass_loops


def run(D=128, BM=None, BN=None, STAGES=None, GROUP=1, dump=False, KIND="dkdv", CAUSAL=True,
        DQ_REDUCE=False, PERSISTENT=False, PINGPONG=False, PV_PROMOTE=False, QK_LO=False,
        COLD_CALL=False, PV_LO=False):
    name = (f"{KIND} D{D} BM{BM or 'default'} BN{BN or 'default'} S{STAGES or 'default'} G{GROUP}"
            f"{' persistent' if PERSISTENT else ''}"
            f"{' pingpong' if PINGPONG and KIND in ('fwd', 'fp8_fwd') else ''}"
            f"{' pv_promote' if PV_PROMOTE and KIND == 'fp8_fwd' else ''}{' qk_lo' if QK_LO else ''}"
            f"{' cold_call' if COLD_CALL else ''}{' pv_lo' if PV_LO else ''}"
            f"{' dq_reduce' if DQ_REDUCE else ''}{' noncausal' if KIND in ('fwd', 'fp8_fwd') and not CAUSAL else ''}")
    try:
        r = compile_sm90(KIND, head_dim=D, block_m=BM, block_n=BN, stages=STAGES, group=GROUP,
                         causal=CAUSAL, dq_reduce=DQ_REDUCE, persistent=PERSISTENT, pingpong=PINGPONG,
                         **({"pv_promote": True} if PV_PROMOTE else {}), **({"qk_lo": True} if QK_LO else {}),
                         **({"cold_call": True} if COLD_CALL else {}), **({"pv_lo": True} if PV_LO else {}))
    except Exception as e:
        print(f"{name}: COMPILE ERROR {type(e).__name__}: {str(e)[:3000]}")
        return
    if dump:
        for ext in ("ptx", "ttgir", "sass"):
            with open(f"/tmp/gluon_dkdv.{ext}", "w") as f:
                f.write(r[ext])
    info = " ".join(l.strip() for l in r["ptxas"].splitlines() if "registers" in l or "spill" in l or "rror" in l)
    ops = {op: len(re.findall(op, r["sass"])) for op in ("HGMMA", "QGMMA", "UTMALDG", "UTMAREDG", "LDL", "STL", "SYNCS", "USETMAXREG", "BAR.SYNC")}
    hot = [(lp["instructions"], lp["ldl"], lp["stl"]) for lp in sass_loops(r["sass"]) if lp["ldl"] or lp["stl"]]
    steps = [(lp["instructions"], lp["gmma"], lp["ldl"], lp["stl"]) for lp in mma_step_loops(r["sass"])]
    chains = [tuple(loop_chains(r["sass"], lp).values()) for lp in mma_step_loops(r["sass"])]
    print(f"{name}: smem {r['shared']} | wgmma {'SERIALIZED' if r['serialized'] else 'async'} | {info} | {ops}"
          f" | steps {steps} | chains (FMNMX, FADD, path clk) {chains}"
          f" | loops with local memory (instructions, LDL, STL): {hot or 'none'}")


if __name__ == "__main__":
    for cfg in json.loads(sys.argv[1]) if len(sys.argv) > 1 else [{}]:
        run(**cfg)
