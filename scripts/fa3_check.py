#!/usr/bin/env python3
"""flash_epilogue inside FlashAttention-3: build FA3's backward twice and compare.

    python scripts/fa3_check.py --fa3 PATH [--hdims 64,128,256] [--work DIR] [--out FILE] [--jobs N]

PATH is a FlashAttention checkout (or its hopper/ directory). The check copies hopper/ twice under --work: once
as it is, once with csrc/include/flash_epilogue/fa3/epilogue_bwd.hpp copied over hopper/epilogue_bwd.hpp and
flash_epilogue's headers next to it (hopper/flash_epilogue). It builds both (bf16, sm_90a, the selected head
dims; FA3's FLASHATTENTION_DISABLE_* flags turn off split, paged KV, softcap, local, pack-GQA, fp16/fp8 and sm_80,
which the epilogue does not touch) against CUTLASS's headers from the nvidia-cutlass wheel, concurrently, with
torch's extension builder; a rebuild recompiles only what changed. Each build then runs in processes of its own
(both register torch.ops.flash_attn_3): forward + backward on seeded inputs, dq/dk/dv written into canary-filled
buffers, for every case below, and the backward timed with triton's do_bench (median) in the order orig, compat,
compat, orig.

Cases (per head dim): batched, varlen, varlen + seqused; causal and not; MHA and GQA with groups 4 and 8, each
deterministic and not (FA3 has no deterministic backward at head dim 256); sq != sk, lengths not multiples of the
block, a varlen sequence with no queries (its dK/dV tiles take store_zero). Pass:
  * deterministic, and MHA's dK/dV always: bitwise equal to FA3's own build, canary regions included;
  * non-deterministic dQ, and GQA's dK/dV: within FA3's own test tolerance (tests/test_flash_attn.py:
    |x - ref| <= 2 |x_bf16ref - ref| + 2 * fp32 rounding of ref, against a float32 reference), for both builds,
    with the canary regions bitwise equal;
  * with seqused, rows past seqused left untouched wherever FA3's own build leaves them untouched;
  * backward time within --max-ratio (1.01) of FA3's own at (b 4, s 8192, hq 32, hk 8 and 32, d 128,
    deterministic on and off).
Writes a JSON summary (--out) and exits 1 if any case or timing fails.
"""
import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEADERS = REPO / "csrc" / "include" / "flash_epilogue"
COMPAT_HEADER = HEADERS / "fa3" / "epilogue_bwd.hpp"
BUILDS = ("orig", "compat")
DISABLED = ["SPLIT", "PAGEDKV", "APPENDKV", "LOCAL", "SOFTCAP", "PACKGQA", "FP16", "FP8", "CLUSTER", "SM8x",
            "HDIMDIFF64", "HDIMDIFF192"]
ALL_HDIMS = (64, 96, 128, 192, 256)
CANARY = 0x7FC1  # a bf16 NaN payload no kernel writes
KINDS = (("mha", 1, False), ("mha_det", 1, True), ("gqa4", 4, False), ("gqa8", 8, False),
         ("gqa4_det", 4, True), ("gqa8_det", 8, True))
TIMING = [dict(b=4, s=8192, hq=32, hk=hk, d=128, det=det) for hk in (8, 32) for det in (False, True)]


# ---------------------------------------------------------------- cases

def cases(hdims):
    out = []
    batched_shapes = [(2, 1000, 777), (2, 833, 833), (3, 300, 1111)]
    for d in hdims:
        for layout in ("batched", "varlen", "seqused"):
            for causal in (False, True):
                for i, (kind, group, det) in enumerate(KINDS):
                    if det and d >= 256:
                        continue
                    c = dict(name=f"d{d}_{layout}_{'causal' if causal else 'full'}_{kind}", d=d, layout=layout,
                             causal=causal, group=group, det=det, hk=2, seed=len(out) + 1)
                    if layout == "batched":
                        c["b"], c["sq"], c["sk"] = batched_shapes[i % len(batched_shapes)]
                    else:  # one sequence without queries: its dK/dV tiles take store_zero
                        c["seqlens_q"] = [300, 0, 777, 129, 64]
                        c["seqlens_k"] = [300, 200, 777, 1000, 1]
                        if layout == "seqused":
                            c["seqused_q"] = [250, 0, 700, 100, 33]
                            c["seqused_k"] = [299, 150, 500, 1000, 1]
                    out.append(c)
    return out


