"""FP8 forward probe (issue 27), one device call: the kernel against the CPU emulation (same codes) and
the fp32 reference on small rows, the numerics targets on 4 x 4096, and the speed of the FP8 forward
(with and without quantization), the quantizer and our BF16 forward, same process, on W1-W9.

    PYTHONPATH=. python benchmarks/probes/fp8_fwd_probe.py [--parts check,numerics,speed,quant] [--rows W1,W4]
        [--variants promote,pp1,pp0,nozero]

Variants of ``gluon_fp8_fwd`` (``VARIANTS``): ``pp1`` the shipped kernel (ping-pong between the
consumer partitions, P~V accumulated across key tiles in the MMA), ``pp0`` that without ping-pong,
``promote`` each tile's P~V promoted into an fp32 register accumulator (issue 27 item 3), ``nozero`` a copy of the
kernel file without the V^T column zeroing of a document's first and last key tile (timing only: it
gives up NaN containment between documents, so its containment check fails by design; it prices what
the zeroing still costs). Every variant is checked before it is timed: ``check`` runs it on
NaN-poisoned outputs against the emulation (``pv_accumulator="fp32"`` and the model of its own
accumulation: ``"mma14"`` / ``"promote14"``) and the fp32 reference, and requires ``pp0`` to give
``pp1``'s bits (ping-pong only reorders issue); ``speed`` runs each variant once on NaN-poisoned outputs of the row
it times and skips (prints FAILED) a variant that left a NaN or disagrees with the BF16 forward.
"""
from __future__ import annotations

import argparse
import functools
import math

import numpy as np
import torch

from flamia_pack.kernels.fp8_attention import FP8_BLOCK_M, build_fp8_work_list, fp8_attention_forward, fp8_quantize
from flamia_pack.kernels.fp8_emulation import OperandCodes
from flamia_pack.kernels.fp8_emulation import fp8_attention_forward as emulated_forward
from flamia_pack.kernels.gluon_fp8_fwd import gluon_fp8_fwd
from flamia_pack.kernels.reference import packed_attention_reference
from flamia_pack.kernels.quantize import from_wgmma_order

#: gluon_fp8_fwd keyword arguments of each variant, and the emulation's model of its P~V accumulation
VARIANTS = {"pp1": dict(pingpong=True, pv_promote=False), "pp0": dict(pingpong=False, pv_promote=False),
            "promote": dict(pingpong=True, pv_promote=True),
            "nozero": dict(pingpong=True, pv_promote=True, _without_zeroing=True)}
MODEL = {"pp1": "mma14", "pp0": "mma14", "promote": "promote14", "nozero": "promote14"}


@functools.cache
def _nozero_launcher():
    """``gluon_fp8_fwd`` of a copy of the kernel file without the V^T column zeroing (``nozero``, timing
    only), imported from a temporary directory under its own module name (its own jitted kernels)."""
    import importlib.util
    import pathlib
    import tempfile

    import flamia_pack.kernels.gluon_fp8_fwd as shipped
    src = pathlib.Path(shipped.__file__).read_text()
    calls = ["_zero_cols_outside(v_bufs.index(s0), ph, BLOCK_N, NW)",
             "_zero_cols_outside(v_bufs.index(sl), lo_last, hi_last, NW)"]
    for c in calls:
        if src.count(c) != 1:
            raise RuntimeError(f"fp8_fwd_probe nozero: the kernel file no longer has {c!r} once")
        src = src.replace(c, "pass")
    path = pathlib.Path(tempfile.mkdtemp()) / "_fp8_fwd_nozero.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("_fp8_fwd_nozero", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.gluon_fp8_fwd


def _launcher(kw):
    """``(gluon_fp8_fwd of the variant, its keyword arguments)``."""
    kw = dict(kw)
    return (_nozero_launcher() if kw.pop("_without_zeroing", False) else gluon_fp8_fwd), kw


def poison_with_nan_code(x, token, head):
    """``x`` (in place) with a NaN code in ``x[token, head]``'s E4M3 codes: a NaN input alone gets a
    finite code from the integer encoder the FP8 path uses, but it makes the group non-finite (exponent
    byte 255, scale 1), and 480 in that group encodes as the NaN code 0x7F. Returns ``x``."""
    x[token, head, 9] = float("nan")
    x[token, head, 5] = 480.0
    return x


def _row(lengths, H, Hkv, pad=0, seed=0, outlier=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = int(sum(lengths)) + pad
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn((T, h, 128), device="cuda", generator=g).bfloat16() for h in (H, Hkv, Hkv))
    if outlier:
        k[:, :, [5, 17, 40, 99]] *= 20
    return q, k, v, cu


