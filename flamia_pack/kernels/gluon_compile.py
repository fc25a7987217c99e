"""Compile the Gluon attention kernels for sm_90a without a GPU (triton's bundled ptxas) and report
shared memory, registers, spills and whether the wgmma products stay asynchronous.

For screening a kernel change before spending device time (``benchmarks/probes/gluon_compile_report.py``
prints it) and for the CPU tests that keep the shipped kernels compiling spill-free.
"""
from __future__ import annotations

import torch

from flamia_pack.kernels.gluon_common import CONSUMER_WARPS, MAXNREG, descriptor

__all__ = ["compile_sm90", "sass_loops", "mma_step_loops", "loop_chains"]


def sass_loops(sass: str) -> list[dict]:
    """Every backward branch of a SASS listing (``cuobjdump -sass`` text) as a loop: ``start`` / ``end``
    (addresses of the branch target and of the branch), ``instructions`` (static count, both ends
    included), ``gmma`` (HGMMA / QGMMA instructions), ``ldl`` / ``stl`` (local-memory loads / stores), in
    address order of the branch. Branches after the last ``EXIT`` are left out: they end the out-of-line
    blocks (an mbarrier wait's retry) that ptxas places after the function body, not loops."""
    import re

    ins = []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    at = {a: i for i, (a, _) in enumerate(ins)}
    body_end = max((a for a, t in ins if t.split()[-1] == "EXIT"), default=ins[-1][0] if ins else 0)
    loops = []
    for i, (a, text) in enumerate(ins):
        if a > body_end:
            break
        b = re.search(r"BRA\s+(?:.*?)(0x[0-9a-f]+)", text)
        if b and int(b.group(1), 16) <= a and int(b.group(1), 16) in at:
            body = [t for _, t in ins[at[int(b.group(1), 16)]:i + 1]]
            loops.append({"start": int(b.group(1), 16), "end": a, "instructions": len(body),
                          "gmma": sum(bool(re.match(r"\S*[HQ]GMMA", t)) for t in body),
                          "ldl": sum("LDL" in t for t in body), "stl": sum("STL" in t for t in body)})
    return loops


def mma_step_loops(sass: str) -> list[dict]:
    """The innermost loops that issue wgmma products (:func:`sass_loops` entries with ``gmma > 0`` that
    hold no other such loop): the kernels' key-tile step loops, in address order. The forward kernels
    have two per consumer partition (the mask-free steps first, then the masked ones), the consumer
    partitions one after the other."""
    loops = [lp for lp in sass_loops(sass) if lp["gmma"]]
    inner = [lp for lp in loops if not any(o is not lp and lp["start"] <= o["start"] and o["end"] <= lp["end"]
                                           for o in loops)]
    return sorted(inner, key=lambda lp: lp["start"])


#: assumed dependent-issue latencies (clocks) for :func:`loop_chains`; FP32 / integer ALU ops default to 4
CHAIN_LATENCY = {"MUFU": 18, "SHFL": 24, "LDS": 30, "LDSM": 30, "LDL": 200, "LDG": 400, "F2FP": 6, "BAR": 20,
                 "SYNCS": 20}


def loop_chains(sass: str, loop: dict, ops=("FMNMX", "FADD")) -> dict:
    """Dependency chains of one loop's body (a :func:`sass_loops` entry) read as straight-line code:
    ``{op: longest chain of that op feeding itself}`` for each of ``ops`` (a row max reduced in one
    thread's registers one element after another is a chain of its length), and ``"path"``, the
    longest register-dependency path in clocks under :data:`CHAIN_LATENCY` (a screen, not a timing:
    branches, wgmma results and memory are ignored; a value's producer is its last writer before use).
    Registers are R / P / UR / UP; the first register operand of an instruction is its destination,
    except for stores and branches, which define none."""
    import re

    body = [t for o, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass)
            if loop["start"] <= int(o, 16) <= loop["end"]]
    no_dest = ("QGMMA", "HGMMA", "WARPGROUP", "BRA", "STS", "STSM", "STL", "STG", "RED", "UTMASTG", "UTMALDG")
    same = {op: {} for op in ops}
    best = {op: 0 for op in ops}
    ready, path = {}, 0
    for t in body:
        m = re.match(r"(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9]*)(\.\S+)?\s*(.*)", t)
        if not m:
            continue
        op, regs = m.group(1), re.findall(r"\b(?:UR|UP|R|P)\d+\b", m.group(3))
        if op in no_dest or not regs:
            continue
        dst, srcs = regs[0], regs[1:]
        ready[dst] = max([ready.get(x, 0) for x in srcs] + [0]) + CHAIN_LATENCY.get(op, 4)
        path = max(path, ready[dst])
        for o in ops:
            if op == o:
                same[o][dst] = 1 + max([same[o].get(x, 0) for x in srcs] + [0])
                best[o] = max(best[o], same[o][dst])
            else:
                same[o].pop(dst, None)
    return {**best, "path": path}