def make_inputs(c, torch, device="cuda"):
    g = torch.Generator(device=device).manual_seed(c["seed"])
    hq, hk, d = c["hk"] * c["group"], c["hk"], c["d"]
    bf16 = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(bf16)

    if c["layout"] == "batched":
        b, sq, sk = c["b"], c["sq"], c["sk"]
        x = dict(q=randn(b, sq, hq, d), k=randn(b, sk, hk, d), v=randn(b, sk, hk, d), dout=randn(b, sq, hq, d))
        x.update(cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None,
                 max_seqlen_k=None)
        return x
    lq, lk = c["seqlens_q"], c["seqlens_k"]
    def cu(lens):
        return torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], device=device, dtype=torch.int32)

    x = dict(q=randn(sum(lq), hq, d), k=randn(sum(lk), hk, d), v=randn(sum(lk), hk, d), dout=randn(sum(lq), hq, d),
             cu_seqlens_q=cu(lq), cu_seqlens_k=cu(lk), max_seqlen_q=max(lq), max_seqlen_k=max(lk),
             seqused_q=None, seqused_k=None)
    if c["layout"] == "seqused":
        x["seqused_q"] = torch.tensor(c["seqused_q"], device=device, dtype=torch.int32)
        x["seqused_k"] = torch.tensor(c["seqused_k"], device=device, dtype=torch.int32)
    return x


def sequences(c):
    """(q rows, k rows, used q, used k) per sequence, rows as slices of the packed / per-batch tensors."""
    if c["layout"] == "batched":
        return [((bi, slice(0, c["sq"])), (bi, slice(0, c["sk"])), c["sq"], c["sk"]) for bi in range(c["b"])]
    out, oq, ok = [], 0, 0
    for i, (lq, lk) in enumerate(zip(c["seqlens_q"], c["seqlens_k"])):
        uq = c["seqused_q"][i] if c["layout"] == "seqused" else lq
        uk = c["seqused_k"][i] if c["layout"] == "seqused" else lk
        out.append(((None, slice(oq, oq + lq)), (None, slice(ok, ok + lk)), uq, uk))
        oq, ok = oq + lq, ok + lk
    return out


def rows(t, where):
    bi, sl = where
    return t[sl] if bi is None else t[bi, sl]


# ---------------------------------------------------------------- build

def prepare_trees(fa3, work):
    src = Path(fa3)
    src = src / "hopper" if (src / "hopper").is_dir() else src
    if not (src / "epilogue_bwd.hpp").is_file():
        sys.exit(f"--fa3 {fa3}: no hopper/epilogue_bwd.hpp (expected a FlashAttention checkout)")
    ignore = shutil.ignore_patterns("*.py", "__pycache__", "*.pdf", "*.png", "flash_attn_3")
    for name in BUILDS:
        dst = work / name / "hopper"
        shutil.copytree(src, dst, ignore=ignore, dirs_exist_ok=True)  # copy2: unchanged files keep their mtimes
    compat = work / "compat" / "hopper"
    shutil.copy2(COMPAT_HEADER, compat / "epilogue_bwd.hpp")
    shutil.copytree(HEADERS, compat / "flash_epilogue", dirs_exist_ok=True)
    return src


