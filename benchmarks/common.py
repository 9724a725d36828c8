"""What every benchmark here shares: the shapes, the timers, the traffic rules and the writers.

Rules (docs/performance.md, method): GPU time is the median of triton.testing.do_bench (it clears
L2 before each call); a problem whose buffers are smaller than 3x L2 cycles through copies of them;
bytes are the minimum traffic (every input read once, every output written once); the ceiling is a
1 GiB device-to-device copy; host time is microseconds per call in a plain Python loop.
"""
from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a source checkout without an install
    sys.path.insert(0, REPO)

OUT = torch.bfloat16
MB = 1e6
L2_DEFAULT = 60 * 1024 * 1024
IMPLS = ("flash_epilogue", "torch_eager", "torch_compile", "torch_compile_dynamic", "triton")


def log(msg: str = "") -> None:
    print(msg, flush=True)


@dataclasses.dataclass(frozen=True)
class Shape:
    """(batch, seqlen, h_k, group, d, dv); varlen: `lengths` of the sequences, seqlen unused."""

    name: str
    b: int
    s: int
    hk: int
    g: int
    d: int
    dv: int
    lengths: Optional[tuple[int, ...]] = None
    packed: bool = False  # a batched shape packed as varlen (equal lengths)

    hq = property(lambda self: self.hk * self.g)
    varlen = property(lambda self: self.lengths is not None)
    layout = property(lambda self: "varlen" if self.varlen else "batched")
    rows = property(lambda self: sum(self.lengths) if self.varlen else self.b * self.s)  # token rows

    def shape_list(self) -> list[int]:
        """[batch, seqlen, h_k, group, d, dv]; varlen: [sequences, total_tokens, h_k, group, d, dv]."""
        return [self.b, self.rows if self.varlen else self.s, self.hk, self.g, self.d, self.dv]

    def lead(self) -> tuple[int, ...]:
        """Leading dims of every tensor: (b, s), or (total,) in varlen."""
        return (self.rows,) if self.varlen else (self.b, self.s)

    def as_packed(self) -> "Shape":
        """The same tokens as a varlen batch of `b` equal-length sequences."""
        if self.varlen:
            return self
        return dataclasses.replace(self, name="packed_" + self.name, lengths=(self.s,) * self.b, packed=True)

    def cu_seqlens(self, device) -> Optional[torch.Tensor]:
        if not self.varlen:
            return None
        return torch.tensor(list(itertools.accumulate((0,) + self.lengths)), dtype=torch.int32, device=device)


def batched(b, s, hk, g, d, dv=None, prefix="") -> Shape:
    dv = d if dv is None else dv
    return Shape(f"{prefix}b{b}_s{s}_hk{hk}_g{g}_d{d}" + (f"_dv{dv}" if dv != d else ""), b, s, hk, g, d, dv)


def all_shapes(quick: bool = False) -> list[Shape]:
    """The benchmark shapes, a 32k-token varlen batch (random lengths up to 4096, fixed seed) and a tiny one."""
    rng, lengths = random.Random(0), []
    while sum(lengths) < 32768:
        lengths.append(min(rng.randint(1, 4096), 32768 - sum(lengths)))
    varlen = Shape("varlen32k_hk8_g4_d128", len(lengths), 0, 8, 4, 128, 128, lengths=tuple(lengths))
    tiny, main = batched(1, 512, 8, 4, 128, prefix="tiny_"), batched(4, 8192, 8, 4, 128)
    if quick:
        return [main, varlen, tiny]
    return [main, batched(2, 16384, 8, 8, 128), batched(8, 4096, 4, 8, 64), batched(2, 8192, 8, 4, 256),
            batched(1, 8192, 1, 8, 128), batched(2, 8192, 16, 1, 192, 128), varlen, tiny]


def rotation(footprint: int, l2_bytes: int, cap: int = 64) -> int:
    """Copies of a problem's buffers to cycle through so that the set is >= 3x L2."""
    return max(1, min(cap, math.ceil(3 * l2_bytes / max(footprint, 1))))


def rotating(fns: list[Callable]) -> Callable:
    """One call of fns' next each time (fns[0] itself when there is one)."""
    it = itertools.cycle(fns)
    return fns[0] if len(fns) == 1 else lambda: next(it)()


def do_bench_median(fn, warmup: float = 25, rep: float = 100, grad_to_none=None) -> float:
    """Milliseconds: do_bench's median."""
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"))


