"""The harness of the bad-input table (test_bad_inputs.py): each op's baseline call, the changes of its arguments, the
checks of a call and of the process's health; and the bad inputs outside the table.
"""
import collections
import dataclasses
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import flash_epilogue as fe
from conftest import bits, deterministic_algorithms, rand, run_checked
from flash_epilogue import reference as ref

BF16, F16, F32, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int32
B, S, H_K, H_Q, D, TOTAL = 2, 40, 2, 4, 64, 80  # the baseline problem; varlen: cu_seqlens [0, 30, 80]
OPS, DKV, STORE4, PARTIALS = torch.ops.flash_epilogue, ("dk", "dv"), ("dk_accum", "dv_accum", "dk", "dv"), (
    "dk_partial", "dv_partial")
INPUT, TYPE = fe.FlashEpilogueInputError, fe.FlashEpilogueTypeError  # a ValueError (and not a TypeError); a TypeError
PY = (INPUT,)  # a wrong Python scalar type seen by the wrapper: INPUT or its subclass TYPE
RAW = (RuntimeError,)  # the dispatcher's own schema error (an op called directly): not our message format
Row = collections.namedtuple("Row", "op match cls cpu gpus changes")  # a row of the table (R below)


def z(d, *shape, dtype=F32):
    return torch.zeros(shape, dtype=dtype, device=d)


def i32(d, *vals):
    return torch.tensor(vals, dtype=I32, device=d)


def accumulator(d, deterministic=True, varlen=False, h_k=H_K, hd=D, **kw):
    layout = {"cu_seqlens": i32(d, 0, 30, TOTAL), "total_tokens": TOTAL} if varlen else {"batch": B, "seqlen": S}
    return fe.gqa_accumulator(h_k, hd, deterministic=deterministic, device=d, **{**layout, **kw})


def dense(d, *names, varlen=False, **more):
    """The baseline's zeros: bf16 dk, dv; fp32 accumulators; fp32 partials of the H_Q query heads; cu_seqlens; more."""
    lead = (TOTAL,) if varlen else (B, S)
    out = {n: z(d, *lead, H_Q if "part" in n else H_K, D, dtype=BF16 if n in DKV else F32) for n in names}
    return out | ({"cu_seqlens": i32(d, 0, 30, TOTAL)} if varlen else {}) | more


def accumulate_args(d, varlen=False, op=False):
    acc = accumulator(d, varlen=varlen)
    return dense(d, *PARTIALS, varlen=varlen) | ({"dk_accum": acc.dk_accum, "dv_accum": acc.dv_accum, "semaphores":
                                                  acc.semaphores, "deterministic": True} if op else {"acc": acc})


def raw(op):
    return lambda **kw: getattr(OPS, op)(**kw)  # looked up when called: a build without the ops still collects


