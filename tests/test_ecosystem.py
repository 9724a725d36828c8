"""The ops in PyTorch's machinery: torch.compile(fullgraph=True) of every op (ops and Python API, bitwise eager's),
opcheck of store/store_zero (the GQA ops': test_gqa.py; repeat_kv's: test_repeat_kv.py), torch.export, CUDA graphs
(every op captured once, replayed on new static inputs and metadata: eager's results), autograd (the in-place ops as
torch's own).

On the CPU, kernels written with flash_epilogue.reference stand in for the CUDA ones (the accumulator row-major per
tile): checked there are the tracing and the C++ ADInplaceOrView/Autograd kernels.
"""

import pytest
import torch

import flash_epilogue as fe
from conftest import (BF16, CALLS, F16, I32, OPS, Module, assert_same, autograd_problem, clone_problem, cuda_graph,
                      every_op, make_problem, op_call, problem_args, stores)
from flash_epilogue.reference import gqa_reduce_reference, store_reference
from flash_epilogue.testing import CANARY_BITS, bits, cu_seqlens, generator, int32, same

# conftest holds the problem (make_problem), every op through torch.ops (every_op), the CALLS of the mutating ops, the
# CPU stand-in kernels and the `device` fixture (test_aoti.py and test_devices.py use them too)


def every_wrapper(t, acc, vacc):
    """Every op through the Python API: wrappers, the accumulator objects (batched and varlen), repeat_kv."""
    varlen = {"cu_seqlens": t["cu"], "seqused": t["vused"]}
    hk = acc.num_heads_kv
    stores(fe, t)
    acc.reset()
    fe.gqa_accumulate(t["pk"], t["pv"], acc, deterministic=True)
    fe.gqa_accumulate(t["pk"] * 0.5, t["pv"], acc, seqused=t["used"])
    fe.gqa_postprocess(acc, t["ok"], t["ov"], scale_dk=0.125, scale_dv=3.0)
    vacc.reset()
    fe.gqa_accumulate(t["vpk"], t["vpk"] * 2, vacc, deterministic=True, **varlen)
    fe.gqa_postprocess(vacc, t["vok"], t["vov"], scale_dv=0.5, **varlen)
    fe.gqa_reduce(t["rpk"], t["rpv"], num_heads_kv=hk, out=(t["rk"], t["rv"]), **varlen, scale_dk=0.25)
    single = fe.gqa_reduce(t["pk"], num_heads_kv=hk, out_dtype=F16)
    return *acc.to_dense(), *acc.to_dense(seqused=t["used"]), single, fe.repeat_kv(t["x"], 3)


# ---- torch.compile

COMPILED = {"ops": (every_op, lambda t, acc, vacc: problem_args(t, acc)),
            "wrappers": (every_wrapper, lambda t, acc, vacc: (t, acc, vacc))}


@pytest.mark.parametrize("api", list(COMPILED))
def test_compile_fullgraph_every_op(device, api):
    fn, args = COMPILED[api]
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    for seed in (0, 1):  # the second call reuses the compiled graph on new data
        t, acc, vacc = make_problem(device, seed)
        t2, acc2, vacc2 = clone_problem(t, acc, vacc)
        assert_same((compiled(*args(t, acc, vacc)), t, acc, vacc), (fn(*args(t2, acc2, vacc2)), t2, acc2, vacc2))
        assert (bits(t["ok"]) != 0).any() and (bits(t["rk"]) != 0).any()


@pytest.mark.ops
def test_compile_fullgraph_store_zero_index_lists_on_meta():
    # ints and lists of ints become int32 tensors inside the compiled graph, on the meta device too
    dk = torch.empty(2, 64, 4, 128, dtype=BF16, device="meta")

    def zero(dk, dv):
        fe.store_zero(dk, dv, batch_idx=[1], head_idx=2, row_start=3)
        return dk

    assert torch.compile(zero, fullgraph=True, backend="aot_eager")(dk, torch.empty_like(dk)).device.type == "meta"


# ---- opcheck: store and store_zero


