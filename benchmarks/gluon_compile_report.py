"""Compile the Gluon attention kernels for sm_90a WITHOUT a GPU: errors, shared memory, registers, spills,
and whether ptxas keeps the wgmma products asynchronous.

    PYTHONPATH=. python benchmarks/gluon_compile_report.py '[{"KIND": "dkdv", "BM": 64, "STAGES": 2},
        {"KIND": "dq", "BM": 128, "BN": 64, "STAGES": 3, "GROUP": 4}]'

Keys: KIND (dkdv | dq | fwd), D, BM, BN, STAGES, PARTS (consumer partitions, dkdv/dq), GROUP (GQA),
RETIRE (dkdv: bwd_gluon_retire_first), CAUSAL (fwd), dump (writes
/tmp/gluon_dkdv.{ptx,ttgir,sass}). Uses triton's bundled ptxas / cuobjdump like
attention_compile_report.py; registers are the launch allocation (maxnreg), the consumers run at
240 after setmaxnreg.
"""
import os, re, subprocess, sys, tempfile, json
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from flamia_pack.kernels import gluon_attention as G

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")

def run(D=128, BM=None, BN=None, STAGES=None, PARTS=1, GROUP=1, dump=False, KIND="dkdv", CAUSAL=True, RETIRE=False):
    # defaults: the shipped tiles of each kind (gluon_dkdv / gluon_dq)
    BM = BM or (64 if KIND == 'dkdv' else 128)
    BN = BN or {'dkdv': 128, 'dq': 64, 'fwd': 128}[KIND]
    STAGES = STAGES or {'dkdv': 2, 'dq': 3, 'fwd': 2}[KIND]
    q = torch.zeros(256, 16, D, dtype=torch.bfloat16)
    kd = mangle_type(G._descriptor(q, BN)); qd = mangle_type(G._descriptor(q, BM))
    fn = {'dkdv': G._dkdv_kernel, 'dq': G._dq_kernel, 'fwd': G._fwd_kernel}[KIND]
    if KIND in ('dq', 'fwd'): kd, qd = mangle_type(G._descriptor(q, BN)), mangle_type(G._descriptor(q, BM))
    types = {"q_desc": qd, "do_desc": qd, "k_desc": kd, "v_desc": kd, "LSE": "*fp32", "DELTA": "*fp32",
             "DK": "*bf16", "DV": "*bf16", "DQ": "*bf16", "O": "*bf16", "items_ptr": "*i32", "num_items_ptr": "*i32", "cu_ptr": "*i32",
             "qk_scale": "fp32", "sm_scale": "fp32"}
    consts = dict(GROUP=GROUP, HEAD_DIM=D, BLOCK_M=BM, WL_BM=128, STAGES=STAGES, BLOCK_N=BN, PARTS=PARTS, RETIRE_FIRST=RETIRE)
    if KIND == 'fwd':
        consts = dict(GROUP=GROUP, HEAD_DIM=D, BLOCK_M=BM, BLOCK_N=BN, WL_BM=128, STAGES=STAGES, CAUSAL=CAUSAL)
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n.startswith("stride")}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    total = 12
    maxnreg = (65536 // (total * 32)) // 8 * 8
    name = f"{KIND} D{D} BM{BM} BN{BN} S{STAGES} P{PARTS} G{GROUP}{' retire' if RETIRE and KIND == 'dkdv' else ''}{' noncausal' if KIND == 'fwd' and not CAUSAL else ''} maxnreg{maxnreg}"
    try:
        k = triton.compile(src, target=TARGET, options={"num_warps": 8 // PARTS, "maxnreg": maxnreg})
    except Exception as e:
        print(f"{name}: COMPILE ERROR {type(e).__name__}: {str(e)[:3000]}")
        return
    ptx = k.asm["ptx"]
    if dump:
        open("/tmp/gluon_dkdv.ptx", "w").write(ptx); open("/tmp/gluon_dkdv.ttgir", "w").write(k.asm["ttgir"])
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx"); open(p, "w").write(ptx)
        r = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", p, "-o", os.path.join(d, "k.o")], capture_output=True, text=True)
        info = " ".join(l.strip() for l in r.stderr.splitlines() if "registers" in l or "spill" in l or "rror" in l)
        serialized = "wgmma SERIALIZED" if "serialized" in r.stderr else "wgmma async"
        sass = subprocess.run([os.path.join(os.path.dirname(PTXAS), "cuobjdump"), "-sass", os.path.join(d, "k.o")], capture_output=True, text=True).stdout
        if dump: open("/tmp/gluon_dkdv.sass", "w").write(sass)
    ops = {op: len(re.findall(op, sass)) for op in ("HGMMA", "UTMALDG", "LDL", "STL", "SYNCS", "USETMAXREG", "BAR.SYNC")}
    print(f"{name}: smem {k.metadata.shared} | {serialized} | {info} | {ops}")

if __name__ == "__main__":
    for cfg in json.loads(sys.argv[1]) if len(sys.argv) > 1 else [{}]:
        run(**cfg)