def build_one(tree, name, build_dir, hdims, jobs):
    """Runs in a child process: torch's extension builder compiles and loads one tree."""
    import torch
    from torch.utils.cpp_extension import load
    from packaging.version import parse

    import importlib.util  # flash_epilogue/_cutlass.py by path, as setup.py loads it (no extension import)
    spec = importlib.util.spec_from_file_location("_cutlass", REPO / "flash_epilogue" / "_cutlass.py")
    cutlass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cutlass)

    os.environ["MAX_JOBS"] = str(jobs)
    hopper = Path(tree) / "hopper"
    stable = parse(torch.__version__) >= parse("2.9.0.dev20250830")  # FA3's setup.py makes the same choice
    std = "-std=c++20" if parse(torch.__version__).release >= (2, 12) else "-std=c++17"  # newer torch needs C++20
    features = [f"-DFLASHATTENTION_DISABLE_{f}" for f in DISABLED]
    features += [f"-DFLASHATTENTION_DISABLE_HDIM{d}" for d in ALL_HDIMS if d not in hdims]
    sources = ["flash_api_stable.cpp" if stable else "flash_api.cpp", "flash_prepare_scheduler.cu"]
    sources += [f"instantiations/flash_{p}_hdim{d}_bf16_sm90.cu" for p in ("fwd", "bwd") for d in hdims]
    cxx = ["-O3", std, "-DPy_LIMITED_API=0x03090000"] + features
    if stable:
        cxx.append("-DTORCH_TARGET_VERSION=0x0209000000000000")
    nvcc = ["-O3", std, "--use_fast_math", "-lineinfo", "--threads", "2", "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
            "-DCUTLASS_ENABLE_GDC_FOR_SM90", "-DCUTLASS_DEBUG_TRACE_LEVEL=0", "-DNDEBUG",
            "-gencode", "arch=compute_90a,code=sm_90a"] + features
    Path(build_dir).mkdir(parents=True, exist_ok=True)
    load(name=f"flash_attn_3_{name}", sources=[str(hopper / s) for s in sources], extra_cflags=cxx,
         extra_cuda_cflags=nvcc, extra_include_paths=[str(hopper), *cutlass.cutlass_include_dirs()],
         build_directory=str(build_dir), is_python_module=False, verbose=True)


def build_all(work, hdims, jobs):
    procs = {}
    for name in BUILDS:
        log = open(work / f"{name}.build.log", "w")
        cmd = [sys.executable, __file__, "_build", str(work / name), name, str(work / name / "build"),
               ",".join(map(str, hdims)), str(max(1, jobs // len(BUILDS)))]
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log)
    failed = []
    for name, (p, log) in procs.items():
        if p.wait() != 0:
            failed.append(name)
        log.close()
    for name in failed:
        print(f"build {name} failed; the end of {work / f'{name}.build.log'}:")
        print((work / f"{name}.build.log").read_text()[-4000:])
    if failed:
        sys.exit(1)
    return {name: work / name / "build" / f"flash_attn_3_{name}.so" for name in BUILDS}


# ---------------------------------------------------------------- run (child processes)

def run_cases(lib, case_file, out_file):
    import torch
    torch.ops.load_library(lib)
    ops = torch.ops.flash_attn_3
    results = {}

    def canary(t):
        return torch.full(t.shape, CANARY, dtype=torch.int16, device="cuda").view(torch.bfloat16)

    for c in json.loads(Path(case_file).read_text()):
        x = make_inputs(c, torch)
        out = torch.zeros_like(x["dout"])  # rows past seqused_q stay defined (FA3 does not write them)
        meta = {k: x[k] for k in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q",
                                  "max_seqlen_k")}
        out, lse, *_ = ops.fwd(x["q"], x["k"], x["v"], out=out, is_causal=c["causal"], **meta)
        dq, dk, dv = canary(x["q"]), canary(x["k"]), canary(x["v"])
        ops.bwd(x["dout"], x["q"], x["k"], x["v"], out, lse, dq, dk, dv, meta["cu_seqlens_q"], meta["cu_seqlens_k"],
                meta["seqused_q"], meta["seqused_k"], meta["max_seqlen_q"], meta["max_seqlen_k"], None, c["causal"],
                -1, -1, 0.0, c["det"], 0)
        torch.cuda.synchronize()
        results[c["name"]] = {k: t.cpu() for k, t in dict(out=out, dq=dq, dk=dk, dv=dv).items()}
    torch.save(results, out_file)


def run_timing(lib, out_file):
    import torch
    from triton.testing import do_bench
    torch.ops.load_library(lib)
    ops = torch.ops.flash_attn_3
    times = []
    for t in TIMING:
        g = torch.Generator(device="cuda").manual_seed(0)

        def rand(*s):
            return torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)

        q, dout = rand(t["b"], t["s"], t["hq"], t["d"]), rand(t["b"], t["s"], t["hq"], t["d"])
        k, v = rand(t["b"], t["s"], t["hk"], t["d"]), rand(t["b"], t["s"], t["hk"], t["d"])
        out, lse, *_ = ops.fwd(q, k, v)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        def bwd():
            ops.bwd(dout, q, k, v, out, lse, dq, dk, dv, None, None, None, None, None, None, None, False, -1, -1, 0.0,
                    t["det"], 0)

        times.append(do_bench(bwd, warmup=200, rep=1500, return_mode="median"))
    Path(out_file).write_text(json.dumps(times))


