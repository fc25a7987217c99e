"""Compile the attention kernels for sm_90 WITHOUT a GPU and print their resource report.

    PYTHONPATH=. python benchmarks/probes/attention_compile_report.py ['{"D": 128, "fwd": [[BM, BN, warps, stages, persistent(, maxnreg)]],
        "bwd": [[M1, N1, M2, N2, warps, stages, {optional: MASKED_STAGES, GROUP}]], "misc": true}']

Uses triton's own ptxas/cuobjdump (shipped in the triton wheel) on the CPU development machine:
compile errors, shared memory, registers, spill bytes and counts of HGMMA (wgmma), LDGSTS
(cp.async pipelining), LDL/STL (local memory) per configuration. Pointer and stride arguments are
marked divisible by 16, as the launcher's specialization does at run time (without that the
loads are not vectorized and nothing is pipelined). This is how the defaults of
kernels/config.py were screened before spending device time (benchmarks/NOTES.md).
"""
import os, re, subprocess, sys, tempfile, json
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from flamia_pack.kernels import flash_fwd as F, flash_bwd as B
from flamia_pack.kernels.gluon_compile import sass_loops  # spill traffic per loop

TARGET = GPUTarget("cuda", 90, 32)
DIV16 = {"stride", "T", "total_rows"}
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")

def sig(fn, types, consts):
    names = fn.arg_names
    s = {}
    for n in names:
        if n in consts:
            s[n] = "constexpr"
        else:
            s[n] = types.get(n, "i32")
    return s

def report(name, fn, types, consts, nw, ns, maxnreg=0):
    sg = sig(fn, types, consts)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sg[n].startswith("*") or n.startswith("stride") or n in DIV16}
    src = ASTSource(fn=fn, signature=sg, constexprs=consts, attrs=attrs)
    try:
        k = triton.compile(src, target=TARGET, options={"num_warps": nw, "num_stages": ns,
                                                        **({"maxnreg": maxnreg} if maxnreg else {})})
    except Exception as e:
        print(f"{name}: COMPILE ERROR {type(e).__name__}: {str(e)[:2000]}")
        return
    ptx = k.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx"); open(p, "w").write(ptx)
        r = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", p, "-o", os.path.join(d, "k.o")], capture_output=True, text=True)
        info = " ".join(l.strip() for l in r.stderr.splitlines() if "registers" in l or "spill" in l)
        sass = subprocess.run([os.path.join(os.path.dirname(PTXAS), "cuobjdump"), "-sass", os.path.join(d, "k.o")], capture_output=True, text=True).stdout
    ops = {op: len(re.findall(op, sass)) for op in ("HGMMA", "HMMA", "LDGSTS", "UTMALDG", "LDL", "STL", r"RED\.E\.ADD\.F32", r"RED\.E\.ADD\.F32\S*\.64", r"RED\.E\.ADD\.F32\S*\.128", "UTMAREDG")}
    hot = [(lp["instructions"], lp["ldl"], lp["stl"]) for lp in sass_loops(sass) if lp["ldl"] or lp["stl"]]
    print(f"{name}: smem {k.metadata.shared} | {info} | {ops} | loops with local memory (instructions, LDL, STL): "
          f"{hot or 'none'}")

ptr = {n: "*bf16" for n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")}
ptr.update({"LSE": "*fp32", "DELTA": "*fp32", "DQACC": "*fp32", "dq_desc": "tensordesc<fp32[32,128]>", "DLSE": "*fp32", "items_ptr": "*i32", "order_ptr": "*i32", "num_items_ptr": "*i32", "cu_ptr": "*i32", "counter_ptr": "*i32",
            "qk_scale": "fp32", "sm_scale": "fp32", "value": "fp32", "X": "*bf16"})
cfgs = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
D = int(cfgs.get("D", 128))
for bm, bn, nw, ns, pers, *mr in cfgs.get("fwd", [(128, 64, 8, 3, False)]):  # optional 6th: maxnreg (fwd_maxnreg)
    report(f"fwd D{D} {bm}x{bn} w{nw} s{ns} pers={pers}{f' maxnreg={mr[0]}' if mr else ''}", F._fwd_kernel, ptr,
           dict(HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, F=128 // bm, WL_BM=128, CAUSAL=True, PERSISTENT=pers, HEAD_MAJOR=not pers), nw, ns,
           mr[0] if mr else 0)
for m1, n1, m2, n2, nw, ns, *extra in cfgs.get("bwd", [(64, 128, 128, 64, 8, 2)]):
    # optional 7th entry: {"MASKED_STAGES": s, "GROUP": H_q // H_kv}
    kc = {**dict(GROUP=1, MASKED_STAGES=ns), **(extra[0] if extra else {})}
    report(f"bwd D{D} m1={m1} n1={n1} m2={m2} n2={n2} w{nw} s{ns} {extra[0] if extra else ''}", B._bwd_kernel, ptr,
           dict(HEAD_DIM=D, BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2, BLOCK_N2=n2, F1=128 // n1, F2=128 // m2, WL_BM=128, CAUSAL=True, **kc), nw, ns)
if cfgs.get("misc", True):
    for zero in (False, True):
        report(f"preprocess ZERO_DQ={zero}", B._bwd_preprocess, {**ptr, "DQ_ACC": "*fp32", "CU": "*i32"},
               dict(HAS_DLSE=False, BLOCK=64, HEAD_DIM=D, ZERO_DQ=zero), 4, 1)
    report("dq_reduce_cast", B._dq_reduce_cast, {**ptr, "DQ_ACC": "*fp32", "CU": "*i32", "sm_scale": "fp32"},
           dict(BLOCK=64, HEAD_DIM=D, ZERO_AFTER=True), 4, 1)
    report("fill_tails (o, lse)", F._fill_tails_kernel, {**ptr, "X0": "*bf16", "X1": "*fp32", "X2": "*bf16",
           **{f"value{i}": "fp32" for i in range(3)}}, dict(NUM=2, BLOCK_R=64, BLOCK_C0=256, BLOCK_C1=32, BLOCK_C2=256), 4, 1)