def _kernel(ops, cu, causal=True, wl=None, **kw):
    """The FP8 kernel on NaN-poisoned outputs (``kw``: a variant's ``gluon_fp8_fwd`` arguments), the
    row-end padding filled as ``fp8_attention_forward`` does."""
    T, H, D = ops.qc.shape
    wl = build_fp8_work_list(cu, T, causal=causal) if wl is None else wl
    o = torch.full((T, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")  # poisoned
    lse = torch.full((H, T), float("nan"), dtype=torch.float32, device="cuda")
    from flamia_pack.kernels.flash_fwd import fill_tails
    fn, kw = _launcher(kw)
    fn(ops.qc, ops.kc, ops.vt, ops.eq, ops.ekt, ops.evt, cu, wl.items, wl.num_items, D ** -0.5,
       causal=causal, wl_block_m=FP8_BLOCK_M, skip_len=0, o=o, lse=lse, **kw)
    fill_tails([(o, 0.0, 0), (lse, math.inf, 1)], cu)
    return o, lse


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def _emulated(ops, cu, causal, gran, pv_accumulator="fp32"):
    vc = from_wgmma_order(ops.vt, ops.qc.shape[0]).permute(2, 0, 1).contiguous()
    quant = tuple(OperandCodes(c.cpu(), e.cpu()) for c, e in ((ops.qc, ops.eq), (ops.kc, ops.ek), (vc, ops.ev)))
    return emulated_forward(None, None, None, cu.cpu(), causal=causal, scale_granularity=gran, quantized=quant,
                            pv_accumulator=pv_accumulator)


def check(variants):
    """Every variant on small rows; returns ``{variant: passed}`` (the GPU tests' tolerances)."""
    rng = np.random.default_rng(0)
    rows = [([300, 1, 77, 700, 129, 128], 4, 2, 0), ([1024, 1024], 4, 4, 0), ([5, 250, 1, 1, 600], 2, 1, 37),
            (list(rng.integers(1, 400, 24)), 4, 1, 0)]
    ok = {name: True for name in variants}
    worst = {name: 0.0 for name in variants}
    for i, (lens, H, Hkv, pad) in enumerate(rows):
        for gran in ("block", "token"):
            for causal in (True, False):
                q, k, v, cu = _row(lens, H, Hkv, pad, seed=i)
                ops = fp8_quantize(q, k, v, cu, gran)
                ref = packed_attention_reference(q.float(), k.float(), v.float(), cu, causal=causal)
                n = int(cu[-1])
                oe, lsee = _emulated(ops, cu, causal, gran)
                models = {m: _emulated(ops, cu, causal, gran, m)[0] for m in {MODEL[v] for v in variants}}
                outs = {}
                for name in variants:
                    o, lse = _kernel(ops, cu, causal, **VARIANTS[name])
                    torch.cuda.synchronize()
                    outs[name] = (o, lse)
                    oc = o.float().cpu()
                    d_emu = float((oc - oe.float()).abs().max())
                    d_model = float((oc - models[MODEL[name]].float()).abs().max())
                    dl = float((lse.cpu()[:, :n] - lsee[:, :n]).abs().max())
                    pad_ok = bool((o[n:] == 0).all()) and bool(torch.isinf(lse[:, n:]).all())
                    nan = bool(o.isnan().any()) or bool(lse.isnan().any())
                    c_emu, c_ref = _cos(oc[:n], oe[:n]), _cos(o[:n], ref[:n])
                    passed = (not nan and pad_ok and c_emu > 0.9999 and d_emu < 0.125 and dl < 2e-3 and c_ref > 0.998)
                    ok[name] &= passed
                    worst[name] = max(worst[name], d_emu)
                    print(f"check {name:7s} row{i} H{H}/{Hkv} {gran:5s} causal={causal!s:5s}: |O-emu| max {d_emu:.3e}  "
                          f"|O-emu {MODEL[name]}| {d_model:.3e}  |LSE-emu| {dl:.2e}  cos(O, fp32) {c_ref:.5f}  "
                          f"emu {_cos(oe[:n], ref[:n].cpu()):.5f}  nan {nan}  pad ok {pad_ok}"
                          f"{'' if passed else '  FAILED'}")
                if "nozero" in outs and "promote" in outs:  # finite inputs: the zeroing changes no result bits
                    same = all(torch.equal(a, b) for a, b in zip(outs["promote"], outs["nozero"]))
                    ok["nozero"] &= same
                    print(f"check nozero == promote bitwise (O and LSE): {same}")
                if "pp1" in outs and "pp0" in outs:
                    same = all(torch.equal(a, b) for a, b in zip(outs["pp1"], outs["pp0"]))
                    ok["pp0"] &= same
                    print(f"check pp0 == pp1 bitwise (O and LSE): {same}")
    # NaN containment: document 1 of 3 gets NaN K and V; the others are bitwise the clean run's
    q, k, v, cu = _row([400, 300, 500], 2, 2, 0, seed=9)
    k2, v2 = k.clone(), v.clone()
    k2[450, 0, 3] = float("nan")
    v2[420, 1, 7] = float("inf")
    keep = torch.cat([torch.arange(0, 400), torch.arange(700, 1200)]).cuda()
    # and a NaN code in V in document 1's last 32-token group, which document 2's first key tile (from token
    # 688, on the 16-grid) holds in its leading columns
    v3 = poison_with_nan_code(v.clone(), 695, 0)
    for name in variants:
        o_clean, _ = _kernel(fp8_quantize(q, k, v, cu, "block"), cu, **VARIANTS[name])
        for label, (kb, vb) in (("K NaN / V inf mid-document", (k2, v2)), ("V NaN code in the last group", (k, v3))):
            o_bad, _ = _kernel(fp8_quantize(q, kb, vb, cu, "block"), cu, **VARIANTS[name])
            contained = bool(torch.equal(o_bad[keep], o_clean[keep]))
            ok[name] &= contained
            print(f"nan containment {name} ({label}): other documents bitwise equal: {contained}  the NaN document "
                  f"non-finite: {bool((~torch.isfinite(o_bad[400:700])).any())}")
    # informational (not part of the pass / fail): a whole 128-key tile of zero V inside a document makes
    # the fold reference drop ~110 binades, and the MMA-accumulating kernel's rescale of the running
    # accumulator by 2^(r_old - r_new) overflows (the emulation's "mma14" model does; "fp32" does not)
    q, k, v, cu = _row([512], 1, 1, seed=11)
    v[128:256] = 0
    ops = fp8_quantize(q, k, v, cu, "block")
    oe_m = _emulated(ops, cu, True, "block", "mma14")[0]
    for name in variants:
        o, _ = _kernel(ops, cu, **VARIANTS[name])
        print(f"zero-V tile {name}: non-finite rows {int((~torch.isfinite(o.float())).any(-1).any(-1).sum())} of 512 "
              f"(emulation mma14: {int((~torch.isfinite(oe_m.float())).any(-1).any(-1).sum())}, fp32: 0)")
    for name in variants:
        print(f"check {name}: worst |O - emulation| {worst[name]:.3e}  {'passed' if ok[name] else 'FAILED'}")
    return ok


def numerics(variants):
    """cos(O, fp32) on 4 x 4096 (N(0, 1) and outlier K channels); per variant, and promote against the
    accumulating kernel (issue 27 item 3: the MMA's accumulation across tiles vs per-tile promotion)."""
    for name, outlier in (("N(0,1)", False), ("K channels x20", True)):
        q, k, v, cu = _row([4096] * 4, 16, 16, outlier=outlier, seed=3)
        ref = packed_attention_reference(q.float(), k.float(), v.float(), cu, causal=True)
        from flamia_pack.kernels import varlen_attention
        ob = varlen_attention(q, k, v, cu, 4096)
        for gran in ("block", "token"):
            ops = fp8_quantize(q, k, v, cu, gran)
            outs = {}
            for var in variants:
                o, _ = _kernel(ops, cu, **VARIANTS[var])
                outs[var] = o
                rel = ((o.float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)).max()
                print(f"numerics {var:7s} 4x4096 H16 D128 {name:15s} {gran:5s}: cos(O, fp32) {_cos(o, ref):.6f} max row "
                      f"rel err {float(rel):.4f} | bf16 kernel cos {_cos(ob, ref):.6f}")
            if "promote" in outs and "pp1" in outs:
                d = (outs["promote"].float() - outs["pp1"].float()).abs()
                ulp = d / torch.exp2(torch.floor(torch.log2(outs["pp1"].float().abs().clamp_min(1e-30))) - 7)
                print(f"numerics promote vs pp1 {name:15s} {gran:5s}: max |dO| {float(d.max()):.3e}, "
                      f"max {float(ulp.max()):.1f} bf16 ulps, share of elements that differ "
                      f"{float((d > 0).float().mean()):.4f}")


def speed(rows, variants):
    import triton
    from flamia_pack.kernels import varlen_attention
    from flamia_pack.kernels.attention import build_attention_work_list
    from flamia_pack.scheduler.cost import attention_flops
    from flamia_pack.scheduler.workloads import workload_lengths

    def ms(fn):
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))

    cols = " | ".join(f"{v} kernel ms | {v} TFLOP/s" for v in variants)
    print(f"| row | BF16 fwd ms | FP8 fwd+quant ms | {cols} | quant ms | fp8+q / bf16 | {variants[0]} kernel / bf16 |")
    print("|---|---|---|" + "---|---|" * len(variants) + "---|---|---|")
    for w in rows:
        lens = workload_lengths(w)
        Hkv = 4 if w == "W5" else 16
        q, k, v, cu = _row(lens, 16, Hkv)
        T = q.shape[0]
        wl16 = build_attention_work_list(cu, T, max_seqlen=int(max(lens)), num_kv_groups=16 // Hkv)
        wl8 = build_fp8_work_list(cu, T)
        ops = fp8_quantize(q, k, v, cu, "block")
        fl = attention_flops(lens, 16, 128)
        n = int(cu[-1])
        with torch.no_grad():
            ob = varlen_attention(q, k, v, cu, int(max(lens)), work_list=wl16)
            t16 = ms(lambda: varlen_attention(q, k, v, cu, int(max(lens)), work_list=wl16))
            t8q = ms(lambda: fp8_attention_forward(fp8_quantize(q, k, v, cu, "block"), cu, work_list=wl8))
            tq = ms(lambda: fp8_quantize(q, k, v, cu, "block"))
            cells, times = [], {}
            for var in variants:
                o, _ = _kernel(ops, cu, wl=wl8, **VARIANTS[var])  # poisoned: checked before it is timed
                nan, c = bool(o.isnan().any()), _cos(o[:n], ob[:n])
                if nan or c < 0.998:
                    cells.append(f"FAILED (nan {nan}, cos vs bf16 {c:.4f}) | -")
                    continue
                times[var] = ms(lambda: _kernel_timed(ops, cu, wl8, VARIANTS[var]))
                cells.append(f"{times[var]:.3f} | {fl / times[var] / 1e9:.0f}")
        first = f"{t16 / times[variants[0]]:.2f}x" if variants[0] in times else "-"
        print(f"| {w} | {t16:.3f} | {t8q:.3f} | {' | '.join(cells)} | {tq:.3f} | {t16 / t8q:.2f}x | {first} |")


def _kernel_timed(ops, cu, wl, kw):
    T, H, D = ops.qc.shape
    fn, kw = _launcher(kw)
    return fn(ops.qc, ops.kc, ops.vt, ops.eq, ops.ekt, ops.evt, cu, wl.items, wl.num_items, D ** -0.5,
              causal=True, wl_block_m=FP8_BLOCK_M, skip_len=0, **kw)


def quant():
    """The quantizer's transposed stores on W1 (16 x 4096): bitwise against the torch copy, and timed.
    ``fp8_quantize`` ships V's copy in the kernel with the integer encoder (``hw_cvt=False``) for bf16."""
    import triton
    from flamia_pack.kernels.quantize import quantize_qkv
    q, k, v, cu = _row([4096] * 16, 16, 16)
    only_v = (False, False, True)
    for hw in (True, False):
        for gran in ("block", "token"):
            ref = quantize_qkv(q, k, v, cu, gran, transposed=True, validate=False)
            got = quantize_qkv(q, k, v, cu, gran, transposed=True, transposed_store="kernel", hw_cvt=hw, validate=False)
            same = all(torch.equal(a.codes_t.view(torch.uint8), b.codes_t.view(torch.uint8)) for a, b in zip(ref, got))
            got_v = quantize_qkv(q, k, v, cu, gran, transposed=only_v, transposed_store="kernel", hw_cvt=hw,
                                 validate=False)
            same_v = (torch.equal(got_v[2].codes_t.view(torch.uint8), ref[2].codes_t.view(torch.uint8))
                      and all(torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8)) for a, b in zip(got_v, ref))
                      and all(torch.equal(a.exponents, b.exponents) for a, b in zip(got_v, ref)))
            t_k = triton.testing.do_bench(lambda: quantize_qkv(q, k, v, cu, gran, transposed=True, transposed_store="kernel",
                                                               hw_cvt=hw, validate=False, check_finite=False))
            t_kv = triton.testing.do_bench(lambda: quantize_qkv(q, k, v, cu, gran, transposed=only_v,
                                                                transposed_store="kernel", hw_cvt=hw, validate=False,
                                                                check_finite=False))
            t_t = triton.testing.do_bench(lambda: quantize_qkv(q, k, v, cu, gran, transposed=True, validate=False,
                                                               check_finite=False))
            t_v = triton.testing.do_bench(lambda: quantize_qkv(q, k, v, cu, gran, transposed=only_v,
                                                               validate=False, check_finite=False))
            t_n = triton.testing.do_bench(lambda: quantize_qkv(q, k, v, cu, gran, validate=False, check_finite=False))
            x = torch.empty_like(q)
            t_c = triton.testing.do_bench(lambda: (x.copy_(q), x.copy_(k), x.copy_(v)))
            print(f"quant W1 {gran:5s} hw_cvt={hw!s:5s}: in-kernel transposed bitwise: all={same} V-only={same_v}  ms: "
                  f"kernel-T(all) {t_k:.3f} kernel-T(V) {t_kv:.3f} torch-T(all) {t_t:.3f} torch-T(V) {t_v:.3f} "
                  f"no-T {t_n:.3f} | bf16 copy of q,k,v {t_c:.3f}")
    t_ship = triton.testing.do_bench(lambda: fp8_quantize(q, k, v, cu, "block"))
    print(f"quant W1 fp8_quantize (as shipped: bf16, V^T in the kernel, integer encoder) {t_ship:.3f} ms")
    # tile sweep of the in-kernel transposed store (integer encoder), V only (the forward) and all three
    # (the backward's operands): the tile sets registers and shared memory, hence programs an SM
    # (fp8_quantize: V^T in the wgmma order, to_wgmma_order; with backward=True Q^T and K^T in token order)
    for flags, wg, label in ((only_v, False, "V^T"), (only_v, only_v, "V^T wgmma"), (True, only_v, "QKV^T V wgmma")):
        ref = quantize_qkv(q, k, v, cu, "block", transposed=flags, validate=False, wgmma_order=wg)
        for rows, warps in ((128, 8), (64, 8), (64, 4)):
            got = quantize_qkv(q, k, v, cu, "block", transposed=flags, transposed_store="kernel", hw_cvt=False,
                               validate=False, block_rows=rows, num_warps=warps, wgmma_order=wg)
            same = all(torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8)) and
                       torch.equal(a.exponents, b.exponents) and
                       (a.codes_t is None or torch.equal(a.codes_t.view(torch.uint8), b.codes_t.view(torch.uint8)))
                       for a, b in zip(got, ref))
            t = triton.testing.do_bench(lambda: quantize_qkv(q, k, v, cu, "block", transposed=flags,
                                                             transposed_store="kernel", hw_cvt=False, validate=False,
                                                             check_finite=False, block_rows=rows, num_warps=warps,
                                                             wgmma_order=wg))
            print(f"quant W1 block {label:13s} in-kernel {rows:3d} rows x {warps} warps: {t:.3f} ms  bitwise {same}")
    # the wgmma order at a T off the 16-grid (padding tokens interleave with real ones), both granularities
    q, k, v, cu = _row([300, 212, 1000, 37], 4, 2)
    for gran in ("block", "token"):
        for flags in (only_v, True):
            ref = quantize_qkv(q, k, v, cu, gran, transposed=flags, validate=False, wgmma_order=only_v)
            got = quantize_qkv(q, k, v, cu, gran, transposed=flags, transposed_store="kernel", hw_cvt=False,
                               validate=False, wgmma_order=only_v)
            same = all(a.codes_t is None or torch.equal(a.codes_t.view(torch.uint8), b.codes_t.view(torch.uint8))
                       for a, b in zip(got, ref))
            print(f"quant T=1549 {gran} transposed={flags}: in-kernel wgmma-order V^T bitwise {same}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="check,numerics,speed,quant")
    ap.add_argument("--rows", default="W1,W2,W3,W4,W5,W6,W7,W8,W9")
    ap.add_argument("--variants", default="promote", help=f"comma-separated, of {list(VARIANTS)}")
    a = ap.parse_args()
    parts = a.parts.split(",")
    variants = a.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}: choose from {list(VARIANTS)}")
    print(torch.cuda.get_device_name(), torch.__version__)
    if "check" in parts:
        ok = check(variants)
        if not all(ok.values()):
            print(f"not timed (failed the check): {[v for v in variants if not ok[v]]}")
        variants = [v for v in variants if ok[v]]
        if not variants:
            return
    if "numerics" in parts:
        numerics(variants)
    if "speed" in parts:
        speed(a.rows.split(","), variants)
    if "quant" in parts:
        quant()


if __name__ == "__main__":
    main()