def child(args, log):
    with open(log, "a") as f:
        return subprocess.run([sys.executable, __file__, *args], stdout=f, stderr=subprocess.STDOUT).returncode


# ---------------------------------------------------------------- compare

def reference(c, x, torch, upcast):
    """dq, dk, dv of softmax(q k^T / sqrt(d)) v (bottom-right causal), per sequence, in float32 or in bf16."""
    dtype = torch.float32 if upcast else torch.bfloat16
    device = x["q"].device
    grads = {k: torch.zeros(x[k].shape, dtype=torch.float32, device=device) for k in ("q", "k", "v")}
    scale = 1.0 / math.sqrt(c["d"])
    for wq, wk, uq, uk in sequences(c):
        if uq == 0 or uk == 0:
            continue
        q = rows(x["q"], wq)[:uq].to(dtype).requires_grad_()
        k = rows(x["k"], wk)[:uk].to(dtype).requires_grad_()
        v = rows(x["v"], wk)[:uk].to(dtype).requires_grad_()
        dout = rows(x["dout"], wq)[:uq].to(dtype)
        kr, vr = k.repeat_interleave(c["group"], dim=1), v.repeat_interleave(c["group"], dim=1)
        s = torch.einsum("qhd,khd->hqk", q, kr) * scale
        if c["causal"]:
            i = torch.arange(uq, device=device)[:, None]
            j = torch.arange(uk, device=device)[None, :]
            s = s.masked_fill(j > i + uk - uq, float("-inf"))
        p = torch.softmax(s.float() if upcast else s, dim=-1)
        p = torch.nan_to_num(p, nan=0.0).to(dtype)  # rows that see no key
        o = torch.einsum("hqk,khd->qhd", p, vr)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), dout)
        rows(grads["q"], wq)[:uq] = dq.float()
        rows(grads["k"], wk)[:uk] = dk.float()
        rows(grads["v"], wk)[:uk] = dv.float()
    return grads


def valid_mask(c, t, torch, which):
    mask = torch.zeros(t.shape[:-2] if c["layout"] == "batched" else t.shape[:1], dtype=torch.bool)
    for wq, wk, uq, uk in sequences(c):
        w, u = (wq, uq) if which == "q" else (wk, uk)
        rows(mask, w)[:u] = True
    return mask


def compare_case(c, res, torch, device="cuda"):
    x = make_inputs(c, torch, device)

    def bits(t):
        return t.view(torch.int16)

    report = dict(name=c["name"], ok=True, bitwise={}, tolerance={}, untouched_past_seqused={})
    tol_tensors = set()
    if not c["det"]:
        tol_tensors.add("dq")  # FA3 adds dQ over key blocks with atomics
        if c["group"] > 1:
            tol_tensors |= {"dk", "dv"}
    ref = reference(c, x, torch, upcast=True) if tol_tensors else None
    ref_bf16 = reference(c, x, torch, upcast=False) if tol_tensors else None
    orig, compat = res["orig"][c["name"]], res["compat"][c["name"]]
    for name in ("out", "dq", "dk", "dv"):
        a, b = orig[name], compat[name]
        if name not in tol_tensors:
            equal = bool(torch.equal(bits(a), bits(b)))
            report["bitwise"][name] = equal
            report["ok"] &= equal
            continue
        which = "q" if name == "dq" else "k"
        valid = valid_mask(c, a, torch, which)
        canary_same = bool(torch.equal(bits(a)[~valid], bits(b)[~valid]))
        r, r16 = ref[name[1]].cpu()[valid], ref_bf16[name[1]].cpu()[valid]
        atol = 2 * ((r + 0.3 - 0.3) - r).abs().max().item() if r.numel() else 0.0
        bound = 2 * (r16 - r).abs().max().item() + atol if r.numel() else 0.0
        err = {k: (t.float()[valid] - r).abs().max().item() if r.numel() else 0.0
               for k, t in (("orig", a), ("compat", b))}
        ok = canary_same and err["compat"] <= bound and all(math.isfinite(e) for e in err.values())
        report["tolerance"][name] = dict(ok=ok, bound=bound, err_orig=err["orig"], err_compat=err["compat"],
                                         max_abs_diff=(a.float()[valid] - b.float()[valid]).abs().max().item()
                                         if r.numel() else 0.0, canary_regions_equal=canary_same)
        report["ok"] &= ok
    if c["layout"] == "seqused":
        for name in ("dq", "dk", "dv"):
            mask = valid_mask(c, orig[name], torch, "q" if name == "dq" else "k")
            past = {}
            for build, t in (("orig", orig[name]), ("compat", compat[name])):
                within = t.view(torch.int16)[~mask]
                past[build] = bool((within == CANARY).all())
            report["untouched_past_seqused"][name] = past
            report["ok"] &= past["compat"] or not past["orig"]
    return report