def opcheck_samples(device="cuda"):
    """{op: [(args, kwargs)]}: store batched, strided, dv != d, seqused, varlen, both paths; store_zero with index
    selections and row ranges too."""
    gen = torch.Generator(device=device).manual_seed(3)
    rnd = lambda *shape: torch.randn(shape, generator=gen, device=device)  # noqa: E731
    out = lambda *shape, dtype=BF16: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
    ones = lambda *shape, dtype=BF16: torch.ones(shape, dtype=dtype, device=device)  # noqa: E731
    idx = lambda *v: int32(*v, device=device)  # noqa: E731
    cu = idx(0, 100, 100, 230)
    return {"store": [
        ((rnd(2, 150, 3, 128), rnd(2, 150, 3, 128), out(2, 150, 3, 128), out(2, 150, 3, 128)), {}),
        ((rnd(2, 150, 3, 64), rnd(2, 150, 3, 64), out(2, 3, 150, 64, dtype=F16).transpose(1, 2),
          out(2, 150, 3, 64, dtype=F16)), {"seqused": idx(150, 7)}),
        ((rnd(1, 300, 2, 192), rnd(1, 300, 2, 128), out(1, 300, 2, 192), out(1, 300, 2, 128)), {"_arch": 80}),
        ((rnd(240, 2, 96), rnd(240, 2, 96), out(240, 2, 96), out(2, 240, 96).transpose(0, 1)), {"cu_seqlens": cu}),
        ((rnd(240, 2, 80), rnd(240, 2, 256), out(240, 2, 80, dtype=F16), out(240, 2, 256, dtype=F16)),
         {"cu_seqlens": cu, "seqused": idx(90, 0, 130)}),
    ], "store_zero": [
        ((ones(2, 150, 3, 128), ones(2, 150, 3, 128)), {}),
        ((ones(2, 150, 3, 64), ones(2, 3, 150, 64).transpose(1, 2)),
         {"seqused": idx(150, 7), "batch_idx": idx(1), "head_idx": idx(0, 2), "row_start": 5, "row_end": 140}),
        ((ones(2, 150, 3, 192, dtype=F16), ones(2, 150, 3, 128, dtype=F16)),
         {"head_idx": idx(2, -1, 7), "row_start": 129, "_arch": 80}),
        ((ones(240, 2, 96), ones(240, 2, 96)), {"cu_seqlens": cu, "row_end": 64}),
        ((ones(240, 2, 80, dtype=F16), ones(2, 240, 256, dtype=F16).transpose(0, 1)),
         {"cu_seqlens": cu, "seqused": idx(90, 0, 130), "batch_idx": idx(0, 2, 5), "row_start": 1}),
        ((ones(240, 2, 64), ones(240, 2, 64)), {"cu_seqlens": cu, "batch_idx": idx()}),  # nothing selected
    ]}


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["store", "store_zero"])
def test_opcheck(op):
    for args, kwargs in opcheck_samples()[op]:
        torch.library.opcheck(getattr(OPS, op).default, args, kwargs)


def test_opcheck_samples_are_valid_for_the_wrappers(cpu_kernels):
    # every sample is a valid call (so opcheck exercises the kernels, not error paths): the ops' checks
    # accept it (test_accepted) and the CPU stand-ins (the reference) run it; the wrappers' private twins take `_arch`
    for op, samples in opcheck_samples("cpu").items():
        for args, kwargs in samples:
            getattr(fe.ops, f"_{op}")(*args, **kwargs)


# ---- torch.export


@pytest.mark.parametrize("api,strict", [(fe, False), (OPS, True)], ids=["wrappers", "ops"])
def test_export_store_and_store_zero(device, api, strict):
    module = Module(lambda t: stores(api, t))
    ep = torch.export.export(module, (make_problem(device)[0],), strict=strict)
    code = ep.graph_module.code
    assert "flash_epilogue.store.default" in code and "flash_epilogue.store_zero.default" in code
    for seed in (1, 2):  # run the exported program on new data and metadata; it mutates its inputs as eager does
        got_in = make_problem(device, seed)[0]
        want_in = clone_problem(got_in)[0]
        assert_same((ep.module()(got_in), got_in), (module(want_in), want_in))
        assert (bits(got_in["dk"][0, :140]) != 0).any() and (bits(got_in["dk"][0, 140:]) == 0).all()


# ---- CUDA graphs


@pytest.mark.gpu
def test_cuda_graph_every_op():
    # every op captured once; each replay, on new contents of every static input (the sequence metadata and index
    # selections included) and canary-filled outputs, writes what an eager run of the same calls on copies does
    gen = generator(12)
    t, acc, vacc = make_problem("cuda", 12)
    graph, out = cuda_graph(lambda: every_wrapper(t, acc, vacc))
    for trial in range(3):
        with torch.no_grad():
            for k in ("ak", "av", "vak", "vav", "pk", "pv", "rpk", "rpv", "vpk"):
                t[k].copy_(torch.randn(t[k].shape, device="cuda", generator=gen))
            lens = [[100, 0, 37, 129], [10, 200, 0, 56], [0, 0, 266, 0]][trial]
            t["cu"].copy_(cu_seqlens(lens))
            t["vused"].copy_(torch.tensor([max(0, n - 5 * trial) for n in lens], dtype=I32))
            t["used"].copy_(torch.tensor([150 - trial, 40 * trial], dtype=I32))
            t["bidx"].copy_(torch.tensor([[0, 3], [1, 1], [2, -1]][trial], dtype=I32))
            t["hidx"].copy_(torch.tensor([[1], [0], [5]][trial], dtype=I32))
            for k in ("dk", "dv", "vdk", "vdv", "ok", "ov", "rk", "rv", "vok", "vov"):
                bits(t[k]).fill_(CANARY_BITS)
        t_eager, acc_eager, vacc_eager = clone_problem(t, acc, vacc)
        want = every_wrapper(t_eager, acc_eager, vacc_eager)
        graph.replay()
        torch.cuda.synchronize()
        assert_same((out, t, acc, vacc), (want, t_eager, acc_eager, vacc_eager), trial)


# ---- autograd: the in-place ops as torch's own (csrc/binding/ops.cpp; torch's in-place ops the reference)