# fn(**build(device)) is a valid call; name: the op named in messages (None: a reference function, messages of
# its own); cpu_runs: the valid call runs on CPU tensors (else it stops at the device check)
Op = collections.namedtuple("Op", "fn build name cpu_runs", defaults=(False,))
OP = {
    "store": Op(fe.store, lambda d: dense(d, *STORE4), "store"),
    "store_varlen": Op(fe.store, lambda d: dense(d, *STORE4, varlen=True), "store"),
    "store_op": Op(raw("store"), lambda d: dense(d, *STORE4), "store"),
    "store_zero": Op(fe.store_zero, lambda d: dense(d, *DKV), "store_zero"),
    "store_zero_varlen": Op(fe.store_zero, lambda d: dense(d, *DKV, varlen=True), "store_zero"),
    "store_zero_op": Op(raw("store_zero"), lambda d: dense(d, *DKV), "store_zero"),
    "gqa_accumulator": Op(fe.gqa_accumulator, lambda d: dict(num_heads_kv=H_K, head_dim=D, batch=B, seqlen=S, device=d),
                          "gqa_accumulator", True),
    "gqa_accumulate": Op(fe.gqa_accumulate, accumulate_args, "gqa_accumulate"),
    "gqa_accumulate_varlen": Op(fe.gqa_accumulate, lambda d: accumulate_args(d, True), "gqa_accumulate"),
    "gqa_accumulate_det": Op(deterministic_algorithms()(fe.gqa_accumulate), accumulate_args, "gqa_accumulate"),
    "gqa_accumulate_op": Op(raw("gqa_accumulate"), lambda d: accumulate_args(d, op=True), "gqa_accumulate"),
    "gqa_accumulate_varlen_op": Op(raw("gqa_accumulate"), lambda d: accumulate_args(d, True, True), "gqa_accumulate"),
    "gqa_postprocess": Op(fe.gqa_postprocess, lambda d: dense(d, *DKV, acc=accumulator(d, False)), "gqa_postprocess"),
    "gqa_postprocess_op": Op(raw("gqa_postprocess"), lambda d: dense(d, *DKV) | {
        k: getattr(accumulator(d, False), k) for k in ("dk_accum", "dv_accum")}, "gqa_postprocess"),
    "to_dense": Op(lambda acc, **kw: acc.to_dense(**kw), lambda d: {"acc": accumulator(d, False)},
                   "gqa_accum_to_dense"),
    "to_dense_varlen": Op(lambda acc, **kw: acc.to_dense(**kw), lambda d: {"acc": accumulator(d, False, True),
                          "cu_seqlens": i32(d, 0, 30, TOTAL)}, "gqa_accum_to_dense"),
    "gqa_accum_to_dense_op": Op(raw("gqa_accum_to_dense"), lambda d: dict(
        accum=accumulator(d).dk_accum, out=z(d, B, S, H_K, D), head_dim=D), "gqa_accum_to_dense"),
    "gqa_reduce": Op(fe.gqa_reduce, lambda d: dense(d, *PARTIALS, num_heads_kv=H_K), "gqa_reduce"),
    "gqa_reduce_varlen": Op(fe.gqa_reduce, lambda d: dense(d, *PARTIALS, varlen=True, num_heads_kv=H_K), "gqa_reduce"),
    "gqa_reduce_out": Op(fe.gqa_reduce, lambda d: dense(d, *PARTIALS, num_heads_kv=H_K, out=tuple(
        dense(d, *DKV).values())), "gqa_reduce"),
    "gqa_reduce_op": Op(raw("gqa_reduce"), lambda d: dense(d, *PARTIALS, *DKV), "gqa_reduce"),
    "gqa_reduce_varlen_op": Op(raw("gqa_reduce"), lambda d: dense(d, *PARTIALS, *DKV, varlen=True), "gqa_reduce"),
    "repeat_kv": Op(fe.repeat_kv, lambda d: {"x": z(d, B, H_K, S, D, dtype=BF16), "n_rep": 2}, "repeat_kv", True),
    "repeat_kv_op": Op(raw("repeat_kv"), lambda d: {"x": z(d, B, H_K, S, D, dtype=BF16), "n_rep": 2, "dim": 1},
                       "repeat_kv", True),
    "repeat_kv_backward_op": Op(raw("repeat_kv_backward"), lambda d: {"grad": z(d, 1, 4, 2, 8), "n_rep": 2, "dim": 1,
                                                                   "layout": [0, 1, 2]}, "repeat_kv_backward", True),
    "store_reference": Op(ref.store_reference, lambda d: dense(d, *STORE4), None, True),
    "gqa_reduce_reference": Op(ref.gqa_reduce_reference, lambda d: {"dk_partial": z(d, 1, 2, 6, 8), "num_heads_kv": 3,
                                                                    "out_dtype": F16}, None, True),
    "gqa_reduce_sequential_fp32": Op(ref.gqa_reduce_sequential_fp32, lambda d: {"partial": z(d, 1, 2, 6, 8),
                                                                                "num_heads_kv": 3}, None, True),
    "gqa_accumulate_reference": Op(ref.gqa_accumulate_reference, lambda d: dict(
        dk_partial=z(d, 10, 6, 8), dv_partial=None, dk_dense=z(d, 10, 3, 8), dv_dense=None, num_heads_kv=3,
        cu_seqlens=i32(d, 0, 10)), None, True),
}