# ---------------------------------------------------------------- main

def main():
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        cmd, rest = sys.argv[1], sys.argv[2:]
        if cmd == "_build":
            build_one(rest[0], rest[1], rest[2], [int(d) for d in rest[3].split(",")], int(rest[4]))
        elif cmd == "_cases":
            run_cases(*rest)
        elif cmd == "_time":
            run_timing(*rest)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fa3", required=True, help="a FlashAttention checkout (or its hopper/ directory)")
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--work", default="/tmp/fa3_check", help="build trees, builds and outputs (reused)")
    ap.add_argument("--out", default=None, help="the JSON summary (default: WORK/fa3_check.json)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--max-ratio", type=float, default=1.01, help="compat / orig backward time allowed")
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args()
    import torch

    hdims = [int(d) for d in args.hdims.split(",")]
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    src = prepare_trees(args.fa3, work)
    t0 = datetime.datetime.now()
    libs = build_all(work, hdims, args.jobs)
    print(f"built both in {(datetime.datetime.now() - t0).seconds} s")

    all_cases = cases(hdims)
    case_file = work / "cases.json"
    case_file.write_text(json.dumps(all_cases))
    res = {}
    for name in BUILDS:
        out = work / f"{name}.cases.pt"
        if child(["_cases", str(libs[name]), str(case_file), str(out)], work / f"{name}.run.log") != 0:
            print(f"running the {name} build failed; the end of its log:")
            print((work / f"{name}.run.log").read_text()[-4000:])
            return 1
        res[name] = torch.load(out)
    reports = [compare_case(c, res, torch) for c in all_cases]

    timing = []
    if not args.no_timing:
        runs = {name: [] for name in BUILDS}
        for i, name in enumerate(("orig", "compat", "compat", "orig")):
            out = work / f"{name}.time{i}.json"
            if child(["_time", str(libs[name]), str(out)], work / f"{name}.run.log") != 0:
                print(f"timing the {name} build failed; the end of its log:")
                print((work / f"{name}.run.log").read_text()[-4000:])
                return 1
            runs[name].append(json.loads(out.read_text()))
        for j, t in enumerate(TIMING):
            ms = {name: sum(r[j] for r in runs[name]) / len(runs[name]) for name in BUILDS}
            timing.append(dict(t, orig_ms=ms["orig"], compat_ms=ms["compat"], ratio=ms["compat"] / ms["orig"],
                               runs_ms={name: [r[j] for r in runs[name]] for name in BUILDS},
                               ok=ms["compat"] / ms["orig"] <= args.max_ratio))

    failed = [r["name"] for r in reports if not r["ok"]] + [f"timing {t}" for t in timing if not t["ok"]]
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    summary = dict(commit=os.environ.get("FLASH_EPILOGUE_COMMIT", commit), date=str(datetime.date.today()),
                   gpu=torch.cuda.get_device_name(), fa3=str(src), hdims=hdims, cases=len(reports),
                   cases_passed=sum(r["ok"] for r in reports), timing=timing, failed=failed, reports=reports)
    out_path = Path(args.out) if args.out else work / "fa3_check.json"
    out_path.write_text(json.dumps(summary, indent=1))
    print(f"{summary['cases_passed']} of {len(reports)} cases passed")
    for t in timing:
        print(f"  b{t['b']} s{t['s']} hq{t['hq']} hk{t['hk']} d{t['d']} det={t['det']}: FA3 {t['orig_ms']:.3f} ms, "
              f"compat {t['compat_ms']:.3f} ms, ratio {t['ratio']:.4f}")
    for name in failed:
        print("FAILED", name)
    print(f"summary: {out_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