def copy_roofline(warmup: float = 25, rep: float = 100) -> float:
    """TB/s of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench_median(lambda: dst.copy_(src), warmup, rep)
    return 2 * (1 << 28) * 4 / ms / 1e9


def host_loop(fn, iters: int = 1000, repeats: int = 5) -> tuple[float, float]:
    """(host, loop) microseconds per call of fn in a Python loop, medians over `repeats` loops:
    host stops before the final synchronize (the CPU's cost while the GPU keeps up), loop after it."""
    sync = torch.cuda.synchronize
    for _ in range(50):
        fn()
    sync()
    host, loop = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t1 = time.perf_counter()
        sync()
        host.append((t1 - t0) / iters * 1e6)
        loop.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(host), statistics.median(loop)


def run_cmd(cmd) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def default_commit() -> str:
    env = os.environ.get("FLASH_EPILOGUE_COMMIT", "unknown")
    return env if env != "unknown" else run_cmd(["git", "-C", REPO, "rev-parse", "--short", "HEAD"]) or "unknown"


def environment() -> dict:
    import triton

    import flash_epilogue as fe
    props = torch.cuda.get_device_properties(0)
    smi = run_cmd(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.max.sm,clocks.mem",
                   "--format=csv,noheader"]).split(", ")
    smi += [""] * (4 - len(smi))
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "driver": smi[0], "triton": triton.__version__, "flash_epilogue": fe.__version__,
            "python": sys.version.split()[0], "sm_count": props.multi_processor_count,
            "l2_bytes": getattr(props, "L2_cache_size", 0) or L2_DEFAULT,
            "clocks": {"sm": smi[1], "max_sm": smi[2], "mem": smi[3]}}


def write_json(obj: dict, path: str) -> None:
    """Compact and diffable: a line per top-level entry, and per element of a top-level list or dict."""
    def entry(value) -> str:
        if isinstance(value, list) and value:
            return "[\n" + ",\n".join("  " + json.dumps(x) for x in value) + "\n ]"
        if isinstance(value, dict) and value:
            return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()) + "\n }"
        return json.dumps(value)

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("{\n" + ",\n".join(f" {json.dumps(k)}: {entry(v)}" for k, v in obj.items()) + "\n}\n")


def write_csv(result: dict, path: str) -> None:
    copy = result.get("copy_TBps") or float("nan")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["op", "name", "layout", "dtype", "shape", "impl", "ms", "TBps", "frac_of_copy", "bytes", "rotation",
                    "check", "shared_with"])
        for r in result["rows"]:
            w.writerow([r["op"], r.get("name", ""), r.get("layout", ""), r.get("dtype", ""),
                        "x".join(map(str, r["shape"])), r["impl"], f"{r['ms']:.6f}", f"{r['TBps']:.4f}",
                        f"{r['TBps'] / copy:.4f}", r.get("bytes", ""), r.get("rotation", ""), r.get("check", ""),
                        r.get("shared_with", "")])


# The README's performance table: these rows of a results file (op, dtype, shape name, label), every impl.
README_ROWS = (
    ("store", "float32", "b4_s8192_hk8_g4_d128", "store (fp32)"),
    ("store", "float32", "b8_s4096_hk4_g8_d64", "store (fp32)"),
    ("store", "float32", "b2_s8192_hk8_g4_d256", "store (fp32)"),
    ("store", "float32", "tiny_b1_s512_hk8_g4_d128", "store (fp32)"),
    ("store_varlen", "float32", "varlen32k_hk8_g4_d128", "store_varlen (fp32)"),
    ("store_zero", "bfloat16", "b4_s8192_hk8_g4_d128", "store_zero"),
    ("gqa_reduce", "float32", "b4_s8192_hk8_g4_d128", "gqa_reduce (fp32)"),
    ("gqa_reduce", "float32", "b2_s16384_hk8_g8_d128", "gqa_reduce (fp32)"),
    ("gqa_reduce", "float32", "b2_s8192_hk16_g1_d192_dv128", "gqa_reduce (fp32)"),
    ("gqa_reduce", "bfloat16", "b4_s8192_hk8_g4_d128", "gqa_reduce (bf16)"),
    ("gqa_reduce", "bfloat16", "b8_s4096_hk4_g8_d64", "gqa_reduce (bf16)"),
    ("gqa_reduce", "bfloat16", "varlen32k_hk8_g4_d128", "gqa_reduce (bf16)"),
    ("gqa_accumulate", "float32", "b4_s8192_hk8_g4_d128", "gqa_accumulate (fp32)"),
    ("gqa_accumulate", "float32", "b8_s4096_hk4_g8_d64", "gqa_accumulate (fp32)"),
    ("gqa_accumulate", "float32", "b2_s8192_hk8_g4_d256", "gqa_accumulate (fp32)"),
    ("gqa_accumulate", "float32", "varlen32k_hk8_g4_d128", "gqa_accumulate (fp32)"),
    ("gqa_accumulate_det", "float32", "b4_s8192_hk8_g4_d128", "gqa_accumulate, deterministic"),
    ("gqa_postprocess", "float32", "b4_s8192_hk8_g4_d128", "gqa_postprocess (fp32)"),
)
README_HEADER = ("| op (inputs) | shape | flash_epilogue | torch eager | torch.compile | torch.compile dynamic | "
                 "plain Triton |\n|---|---|---|---|---|---|---|")