# changes of the arguments: a value, on(f) = f(the baseline's value), or a callable (args, device) giving the value
on = collections.namedtuple("on", "fn")
WIDENED = on(lambda t: t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])[..., ::2])
EXPANDED = on(lambda t: t[:1].expand(t.shape))  # stride 0 on the first dim
OVERLAPPING = on(lambda t: t.new_zeros(t.numel()).as_strided(t.shape, (t.stride(0), t.shape[-1] // 2, t.stride(2), 1)))
FIRST, UNSQUEEZED, CPU_T, CUDA1 = on(lambda t: t[0]), on(lambda t: t[None]), on(torch.Tensor.cpu), on(
    lambda t: t.to("cuda:1"))


def cut(n, dim=-1):
    return on(lambda t: t.narrow(dim, 0, n))


def padded(extra):
    """t in a view whose row pitch (stride(-2)) is t.shape[-1] + extra elements."""
    return on(lambda t: t.new_zeros(*t.shape[:-1], t.shape[-1] + extra)[..., : t.shape[-1]])


def misaligned(nbytes=8):
    """t in a new tensor whose data starts `nbytes` past a 16-byte boundary."""
    return on(lambda t: t.new_zeros(t.numel() + 16)[nbytes // t.element_size():][: t.numel()].view(t.shape))


def ints(*vals, dev=None, step=1):
    return lambda a, d: i32(dev or d, *vals)[::step]


def zs(*shape, dtype=F32):
    return lambda a, d: z(d, *shape, dtype=dtype)


def alias(of, view=lambda t: t):
    return lambda a, d: view(a[of])


def like(of, dtype, shape=None):
    """A tensor of `shape` (default: `of`'s) viewing `of`'s memory as `dtype`."""
    return alias(of, lambda t: t.view(dtype).reshape(-1)[: torch.Size(shape or t.shape).numel()].view(shape or t.shape))


def replace_acc(**fields):
    return on(lambda acc: dataclasses.replace(acc, **fields))


def R(op, match, cls=INPUT, cpu=True, gpus=1, **changes):
    """match: a regex, searched after "flash_epilogue.<op>: "; cpu: the error comes before the device check."""
    if op.endswith(("_op", "reference", "fp32")):  # the op itself, a reference: a plain ValueError / TypeError
        cls = {INPUT: ValueError, TYPE: TypeError}.get(cls, cls)
    return Row(op, match, cls, cpu and gpus == 1, gpus, changes)


def each(where, match, change, cls=INPUT, **more):
    """A row per "op:arg,arg" of `where`: the change of arg (and `more`) raises "arg: " + match."""
    return [R(op, f"{k}: " + match, cls, **{k: change}, **more)
            for op, ks in (w.split(":") for w in where.split()) for k in ks.split(",")]


def sh(*dims):
    return re.escape(str(tuple(dims)))


def acc_shape(got, want=(2, 2, 1, 8192), h_k=2, d=64, c=64, a=90, of="batch 2, seqlen 40"):
    """The message for an accumulator of shape `got` where `want` (the baseline's by default) is expected."""
    return (rf"shape: expected {sh(*want)} \(the accumulator of {of}, {h_k} KV heads and head dim {d} in the tile of "
            rf"head dim {c} on the sm_{a} path: allocate it with flash_epilogue\.gqa_accumulator\), got {sh(*got)}")


def call(op, d, changes=()):
    a = op.build(d)
    for k, v in dict(changes).items():
        if k == "_":
            v(a, d)
        elif isinstance(v, on):
            a[k] = v.fn(a[k])
        else:
            a[k] = v(a, d) if callable(v) and not isinstance(v, (torch.Tensor, torch.dtype)) else v
    return op.fn(**a)


def check_accepted(op, d, changes=(), runs=False):
    """The call is accepted: it runs on the GPU (and on CPU when it can: allocation, repeat_kv, the references,
    meta tensors); on CPU tensors the op stops at its last check, the device check."""
    if d == "cuda" or op.cpu_runs or runs:
        call(op, d, changes)
        if d == "cuda":
            torch.cuda.synchronize()
        return
    with pytest.raises(ValueError, match=r"device: expected a CUDA tensor, got a tensor on cpu"):
        call(op, d, changes)


def assert_healthy():
    """A valid store, gqa_reduce and deterministic accumulate + postprocess give bitwise-right results and the
    device synchronizes without a (sticky) error."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    acc_k, acc_v, pk, pv = (rand(shape, gen) for shape in [(B, S, H_K, D)] * 2 + [(B, S, H_Q, D)] * 2)
    dk, dv, ok, ov = (torch.full((B, S, H_K, D), float("nan"), dtype=BF16, device="cuda") for _ in range(4))
    fe.store(acc_k, acc_v, dk, dv)
    rk = fe.gqa_reduce(pk, num_heads_kv=H_K, out_dtype=BF16)
    acc = accumulator("cuda")
    fe.gqa_accumulate(pk, pv, acc)
    fe.gqa_postprocess(acc, ok, ov)
    torch.cuda.synchronize()
    dense_k, dense_v = z("cuda", B, S, H_K, D), z("cuda", B, S, H_K, D)
    ref.gqa_accumulate_reference(pk, pv, dense_k, dense_v, num_heads_kv=H_K)
    for got, want in zip((dk, dv, rk, ok, ov), (acc_k, acc_v, ref.gqa_reduce_reference(
            pk, num_heads_kv=H_K, out_dtype=BF16, sequential=True), dense_k, dense_v)):
        assert torch.equal(bits(got), bits(want.to(BF16)))


@pytest.mark.ops
def test_deterministic_accumulate_past_its_work_items():
    # the sm_80 deterministic mode's 1-D grid and int tickets hold (row tiles x batch x 2 x h_q) < 2^31 work items:
    # varlen, 16385 sequences over 128 tokens, 65535 query heads of one KV head (partials expanded, accumulators
    # untouched). The sm_90 path has no such limit (it reaches the device check).
    batch, h_q, rows = 16385, 65535, 128
    layout = fe._extension._C.gqa_accum_layout(1, D, D, batch, rows, True, 80, torch.device("cpu"))
    part = torch.zeros(rows, 1, D).expand(rows, h_q, D)
    acc = [torch.empty(shape) for shape in layout["shapes"]]
    sem, cu = torch.zeros(layout["semaphore_numel"], dtype=I32), torch.zeros(batch + 1, dtype=I32)
    with pytest.raises(ValueError, match=r"flash_epilogue\.gqa_accumulate: dk_partial: shape: expected at most "
                       r"2\^31 - 1 \(row tiles x batch x 2 x h_q\) work items in deterministic mode, got 2147713020"):
        OPS.gqa_accumulate(part, part, *acc, sem, cu_seqlens=cu, deterministic=True, _arch=80)
    with pytest.raises(ValueError, match=r"dk_partial: device: expected a CUDA tensor"):  # atomic mode: no such limit
        OPS.gqa_accumulate(part, part, *acc, None, cu_seqlens=cu, deterministic=False, _arch=80)


@pytest.mark.ops
@pytest.mark.parametrize("d,seqlen,want,tile_v", [
    (192, 40, ((1, 2, 1, 18432), (1, 2, 1, 12288)), 192),
    (256, 80 * 256, ((1, 2, 256, 20480), (1, 2, 160, 16384)), 128)])
def test_accumulators_of_two_head_dims_are_checked_each_against_its_own(d, seqlen, want, tile_v):
    # (d, 128) on sm_90 where dV's accumulator is not dK's: at hdim 192 its tiles hold two of the tile's three slabs;
    # at hdim 256 with 512 hdim-256 tiles x KV heads it has the hdim-128 tile (128 rows). A dV accumulator of dK's
    # shape is another problem's, in gqa_accumulate, gqa_postprocess and to_dense alike; the right one passes
    acc = fe.gqa_accumulator(2, d, 128, batch=1, seqlen=seqlen, device="cpu", arch=90)
    assert (tuple(acc.dk_accum.shape), tuple(acc.dv_accum.shape)) == want
    pk, pv, wrong = torch.empty(1, seqlen, 4, d), torch.empty(1, seqlen, 4, 128), torch.empty(want[0])
    msg = acc_shape(want[0], want[1], d=128, c=tile_v, of=f"batch 1, seqlen {seqlen}")
    with pytest.raises(ValueError, match=r"flash_epilogue\.gqa_accumulate: dv_accum: " + msg):
        OPS.gqa_accumulate(pk, pv, acc.dk_accum, wrong, None, deterministic=False, _arch=90)
    with pytest.raises(ValueError, match=r"flash_epilogue\.gqa_postprocess: dv_accum: " + msg):
        OPS.gqa_postprocess(acc.dk_accum, wrong, pk[:, :, :2].to(BF16), pv[:, :, :2].to(BF16), _arch=90)
    with pytest.raises(ValueError, match=r"flash_epilogue\.gqa_accum_to_dense: accum: " + msg):
        OPS.gqa_accum_to_dense(wrong, pv[:, :, :2].clone(), head_dim=tile_v, _arch=90)
    with pytest.raises(ValueError, match="dv_accum: " + msg):  # and through the wrapper
        fe.gqa_accumulate(pk, pv, dataclasses.replace(acc, dv_accum=wrong))
    with pytest.raises(ValueError, match=r"dk_partial: device: expected a CUDA tensor"):
        OPS.gqa_accumulate(pk, pv, acc.dk_accum, acc.dv_accum, None, deterministic=False, _arch=90)


@pytest.mark.gpu
@pytest.mark.parametrize("env", ["FLASH_EPILOGUE_CHECK_INPUTS", "FLASH_EPILOGUE_DEBUG"])
def test_env_switches_turn_on_the_content_checks(env, monkeypatch):
    fe.store_zero(**dense("cuda", *DKV), batch_idx=4)  # unchecked by default: an out-of-range entry is skipped
    monkeypatch.setenv(env, "1")
    fe.refresh_env_flags()  # read at import (host time); conftest re-reads them before each test
    with pytest.raises(INPUT, match=r"batch_idx\[0\]: expected a value in \[0, 2\) \(the batch size\), got 4"):
        fe.store_zero(**dense("cuda", *DKV), batch_idx=4)
    fe.store_zero(**dense("cuda", *DKV), batch_idx=4, check_inputs=False)  # an explicit argument wins
    assert_healthy()


def run(code, cwd=Path(__file__).resolve().parent.parent, **env):
    return run_checked([sys.executable, "-c", code], cwd=cwd, env={**os.environ, **env}).stdout


def test_without_the_extension_every_op_names_the_reason():
    # every op raises FlashEpilogueBuildError naming the reason; the references and repeat_kv (plain torch) work
    out = run("""
import sys
sys.modules["flash_epilogue._C"] = None  # importing it raises ImportError
import torch, flash_epilogue as fe
assert not fe.kernels_available() and fe.UNAVAILABLE_REASON
a, o, p = torch.zeros(1, 8, 2, 64), torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16), torch.zeros(1, 8, 4, 64)
for f in (lambda: fe.store(a, a.clone(), o, o.clone()), lambda: fe.store_zero(o, o.clone()),
          lambda: fe.gqa_accumulator(2, 64, batch=1, seqlen=8, device="cpu"), lambda: fe.gqa_reduce(p, num_heads_kv=2)):
    try:
        f()
    except fe.FlashEpilogueBuildError as e:
        print("RAISED", e, isinstance(e, RuntimeError))
fe.reference.store_reference(a, a, o, o.clone())
x = torch.randn(1, 2, 8, 64, requires_grad=True)
y = fe.repeat_kv(x, 3)
assert torch.equal(y, x.repeat_interleave(3, 1))
assert torch.equal(torch.autograd.grad(y, x, y)[0], fe.reference.group_sum_reference(y.detach(), 3))
print("REFERENCE OK")
""")
    for name in ("store", "store_zero", "gqa_accumulator", "gqa_reduce"):
        assert re.search(rf"RAISED flash_epilogue\.{name}: the CUDA kernels are not available: .* True\n", out), out
    assert "REFERENCE OK" in out


def test_a_build_for_another_torch_is_named(tmp_path):
    src = Path(fe.__file__).parent
    info = src / "_build_info.py"
    if not info.exists() or "TORCH_VERSION" not in info.read_text():
        pytest.skip("not built here")
    shutil.copytree(src, tmp_path / "flash_epilogue", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    copy = tmp_path / "flash_epilogue" / "_build_info.py"
    copy.write_text(re.sub(r"TORCH_VERSION\s*=.*", 'TORCH_VERSION = "1.0.0+other"', copy.read_text()))
    out = run("import flash_epilogue as fe; print(fe.__file__, fe.UNAVAILABLE_REASON)", cwd=tmp_path,
              PYTHONPATH=str(tmp_path), FLASH_EPILOGUE_DISABLE_KERNELS="0")
    assert str(tmp_path) in out and "built against torch 1.0.0+other" in out, out
    assert f"torch {torch.__version__} is running" in out, out
