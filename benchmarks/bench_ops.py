"""Every op against torch eager, torch.compile, a plain Triton kernel and the copy roofline, in one run.

    python benchmarks/bench_ops.py --out benchmarks/results --commit abc1234   # H200: ~4-5 min
    python benchmarks/bench_ops.py --quick --out /tmp/r                        # smoke run: 3 shapes
    python benchmarks/bench_ops.py --from-json benchmarks/results/h200.json    # tables, CSV, PNG again
    python benchmarks/bench_ops.py --from-json benchmarks/results/h200.json --readme-table  # the README's table

Rows: "op" (store, store_varlen, store_zero, gqa_reduce with fp32 and bf16 partials as "dtype",
gqa_accumulate, gqa_accumulate_det, gqa_postprocess), "impl" (flash_epilogue: torch.ops.flash_epilogue.*;
the baselines of benchmarks/baselines.py), the shape (benchmarks/common.py), ms, TB/s and "check":
each impl's outputs against torch eager's, from the same initial state. gqa_accumulate_det's baseline
rows are gqa_accumulate's ("shared_with"). store_varlen runs on the varlen batch and on each batched
shape packed as equal-length sequences. Writes DIR/NAME.json (rows, targets, environment, regressions
over 2% against the last committed NAME.json), DIR/NAME.csv and DIR/NAME.png; the JSON and the PNG are committed.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import signal
import statistics
import time
from typing import Optional

import torch

import baselines as B
from bench_host import host_calls
from common import (IMPLS, MB, OUT, REPO, Shape, all_shapes, copy_roofline, default_commit, do_bench_median,
                    environment, host_loop, log, readme_table, rotating, rotation, run_cmd, write_csv, write_outputs,
                    write_plot)

OPS = ("store", "store_varlen", "store_zero", "gqa_reduce", "gqa_accumulate", "gqa_accumulate_det",
       "gqa_postprocess")
BIG_BYTES = 256 * MB  # store's 0.97x-of-Triton target holds on shapes moving more than this
SCALE_DK, SCALE_DV = 0.125, 1.0  # gqa_postprocess
HOST_FE, HOST_TO = "flash_epilogue.store (wrapper, check_inputs=False)", "torch .to x2 (dK, dV)"


LAYER = dict(b=4, hq=32, hk=8, s=4096, d=128)  # the attention layer where users meet repeat_kv


def attention_layer_ms(warmup: int, rep: int) -> dict:
    """SDPA forward + backward (causal, bf16, torch's default backend choice) with K/V expanded by
    fe.repeat_kv, by transformers' Llama repeat_kv (expand + reshape), and not expanded (enable_gqa=True):
    do_bench medians in ms, gradients of q, k, v reset between calls."""
    import torch.nn.functional as F

    import flash_epilogue as fe
    b, hq, hk, s, d = (LAYER[k] for k in ("b", "hq", "hk", "s", "d"))
    n_rep = hq // hk
    torch.manual_seed(0)
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)

    def transformers_repeat_kv(x):
        return x[:, :, None].expand(b, hk, n_rep, s, d).reshape(b, hq, s, d)

    def layer(expand=None):
        def run():
            kk, vv = (expand(k), expand(v)) if expand else (k, v)
            F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=expand is None).backward(dout)
        return run

    variants = {"fe.repeat_kv": layer(lambda x: fe.repeat_kv(x, n_rep)),
                "transformers repeat_kv": layer(transformers_repeat_kv), "enable_gqa=True": layer()}
    return {"shape": dict(LAYER, causal=True, dtype="bfloat16"),
            **{name: do_bench_median(fn, warmup, rep, grad_to_none=[q, k, v]) for name, fn in variants.items()}}


def zero_seqused(s: Shape, seed: int = 1) -> list[int]:
    """store_zero's valid lengths: seqused[b] in [len/2, len] (fixed seed)."""
    rng = random.Random(seed)
    return [rng.randint(n // 2, n) if n else 0 for n in (s.lengths if s.varlen else (s.s,) * s.b)]


def _empty(s: Shape, d: int, device, dtype=OUT):
    return torch.empty(*s.lead(), s.hk, d, dtype=dtype, device=device)


def _pair(s: Shape, heads: int, device, dtype=torch.float32):
    return tuple(torch.randn(*s.lead(), heads, d, device=device).to(dtype) for d in (s.d, s.dv))


def _accumulator(s: Shape, cu, device, deterministic: bool):
    import flash_epilogue as fe
    geometry = dict(cu_seqlens=cu, total_tokens=s.rows) if s.varlen else dict(batch=s.b, seqlen=s.s)
    return fe.gqa_accumulator(s.hk, s.d, s.dv, deterministic=deterministic, device=device, **geometry)


class Op:
    """One op: its tensors at a shape (build), their minimum traffic, and calls(): a callable per
    implementation returning the outputs. `in_dtype`: the partials'/accumulators' (rows' "dtype");
    `tol`: how far a baseline may differ (None: bitwise)."""

    name, in_dtype, impls, tol = "", torch.float32, IMPLS, None

    @property
    def dtype_name(self) -> str:
        return str(self.in_dtype).replace("torch.", "")

    def key(self, s: Shape) -> str:
        return self.name

    def footprint(self, s: Shape) -> int:
        return self.traffic(s)

    def fresh(self, t: dict) -> dict:
        """Tensors in their initial state for a correctness check (in-place ops clone/reset)."""
        return t


class StoreOp(Op):
    name = "store"

    def traffic(self, s):
        return s.rows * s.hk * (s.d + s.dv) * (4 + 2)

    def build(self, s, device):
        return dict(zip(("ak", "av"), _pair(s, s.hk, device)), dk=_empty(s, s.d, device), dv=_empty(s, s.dv, device),
                    tk=_empty(s, s.d, device), tv=_empty(s, s.dv, device), cu=s.cu_seqlens(device))

    def calls(self, s, t):
        ak, av, dk, dv, cu = t["ak"], t["av"], t["dk"], t["dv"], t["cu"]
        return {"flash_epilogue": lambda: (torch.ops.flash_epilogue.store(ak, av, dk, dv, cu_seqlens=cu, seqused=None),
                                           dk, dv)[1:],
                "torch_eager": lambda: B.eager_store(ak, av),
                "torch_compile": B.compiled_call("store", ak, av, shapes=(dk.shape, dv.shape)),
                "torch_compile_dynamic": B.compiled_call("store", ak, av, shapes=(dk.shape, dv.shape), dynamic=True),
                "triton": lambda: B.cvt2(ak, t["tk"], av, t["tv"])}


class StoreVarlenOp(StoreOp):
    name = "store_varlen"


class StoreZeroOp(Op):
    name, in_dtype = "store_zero", OUT

    def key(self, s):
        return "store_zero_varlen" if s.varlen else "store_zero"

    def traffic(self, s):  # the valid rows written
        return sum(zero_seqused(s)) * s.hk * (s.d + s.dv) * 2

    def footprint(self, s):
        return s.rows * s.hk * (s.d + s.dv) * 2

    def build(self, s, device):
        used = zero_seqused(s)
        return dict(zip(("dk", "dv"), _pair(s, s.hk, device, OUT)), cu=s.cu_seqlens(device), max_len=max(used + [1]),
                    used=torch.tensor(used, dtype=torch.int32, device=device))

    def fresh(self, t):
        return dict(t, dk=t["dk"].clone(), dv=t["dv"].clone())

    def calls(self, s, t):
        dk, dv, cu, used = t["dk"], t["dv"], t["cu"], t["used"]
        args = (dk, dv, cu, used) if s.varlen else (dk, dv, used)
        eager = B.EAGER[self.key(s)]  # compiled unflattened in both modes: the batched mask is 4-D
        comp, comp_dyn = B.compiled(self.key(s)), B.compiled(self.key(s), dynamic=True)
        return {"flash_epilogue": lambda: (torch.ops.flash_epilogue.store_zero(
                    dk, dv, cu_seqlens=cu, seqused=used, batch_idx=None, head_idx=None, row_start=0, row_end=None),
                    dk, dv)[1:],
                "torch_eager": lambda: eager(*args), "torch_compile": lambda: comp(*args),
                "torch_compile_dynamic": lambda: comp_dyn(*args),
                "triton": lambda: B.zero_rows(dk, dv, used, t["max_len"], cu)}


class GQAReduceOp(Op):
    name, tol = "gqa_reduce", {"rtol": 2 ** -6, "atol": 1e-2}  # bf16 of sums in another order: 1-2 ulp

    def __init__(self, in_dtype):
        self.in_dtype = in_dtype

    def traffic(self, s):
        return s.rows * (s.d + s.dv) * (s.hq * torch.empty(0, dtype=self.in_dtype).element_size() + s.hk * 2)

    def build(self, s, device):
        return dict(zip(("pk", "pv"), _pair(s, s.hq, device, self.in_dtype)), ok=_empty(s, s.d, device),
                    ov=_empty(s, s.dv, device), tk=_empty(s, s.d, device), tv=_empty(s, s.dv, device),
                    cu=s.cu_seqlens(device))

    def calls(self, s, t):
        pk, pv, ok, ov, cu = t["pk"], t["pv"], t["ok"], t["ov"], t["cu"]
        return {"flash_epilogue": lambda: (torch.ops.flash_epilogue.gqa_reduce(
                    pk, pv, ok, ov, cu_seqlens=cu, seqused=None, scale_dk=1.0, scale_dv=1.0), ok, ov)[1:],
                "torch_eager": lambda: B.eager_gqa_reduce(pk, pv, s.hk),
                "torch_compile": B.compiled_call("gqa_reduce", pk, pv, s.hk, shapes=(ok.shape, ov.shape)),
                "torch_compile_dynamic": B.compiled_call("gqa_reduce", pk, pv, s.hk, shapes=(ok.shape, ov.shape),
                                                         dynamic=True),
                "triton": lambda: B.gsum2(pk, t["tk"], pv, t["tv"])}


class GQAAccumulateOp(Op):
    name, tol, deterministic = "gqa_accumulate", {"rtol": 1e-5, "atol": 1e-5}, False  # fp32 sums in another order

    def traffic(self, s):  # the accumulator read and written (dense fp32)
        return s.rows * (s.d + s.dv) * (s.hq * 4 + 2 * s.hk * 4)

    def build(self, s, device):
        cu = s.cu_seqlens(device)
        return dict(zip(("pk", "pv"), _pair(s, s.hq, device)), cu=cu,
                    acc=_accumulator(s, cu, device, self.deterministic),
                    ak=_empty(s, s.d, device, torch.float32).zero_(), av=_empty(s, s.dv, device, torch.float32).zero_())

    def fresh(self, t):
        t["ak"].zero_()
        t["av"].zero_()
        t["acc"].reset()
        return t

    def calls(self, s, t):
        pk, pv, cu, acc, ak, av, det = t["pk"], t["pv"], t["cu"], t["acc"], t["ak"], t["av"], self.deterministic
        return {"flash_epilogue": lambda: torch.ops.flash_epilogue.gqa_accumulate(
                    pk, pv, acc.dk_accum, acc.dv_accum, acc.semaphores if det else None, cu_seqlens=cu, seqused=None,
                    deterministic=det, _arch=acc.arch),
                "torch_eager": lambda: B.eager_gqa_accumulate(pk, pv, ak, av),
                "torch_compile": B.compiled_call("gqa_accumulate", pk, pv, ak, av),
                "torch_compile_dynamic": B.compiled_call("gqa_accumulate", pk, pv, ak, av, dynamic=True),
                "triton": lambda: B.gsum2(pk, ak, pv, av, accum=True)}


class GQAAccumulateDetOp(GQAAccumulateOp):
    name, deterministic = "gqa_accumulate_det", True
    impls = ("flash_epilogue",)  # baselines: gqa_accumulate's rows (deterministic already)


class GQAPostprocessOp(Op):
    name, traffic = "gqa_postprocess", StoreOp.traffic

    def build(self, s, device):
        cu = s.cu_seqlens(device)
        acc = _accumulator(s, cu, device, False)
        acc.dk_accum.normal_()
        acc.dv_accum.normal_()
        ak, av = acc.to_dense(cu_seqlens=cu)  # the same values densely: outputs comparable bit for bit
        return {"acc": acc, "ak": ak, "av": av, "cu": cu, "dk": _empty(s, s.d, device), "dv": _empty(s, s.dv, device),
                "tk": _empty(s, s.d, device), "tv": _empty(s, s.dv, device)}

    def calls(self, s, t):
        acc, ak, av, dk, dv, cu = t["acc"], t["ak"], t["av"], t["dk"], t["dv"], t["cu"]
        return {"flash_epilogue": lambda: (torch.ops.flash_epilogue.gqa_postprocess(
                    acc.dk_accum, acc.dv_accum, dk, dv, scale_dk=SCALE_DK, scale_dv=SCALE_DV, cu_seqlens=cu,
                    seqused=None, _arch=acc.arch), dk, dv)[1:],
                "torch_eager": lambda: B.eager_gqa_postprocess(ak, av, SCALE_DK, SCALE_DV),
                "torch_compile": B.compiled_call("gqa_postprocess", ak, av, SCALE_DK, SCALE_DV,
                                                 shapes=(dk.shape, dv.shape)),
                "torch_compile_dynamic": B.compiled_call("gqa_postprocess", ak, av, SCALE_DK, SCALE_DV,
                                                         shapes=(dk.shape, dv.shape), dynamic=True),
                "triton": lambda: B.cvt2(ak, t["tk"], av, t["tv"], SCALE_DK, SCALE_DV)}


def make_ops(names: list[str]) -> list[Op]:
    """One Op per name; gqa_reduce is timed with fp32 and bf16 partials."""
    kinds = {"store": [StoreOp()], "store_varlen": [StoreVarlenOp()], "store_zero": [StoreZeroOp()],
             "gqa_reduce": [GQAReduceOp(torch.float32), GQAReduceOp(torch.bfloat16)],
             "gqa_accumulate": [GQAAccumulateOp()], "gqa_accumulate_det": [GQAAccumulateDetOp()],
             "gqa_postprocess": [GQAPostprocessOp()]}
    return [op for n in names for op in kinds[n]]


def shapes_for(op: Op, shapes: list[Shape]) -> list[Shape]:
    if op.name == "store":
        return [s for s in shapes if not s.varlen]
    if op.name == "store_varlen":
        return [s for s in shapes if s.varlen] + [s.as_packed() for s in shapes if not s.varlen]
    return list(shapes)


def mismatch(got, want, tol: Optional[dict]) -> Optional[str]:
    """None when every output equals the expected one (bitwise, or within tol), else what differs."""
    for i, (g, w) in enumerate(zip(got, want)):
        try:
            if tol:
                torch.testing.assert_close(g.float(), w.float(), **tol)
            else:
                torch.testing.assert_close(g, w, rtol=0, atol=0)
        except AssertionError as e:
            return f"output {i}: " + " ".join(str(e).splitlines()[:4])
    return None


def run_problem(args, op: Op, shape: Shape, l2: int, ctx: dict) -> None:
    """The rows of one (op, shape) into ctx: each impl checked against torch eager's outputs from
    the initial state (a fast wrong kernel shows in "check"), then timed over the rotated copies."""
    label, nbytes = f"{op.name}[{op.dtype_name}] {shape.name}", op.traffic(shape)
    n_rot = rotation(op.footprint(shape), l2)
    torch.manual_seed(0)
    insts = [op.build(shape, "cuda") for _ in range(n_rot)]
    # every check starts from this copy of the initial state: timing loops write into insts[0]
    pristine, ref, line = op.fresh(insts[0]), None, []
    repeats = args.repeats
    for impl in [i for i in IMPLS if i in args.impls and i in op.impls]:
        if impl.startswith("torch_compile") and ctx["compile_spent"] > args.compile_budget:
            ctx["skipped"].append({"op": op.name, "name": shape.name, "impl": impl, "why": "compile budget spent"})
            continue
        try:
            ref = ref or [o.clone() for o in op.calls(shape, op.fresh(pristine))["torch_eager"]()]
            t0, state = time.time(), op.fresh(pristine)
            out = op.calls(shape, state)[impl]()
            if impl == "flash_epilogue" and op.name.startswith("gqa_accumulate"):
                out = state["acc"].to_dense(cu_seqlens=state["cu"])
            torch.cuda.synchronize()
            why = mismatch(out, ref, op.tol)
            check = "ok" if not why else "MISMATCH vs torch_eager: " + why
            if why:
                log(f"  WARNING {label} {impl}: {check}")
            del out, state
            if impl.startswith("torch_compile"):
                ctx["compile_spent"] += time.time() - t0
                ctx["compile_s"][f"{op.key(shape)}/{shape.name}/{impl}"] = round(time.time() - t0, 2)
            fn = rotating([op.calls(shape, t)[impl] for t in insts])
            runs = [do_bench_median(fn, args.warmup, args.rep) for _ in range(repeats)]
        except Exception as e:  # noqa: BLE001
            ctx["errors"].append({"op": op.name, "name": shape.name, "impl": impl, "error": repr(e)[:500]})
            log(f"  {label} {impl}: FAILED {e!r}"[:400])
            continue
        ms = statistics.median(runs)
        ctx["rows"].append({"op": op.name, "shape": shape.shape_list(), "impl": impl, "ms": ms,
                            "TBps": nbytes / ms / 1e9, "name": shape.name, "layout": shape.layout,
                            "dtype": op.dtype_name, "bytes": nbytes, "rotation": n_rot, "check": check,
                            **({"runs_ms": runs} if repeats > 1 else {})})
        line.append(f"{impl} {nbytes / ms / 1e9:5.2f}")
    if isinstance(op, GQAAccumulateDetOp):  # gqa_accumulate's baselines, shared
        ctx["rows"] += [dict(r, op=op.name, shared_with="gqa_accumulate") for r in ctx["rows"]
                        if r["op"] == "gqa_accumulate" and r["name"] == shape.name and r["impl"] != "flash_epilogue"]
    log(f"  {label:58s} {nbytes / MB:8.1f} MB  x{n_rot:<2d} " + "  ".join(line) + "  TB/s")


def run_gpu(args, ops: list[Op], shapes: list[Shape]) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("bench_ops: no CUDA device")
    t_start, env = time.time(), environment()
    log(f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, driver {env['driver']}, triton {env['triton']}, "
        f"SM clock {env['clocks']['sm']} (max {env['clocks']['max_sm']}), L2 {env['l2_bytes'] / 2**20:.0f} MiB")
    copy_start = copy_roofline(args.warmup, args.rep)
    log(f"copy roofline: {copy_start:.3f} TB/s")
    ctx, interrupted = {"rows": [], "errors": [], "skipped": [], "compile_s": {}, "compile_spent": 0.0}, []
    # SIGINT (gpu_check.sh's `timeout -s INT`): finish the row being measured, then write the rows so
    # far, marked "interrupted" (a hung kernel is still killed by timeout -k)
    signal.signal(signal.SIGINT, lambda *_: interrupted.append(time.time() - t_start))
    for op in ops:
        for shape in shapes_for(op, shapes):
            if interrupted:
                break
            try:
                run_problem(args, op, shape, env["l2_bytes"], ctx)
            except Exception as e:  # noqa: BLE001 (building the tensors failed)
                ctx["errors"].append({"op": op.name, "name": shape.name, "impl": "build", "error": repr(e)[:500]})
                log(f"  {op.name} {shape.name}: BUILD FAILED {e!r}")
            gc.collect()
            torch.cuda.empty_cache()
        log(f"[{time.time() - t_start:6.1f} s] {op.name}[{op.dtype_name}] {'INTERRUPTED' if interrupted else 'done'}")
        if interrupted:
            break
    host, tiny = None, [s for s in shapes if s.name.startswith("tiny_")]
    if tiny and "store" in args.ops and not interrupted:
        try:  # host + GPU per call in a Python loop at the tiny shape
            calls = host_calls(tiny[0].b, tiny[0].s, tiny[0].hk, tiny[0].d)["store"]
            host = {"shape": tiny[0].shape_list(), HOST_FE: host_loop(calls["wrapper"])[1],
                    "torch.ops.flash_epilogue.store": host_loop(calls["torch.ops"])[1],
                    HOST_TO: host_loop(calls["torch .to x2"])[1]}
        except Exception as e:  # noqa: BLE001
            ctx["errors"].append({"op": "host_loop", "name": tiny[0].name, "impl": "", "error": repr(e)[:500]})
    layer = None
    if args.layer and not interrupted:
        try:
            layer = attention_layer_ms(args.warmup, args.rep)
            log("attention layer (SDPA fwd + bwd, " + ", ".join(f"{k}={v}" for k, v in LAYER.items())
                + ", causal, bf16): " + ", ".join(f"{k} {v:.3f} ms" for k, v in layer.items() if k != "shape"))
        except Exception as e:  # noqa: BLE001
            ctx["errors"].append({"op": "attention_layer", "name": "", "impl": "", "error": repr(e)[:500]})
    copy_end = None if interrupted else copy_roofline(args.warmup, args.rep)
    log(f"copy roofline at the end: {copy_end or 0:.3f} TB/s; total {time.time() - t_start:.0f} s "
        f"(compile warm-ups {ctx['compile_spent']:.0f} s)")
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"gpu": env["gpu"], "date": now.date().isoformat(), "commit": args.commit, "copy_TBps": copy_start,
            "rows": ctx["rows"], "timestamp": now.isoformat(timespec="seconds"),
            **{k: env[k] for k in ("torch", "cuda", "driver", "triton", "flash_epilogue", "python", "sm_count",
                                   "l2_bytes", "clocks")},
            "copy_TBps_end": copy_end, "api": "op", "quick": args.quick,
            "method": {"timer": "triton.testing.do_bench(return_mode='median')", "warmup_ms": args.warmup,
                       "rep_ms": args.rep, "repeats": args.repeats,
                       "bytes": "minimum traffic: inputs read once, outputs written once; accumulate: + accumulator "
                                "read and write (dense fp32); store_zero: valid rows written",
                       "rotation": "buffer copies cycled so a problem's set is >= 3x L2",
                       "scales": {"gqa_postprocess": [SCALE_DK, SCALE_DV], "gqa_reduce": [1.0, 1.0]}},
            "host_loop_us": host, "attention_layer_ms": layer, "compile_warmup_s": ctx["compile_s"],
            "errors": ctx["errors"],
            "skipped": ctx["skipped"], "elapsed_s": round(time.time() - t_start, 1), "interrupted": bool(interrupted)}


def _index(rows):
    return {(r["op"], r["name"], r.get("dtype", ""), r["impl"]): r for r in rows}


def targets(result: dict) -> list[dict]:
    """The performance targets, each a ratio measured in this run against the peers
    of its row: torch eager, torch.compile static and dynamic, plain Triton."""
    idx, out = _index(result["rows"]), []
    peers = ("torch_eager", "torch_compile", "torch_compile_dynamic", "triton")

    def add(op, name, dtype, metric, value, target, ok):
        out.append({"op": op, "name": name, "dtype": dtype, "metric": metric, "value": value, "target": target,
                    "met": bool(ok)})

    for op, name, dtype in dict.fromkeys((r["op"], r["name"], r.get("dtype", "")) for r in result["rows"]):
        get = lambda impl: idx.get((op, name, dtype, impl))  # noqa: E731
        fe_row, tiny = get("flash_epilogue"), name.startswith("tiny_") or name.startswith("packed_tiny_")
        if not fe_row:
            continue
        if op in ("store", "store_varlen"):
            if get("torch_eager"):
                ratio = get("torch_eager")["ms"] / fe_row["ms"]
                add(op, name, dtype, "torch .to ms / fe ms", ratio, ">= 1.0", ratio >= 1.0)
            if get("triton") and fe_row["bytes"] > BIG_BYTES:
                ratio = get("triton")["ms"] / fe_row["ms"]
                add(op, name, dtype, "fe TB/s / triton TB/s", ratio, ">= 0.97", ratio >= 0.97)
        elif op == "gqa_reduce" and not tiny:
            best = min((get(i) for i in peers if get(i)), key=lambda r: r["ms"], default=None)
            if best:
                ratio = best["ms"] / fe_row["ms"]
                add(op, name, dtype, f"best peer ({best['impl']}) ms / fe ms", ratio, ">= 1.0", ratio >= 1.0)
        elif op == "gqa_accumulate" and not tiny and get("triton"):
            ratio = get("triton")["ms"] / fe_row["ms"]
            add(op, name, dtype, "fe TB/s / triton TB/s", ratio, ">= 0.97", ratio >= 0.97)
        elif op == "gqa_accumulate_det" and not tiny and idx.get(("gqa_accumulate", name, dtype, "flash_epilogue")):
            ratio = fe_row["ms"] / idx[("gqa_accumulate", name, dtype, "flash_epilogue")]["ms"]
            add(op, name, dtype, "det ms / non-det ms", ratio, "<= 1.05", ratio <= 1.05)
    host = result.get("host_loop_us") or {}
    if host.get(HOST_FE) and host.get(HOST_TO):
        add("store", "tiny host loop", "float32", "fe.store us / (.to x2) us", host[HOST_FE] / host[HOST_TO], "< 1",
            host[HOST_FE] < host[HOST_TO])
    return out


def load_baseline(args) -> Optional[dict]:
    """The last committed results: --baseline, else git HEAD's file, else the file in the tree."""
    path = args.baseline or os.path.join(REPO, f"benchmarks/results/{args.name}.json")
    text = "" if args.baseline else run_cmd(["git", "-C", REPO, "show", f"HEAD:benchmarks/results/{args.name}.json"])
    if not text and os.path.exists(path):
        with open(path) as f:
            text = f.read()
    return json.loads(text) if text else None


def compare(result: dict, base: Optional[dict], threshold: float = 0.02) -> dict:
    """Rows slower than the baseline's by more than `threshold`: ours are regressions, the
    baselines' machine drift (a small-row flag counts only when a second run repeats it)."""
    if not base:
        log("no previous results to compare with")
        return {"baseline": None}
    bidx, regressions, drift = _index(base.get("rows", [])), [], []
    for r in result["rows"]:
        b = bidx.get((r["op"], r["name"], r.get("dtype", ""), r["impl"]))
        if not r.get("shared_with") and b and b.get("ms") and r["ms"] / b["ms"] - 1 > threshold:
            (regressions if r["impl"] == "flash_epilogue" else drift).append(
                {"op": r["op"], "name": r["name"], "dtype": r.get("dtype", ""), "impl": r["impl"], "ms": r["ms"],
                 "base_ms": b["ms"], "change": r["ms"] / b["ms"] - 1})
    log(f"\ncompared with {base.get('commit', '?')} ({base.get('date', '?')}): copy {base.get('copy_TBps', 0):.3f} "
        f"-> {result['copy_TBps']:.3f} TB/s")
    log(f"REGRESSIONS over {threshold:.0%} (flash_epilogue):" if regressions else
        f"no flash_epilogue regression over {threshold:.0%}")
    for x in regressions:
        log(f"  {x['op']}[{x['dtype']}] {x['name']}: {x['base_ms'] * 1e3:.1f} -> {x['ms'] * 1e3:.1f} us "
            f"(+{x['change']:.1%})")
    if drift:
        log(f"baselines slower by over {threshold:.0%} (machine drift?): "
            + ", ".join(f"{x['op']}/{x['name']}/{x['impl']} +{x['change']:.0%}" for x in drift[:12]))
    return {"baseline": {"commit": base.get("commit"), "date": base.get("date")}, "threshold": threshold,
            "regressions": regressions, "baseline_drift": drift}


def print_tables(result: dict) -> None:
    idx = _index(result["rows"])
    log(f"\nTB/s (us) per op and shape; copy roofline {result.get('copy_TBps') or 0:.2f} TB/s")
    if result.get("interrupted"):
        log("PARTIAL: the run was interrupted (SIGINT); rows and targets after that point are missing")
    log(f"{'op':20s} {'dtype':8s} {'shape':34s} " + " ".join(f"{i:>17s}" for i in IMPLS))
    for k in dict.fromkeys((r["op"], r["name"], r.get("dtype", "")) for r in result["rows"]):
        log(f"{k[0]:20s} {k[2]:8s} {k[1]:34s} " + " ".join(f"{x['TBps']:5.2f} ({x['ms'] * 1e3:7.1f}us)" if x else
                                                           f"{'-':>17s}" for x in (idx.get(k + (i,)) for i in IMPLS)))
    for k, v in (result.get("host_loop_us") or {}).items():
        if k != "shape":
            log(f"  tiny shape, per call in a Python loop: {k:52s} {v:8.1f} us")
    tg = result.get("targets") or []
    log(f"\ntargets: {sum(t['met'] for t in tg)} of {len(tg)} met")
    for t in tg:
        log(f"{t['op']:20s} {t['dtype']:8s} {t['name']:34s} {t['metric']:34s} {t['value']:7.3f} "
            f"{t['target']:>8s} {'ok' if t['met'] else 'MISSED'}")
    for e in result.get("errors") or []:
        log(f"ERROR {e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="results folder")
    p.add_argument("--name", default="h200", help="file stem of the results (default h200)")
    p.add_argument("--commit", default=None, help="commit measured (default $FLASH_EPILOGUE_COMMIT, else git HEAD)")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of: " + ", ".join(OPS))
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of: " + ", ".join(IMPLS))
    p.add_argument("--quick", action="store_true", help="3 shapes, one run each: a smoke run")
    p.add_argument("--repeats", type=int, default=None,
                   help="do_bench runs per row, the row's time their median (default 3; quick 1)")
    p.add_argument("--warmup", type=float, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=float, default=100, help="do_bench rep, ms")
    p.add_argument("--no-layer", dest="layer", action="store_false",
                   help="skip the attention-layer timing (SDPA with fe.repeat_kv / transformers' / enable_gqa)")
    p.add_argument("--compile-budget", type=float, default=420,
                   help="seconds of torch.compile warm-ups after which compile rows are skipped")
    p.add_argument("--baseline", default=None, help="results to compare with (default: git HEAD's NAME.json)")
    p.add_argument("--from-json", default=None, help="no run: tables, targets, CSV and PNG from this results file "
                                                     "(written next to it)")
    p.add_argument("--readme-table", action="store_true",
                   help="with --from-json: print only the README's performance table (markdown), write nothing")
    args = p.parse_args(argv)
    args.commit, args.repeats = args.commit or default_commit(), args.repeats or (1 if args.quick else 3)
    args.ops, args.impls = ([x.strip() for x in v.split(",") if x.strip()] for v in (args.ops, args.impls))
    for what, given, allowed in (("--ops", args.ops, OPS), ("--impls", args.impls, IMPLS)):
        for x in set(given) - set(allowed):
            p.error(f"{what}: unknown {x!r} (choose from {', '.join(allowed)})")
    if args.readme_table and not args.from_json:
        p.error("--readme-table needs --from-json")
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        if args.readme_table:
            log(readme_table(result))
            return 0
        result["targets"] = targets(result)
        print_tables(result)
        write_csv(result, os.path.splitext(args.from_json)[0] + ".csv")
        write_plot(result, os.path.splitext(args.from_json)[0] + ".png")
        return 0
    baseline = load_baseline(args)  # before writing: --out may be the folder of the committed file
    result = run_gpu(args, make_ops(args.ops), all_shapes(args.quick))
    result["targets"] = targets(result)
    result["comparison"] = compare(result, baseline)
    print_tables(result)
    write_outputs(result, args.out, args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