def readme_table(result: dict) -> str:
    """The README's performance table (README_ROWS) from a results file, as markdown: TB/s (us) per impl."""
    idx = {(r["op"], r.get("dtype", ""), r["name"], r["impl"]): r for r in result["rows"]}
    lines = [README_HEADER]
    for op, dtype, name, label in README_ROWS:
        cells = [f"{x['TBps']:.2f} ({x['ms'] * 1e3:.0f} us)" if x else ""
                 for x in (idx.get((op, dtype, name, impl)) for impl in IMPLS)]
        if op == "gqa_accumulate_det":  # one kernel for both modes: the baselines are gqa_accumulate's rows
            cells = [cells[0], "(gqa_accumulate's baselines)", "", "", ""]
        lines.append(f"| {label} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _short(name: str) -> str:
    return (name.replace("packed_", "pk ").replace("tiny_", "tiny ").replace("_hk", " hk").replace("_g", " g")
            .replace("_d", " d").replace("_s", " s").replace("_", " "))


def write_plot(result: dict, path: str) -> bool:
    """One bar panel per (op, input dtype): TB/s of each impl per shape, the copy roofline dashed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        log(f"matplotlib is not importable: no plot (run `python benchmarks/bench_ops.py --from-json "
            f"{os.path.splitext(path)[0]}.json` where it is)")
        return False
    panels = list(dict.fromkeys((r["op"], r.get("dtype", "")) for r in result["rows"]))
    nrows = max(1, math.ceil(len(panels) / 2))
    fig, axes = plt.subplots(nrows, 2, figsize=(16, 3.6 * nrows), squeeze=False)
    colors = dict(zip(IMPLS, ("tab:blue", "tab:orange", "tab:green", "tab:olive", "tab:purple")))
    copy, width = result.get("copy_TBps"), 0.8 / len(IMPLS)
    for ax, (op, dtype) in zip(axes.flat, panels):
        rows = [r for r in result["rows"] if r["op"] == op and r.get("dtype", "") == dtype]
        names = list(dict.fromkeys(r["name"] for r in rows))
        for j, impl in enumerate(IMPLS):
            hits = [(i, r["TBps"]) for i, n in enumerate(names) for r in rows if r["name"] == n and r["impl"] == impl]
            if hits:
                ax.bar([i + (j - (len(IMPLS) - 1) / 2) * width for i, _ in hits], [y for _, y in hits], width,
                       color=colors[impl])
        ax.axhline(copy or 0, color="red", linestyle="--", linewidth=1)
        ax.set_ylim(0, 1.12 * max([copy or 0] + [r["TBps"] for r in rows]))
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([_short(n) for n in names], rotation=20, ha="right", fontsize=7)
        ax.set_ylabel("TB/s")
        ax.set_title(f"{op}" + (f" ({dtype} in)" if dtype else ""), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    present = [i for i in IMPLS if any(r["impl"] == i for r in result["rows"])]
    handles = [Patch(color=colors[i]) for i in present] + [Line2D([], [], color="red", linestyle="--", linewidth=1)]
    labels = present + [f"device copy {copy or 0:.2f} TB/s"]
    fig.suptitle(f"flash_epilogue vs torch eager / torch.compile / Triton: {result.get('gpu')}, torch "
                 f"{result.get('torch')}, {result.get('date')} (TB/s, minimum traffic)",
                 y=0.995, fontsize=11)
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.975), ncol=5, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_outputs(result: dict, out_dir: str, name: str) -> None:
    """DIR/NAME.json, DIR/NAME.csv and DIR/NAME.png (the plot only where matplotlib is)."""
    base = os.path.join(out_dir, name)
    write_json(result, base + ".json")
    write_csv(result, base + ".csv")
    log(f"wrote {base}.json, {base}.csv" + (f", {base}.png" if write_plot(result, base + ".png") else ""))