def test_inplace_ops_as_torch_s_own(device):
    # like torch's copy_ (one bump of the written tensor): each written tensor +1, every other one unchanged. Into an
    # inference tensor outside InferenceMode: torch's own error, before the kernel writes; inside it the op runs
    t = autograd_problem(device)
    assert torch.zeros(3).copy_(torch.ones(3))._version == 1
    for case in CALLS:
        op, args, written, _ = op_call(case, t)
        for k, arg in written.items():
            with torch.inference_mode():
                x = t[k].clone()
            want = x.clone()
            for f in (lambda: op(**args | {arg: x}), lambda: x.add_(0)):  # the op, torch's own
                with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
                    f()
            assert same(x, want), (case, k)
        before = {k: v._version for k, v in t.items()}
        op(**args)
        bumps = {k: v._version - before[k] for k, v in t.items() if v._version != before[k]}
        assert bumps == dict.fromkeys(written, 1), case
    with torch.inference_mode():
        t = autograd_problem(device)
        dk = t["dk"].clone()
        OPS.store(t["ak"], t["av"], dk, t["dv"], seqused=t["used"])
        store_reference(t["ak"], t["av"], t["dk"], t["dv"], seqused=t["used"])
        assert dk.is_inference() and same(dk, t["dk"])


@pytest.mark.parametrize("how", ["torch", "fe"])
def test_overwritten_saved_tensor_raises_in_backward(device, how):
    # y = x * w saves w; exp saves its output (overwritten under no_grad: it requires grad): backward raises, as
    # after torch's own in-place ops (on the CPU the stand-ins' torch writes would bump as well: the GPU run checks)
    t = autograd_problem(device)
    w = t["dk"]
    x, e = (torch.randn(w.shape, device=device).to(BF16).requires_grad_() for _ in range(2))
    y, e = (x * w).float().sum(), e.exp()
    z = e.float().sum()
    if how == "torch":
        w.copy_(torch.ones_like(w))
        with torch.no_grad():
            e.zero_()
    else:
        OPS.store(t["ak"], t["av"], w, t["dv"])
        with torch.no_grad():
            OPS.store_zero(e, t["dv"])
    for out in (y, z):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward()


@pytest.mark.ops
@pytest.mark.parametrize("case", CALLS)
def test_arguments_requiring_grad_raise(case):
    # a write into a leaf requiring grad (or a view of one): torch's messages (its check_inplace), before the argument
    # checks. No derivative: a tensor argument requiring grad (grad mode on) or carrying a forward-mode tangent raises,
    # naming the op and the argument; gqa_reduce's partials point to repeat_kv, whose backward it is. With grad mode
    # off the call goes on to the kernel (the CPU registration: its device check).
    t = autograd_problem("cpu")
    op, args, written, read = op_call(case, t)
    name = op.__name__
    written = {k: a for k, a in written.items() if t[k].is_floating_point()}
    for k, arg in written.items():
        for view, what in ((False, "a leaf Variable"), (True, "a view of a leaf Variable")):
            leaf = t[k].clone().requires_grad_()
            want = what + " that requires grad is being used in an in-place operation."
            x = leaf[:] if view else leaf
            for f in (lambda: x.copy_(t[k]), lambda: op(**args | {arg: x})):  # torch's own, the op
                with pytest.raises(RuntimeError, match=want):
                    f()
            with torch.no_grad(), pytest.raises(ValueError, match="expected a CUDA tensor"):
                op(**args | {arg: x})
    for k, arg in [*read.items(), *written.items()]:
        x = t[k].clone().requires_grad_() * 1  # not a leaf: past torch's leaf check
        with pytest.raises(RuntimeError, match=rf"^flash_epilogue\.{name}: {arg}: requires grad, but {name} has no "
                           "derivative") as e:
            op(**args | {arg: x})
        if name == "gqa_reduce" and k in read:
            assert "backward of repeat_kv" in str(e.value) and "flash_epilogue.repeat_kv" in str(e.value)
        with torch.no_grad(), pytest.raises(ValueError, match="expected a CUDA tensor"):
            op(**args | {arg: x})  # past the autograd kernel
        with torch.autograd.forward_ad.dual_level():
            x = torch.autograd.forward_ad.make_dual(t[k], torch.zeros_like(t[k]))
            with torch.no_grad(), pytest.raises(RuntimeError, match=rf"{name}: {arg}: has a forward-mode tangent"):
                op(**args | {arg: x})


def test_gqa_reduce_of_partials_requiring_grad(device):
    # the wrapper raises the op's error (fe.repeat_kv is the differentiable path); under no_grad it reduces
    p = torch.randn(2, 64, 6, 64, device=device).requires_grad_()
    with pytest.raises(RuntimeError, match="gqa_reduce: dk_partial: requires grad.*flash_epilogue.repeat_kv"):
        fe.gqa_reduce(p, num_heads_kv=2)
    with torch.no_grad():
        got = fe.gqa_reduce(p, num_heads_kv=2)
    want = gqa_reduce_reference(p.detach(), num_heads_kv=2, out=torch.empty_like(got), sequential=True)
    assert not got.requires_grad and same(got, want)