def compile_sm90(kind: str = "dkdv", *, head_dim: int = 128, block_m: int | None = None, block_n: int | None = None,
                 stages: int | None = None, group: int = 1, causal: bool = True, dq_reduce: bool = False,
                 persistent: bool = False, pingpong: bool = False, items_whole: bool = False,
                 wl_block_m: int = 128, part_skip: bool = False, pv_promote: bool = False,
                 masked_tile0: bool = False, deterministic: bool = False, qk_lo: bool = False,
                 cold_call: bool = False, pv_lo: bool = False) -> dict:
    """Compile one Gluon attention kernel for sm_90a and report (no GPU needed).

    Pointer and stride arguments are marked divisible by 16 as the launcher's specialization does at
    run time.

    Args:
        kind: ``"dkdv"``, ``"dq"``, ``"fwd"``, ``"fp8_fwd"`` or ``"fp8_bwd"``; the other arguments
            default to the tiles of ``gluon_dkdv`` / ``gluon_dq`` / ``gluon_fwd`` / ``gluon_fp8_fwd`` /
            ``gluon_fp8_bwd`` (the FP8 kinds: E4M3 TMA descriptors, row-major and feature-major as each
            kernel reads them, float32 factor tables of ``gluon_fp8_fwd.exponent_table``, head_dim 128).
        group: the GQA group (``H_q // H_kv``), a compile-time constant of every kernel.
        dq_reduce, persistent: the dK/dV kernel's dQ reduce and the backward kernels' persistent mode.
        pingpong, items_whole, wl_block_m, part_skip: the forward's ``gluon_fwd(pingpong=,
            items_whole=, wl_block_m=, part_skip=)`` (the forward is always persistent); ``pingpong``
            also ``gluon_fp8_fwd(pingpong=)`` (its launcher's default is on, this function's off).
        pv_promote: ``gluon_fp8_fwd(pv_promote=)``.
        masked_tile0: ``gluon_fp8_fwd(masked_tile0=)``.
        deterministic: ``gluon_fp8_bwd(deterministic=)``.
        qk_lo: two-term Q and K (``gluon_fp8_fwd(qc_lo=, kc_lo=)``, ``gluon_fp8_bwd(qc_lo=, kc_lo=, kt_lo=)``).
        cold_call: ``gluon_fp8_bwd(cold_call=)``.
        pv_lo: two-term P~ and V (``fp8_fwd``'s ``PV_LO``, ``fp8_bwd``'s ``V_LO``).

    Returns:
        dict: ``shared`` (bytes), ``ptxas`` (ptxas -v stderr), ``spill_bytes`` (stores), ``serialized``
        (ptxas warning C7512/C7515: the wgmma products were serialized), ``sass`` (cuobjdump text),
        ``ptx``, ``ttgir``.

    Raises:
        ValueError: unknown kind; FileNotFoundError: no ptxas in the triton wheel;
        triton.compiler.errors.CompilationError: the kernel does not compile.
    """
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    if kind not in ("dkdv", "dq", "fwd", "fp8_fwd", "fp8_bwd"):
        raise ValueError(f"compile_sm90: kind must be 'dkdv', 'dq', 'fwd', 'fp8_fwd' or 'fp8_bwd', got {kind!r}")
    from flamia_pack.kernels.gluon_dkdv import _dkdv_kernel
    from flamia_pack.kernels.gluon_dq import _dq_kernel
    from flamia_pack.kernels.gluon_fp8_fwd import BOOST_LOG2, _fp8_fwd_kernel, fp8_descriptor, fp8_descriptor_t
    from flamia_pack.kernels.gluon_fp8_bwd import BWD_BLOCK_M, BWD_BLOCK_N, _fp8_bwd_kernel
    from flamia_pack.kernels.gluon_fwd import _fwd_kernel

    bm = block_m or (64 if kind == "dkdv" else 128)
    if kind == "fp8_bwd":
        bm = BWD_BLOCK_M
    bn = block_n or {"dkdv": 128, "dq": 64, "fwd": 128, "fp8_fwd": 128, "fp8_bwd": BWD_BLOCK_N}[kind]
    st = stages or {"dkdv": 2, "dq": 4, "fwd": 2, "fp8_fwd": 2, "fp8_bwd": 2}[kind]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        raise FileNotFoundError(f"compile_sm90: no ptxas at {ptxas}")
    x = torch.zeros(256, 16, head_dim, dtype=torch.bfloat16)
    rows, walked = mangle_type(descriptor(x, bm)), mangle_type(descriptor(x, bn))
    acc = mangle_type(descriptor(x.float(), bm)) if dq_reduce else rows
    fn = {"dkdv": _dkdv_kernel, "dq": _dq_kernel, "fwd": _fwd_kernel, "fp8_fwd": _fp8_fwd_kernel,
          "fp8_bwd": _fp8_bwd_kernel}[kind]
    if kind == "fp8_fwd":  # E4M3 codes: Q / K token-major, V feature-major (H_kv, D, T)
        x8 = torch.zeros(256, 16, head_dim, dtype=torch.float8_e4m3fn)
        rows, walked = mangle_type(fp8_descriptor(x8, bm)), mangle_type(fp8_descriptor(x8, bn))
        v_desc = mangle_type(fp8_descriptor_t(torch.zeros(16, head_dim, 256, dtype=torch.float8_e4m3fn), bn))
    else:
        v_desc = walked
    extra = {}
    if kind == "fp8_bwd":  # row-major Q / dO / K / V codes, feature-major Q^T / dO^T / K^T, fp32 dQ accumulator
        x8 = torch.zeros(256, 16, head_dim, dtype=torch.float8_e4m3fn)
        xt8 = torch.zeros(16, head_dim, 256, dtype=torch.float8_e4m3fn)
        rows, walked = mangle_type(fp8_descriptor(x8, bm)), mangle_type(fp8_descriptor(x8, bn))
        v_desc = walked
        acc = mangle_type(descriptor(x.float(), bm))
        extra = {"qt_desc": mangle_type(fp8_descriptor_t(xt8, bm)), "dot_desc": mangle_type(fp8_descriptor_t(xt8, bm)),
                 "kt_desc": mangle_type(fp8_descriptor_t(xt8, bn)), "ktlo_desc": mangle_type(fp8_descriptor_t(xt8, bn)),
                 "FQ": "*fp32", "FDO": "*fp32", "ENTRIES": "*i32",
                 "n_entries_ptr": "*i32", "SEM": "*i32", "SEM_BASE": "*i32"}
    types = {"q_desc": rows, "do_desc": rows, "k_desc": walked, "v_desc": v_desc, "qlo_desc": rows, "klo_desc": walked, "vlo_desc": v_desc,
             "LSE": "*fp32", "DELTA": "*fp32",
             "DK": "*bf16", "DV": "*bf16", "DQ": "*bf16", "O": "*bf16", "items_ptr": "*i32", "num_items_ptr": "*i32",
             "cu_ptr": "*i32", "counter_ptr": "*i32", "qk_scale": "fp32", "sm_scale": "fp32", "dq_desc": acc,
             "EQ": "*u8", "FK": "*fp32", "FV": "*fp32", **extra}
    consts = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn, WL_BM=wl_block_m, STAGES=st,
                  CAUSAL=bool(causal), DQ_REDUCE=bool(dq_reduce), PERSISTENT=bool(persistent),
                  PINGPONG=bool(pingpong), ITEMS=bool(items_whole), PART_SKIP=bool(part_skip), BOOST=BOOST_LOG2,
                  PV_PROMOTE=bool(pv_promote), MASKED_TILE0=bool(masked_tile0), DETERMINISTIC=bool(deterministic),
                  QK_LO=bool(qk_lo), COLD_CALL=bool(cold_call), PV_LO=bool(pv_lo), V_LO=bool(pv_lo))
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n.startswith("stride")}
    compiled = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": CONSUMER_WARPS.value // (2 if kind in ("fwd", "fp8_fwd") else 1),
                                       "maxnreg": MAXNREG})
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", path, "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True, check=True)
        sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"), "-sass", os.path.join(d, "k.o")],
                              capture_output=True, text=True).stdout
    spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
    return {"shared": compiled.metadata.shared, "ptxas": r.stderr, "spill_bytes": sum(int(b) for b in spills),
            "serialized": "serialized" in r.stderr, "sass": sass, "ptx": compiled.asm["ptx"],
            "ttgir": compiled.asm["ttgir"]}
