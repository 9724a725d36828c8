"""flash_epilogue.repeat_kv: transformers' repeat_kv with the deterministic group reduce as backward.

CPU tests: the forward against the original expand+reshape, argument errors, the plain-PyTorch
backward (bitwise the kernel's arithmetic), the gradient's layout, gradcheck/gradgradcheck, opcheck,
torch.compile(fullgraph=True) (aot_eager), and which path the backward takes (the kernel call is
intercepted: what it is given, and that the strided gradient is read in place). With the extension
built these run the C++ ops and their C++ autograd; without it, the Python definitions (a
subprocess test runs those either way).

GPU tests (marked gpu): the forward bitwise, the kernel backward bitwise against the plain-PyTorch
one and within a derived bound of the fp64 sum, an SDPA GQA layer against
``scaled_dot_product_attention(..., enable_gqa=True)``, repeatability, torch.compile with inductor
and a CUDA graph.

Error bounds used here (u: unit roundoff of the gradient's dtype, 2^-8 bf16, 2^-11 fp16, 2^-24 fp32;
u32 = 2^-24 the fp32 accumulator's, 2^-53 for fp64 gradients; M = sum_j |g_j| over a group of n
query-head gradients g_j, in fp64): the backward computes rnd(fl(0 + g_0 + ... + g_{n-1})). The
n - 1 accumulator additions after the exact first one each err by at most u32 * M, and the one
rounding by at most u * |result| (plus half a subnormal spacing, smallest_normal * u, near 0), so

    |result - sum_j g_j| <= u * |sum_j g_j| + 2 * n * u32 * M + smallest_normal * u.
"""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_epilogue as fe
from flash_epilogue import _extension
from flash_epilogue.reference import gqa_reduce_reference

R = importlib.import_module("flash_epilogue.repeat_kv")  # the module (fe.repeat_kv is the function)

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
UNIT_ROUNDOFF = {BF16: 2.0**-8, F16: 2.0**-11, F32: 2.0**-24, F64: 2.0**-53}




def original_repeat_kv(x, n_rep, dim=1):
    """What transformers' Llama repeat_kv does (dim=1), and its analogue for (b, s, h_k, d)."""
    if n_rep == 1:
        return x
    if dim == 1:
        b, h, s, d = x.shape
        return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)
    b, s, h, d = x.shape
    return x[:, :, :, None, :].expand(b, s, h, n_rep, d).reshape(b, s, h * n_rep, d)


def bits(t):
    t = t.contiguous()
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def exact_sum_bound(grad, n_rep, dim, dtype):
    """(fp64 group sum, the bound above) for the gradient `grad` with heads in `dim`."""
    g64 = grad.double().unflatten(dim, (-1, n_rep))
    exact, mag = g64.sum(dim + 1), g64.abs().sum(dim + 1)
    u = UNIT_ROUNDOFF[dtype]
    u_acc = 2.0**-53 if dtype == F64 else 2.0**-24
    return exact, u * exact.abs() + 2 * n_rep * u_acc * mag + torch.finfo(dtype).smallest_normal * u


def assert_within_exact_bound(got, grad, n_rep, dim):
    exact, bound = exact_sum_bound(grad, n_rep, dim, got.dtype)
    err = (got.double() - exact).abs()
    bad = err > bound
    assert not bad.any(), f"{int(bad.sum())} elements off, worst excess {(err - bound).max().item():.3e}"


@pytest.fixture
def paths():
    """The backward paths taken ("kernel", "kernel_copy", "reference"), in call order (the op's
    own record)."""
    with R._recording_paths() as taken:
        yield taken


def same_layout(a, b):
    """Equal strides on every dim longer than 1 (a size-1 dim's stride is arbitrary)."""
    return a.shape == b.shape and all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n > 1)


def leading_order_storage(shape, order, dtype=F32, device="cpu", gen=None):
    """A randn tensor of logical `shape` whose first three dims lie in memory in `order`."""
    perm = list(order) + [3]
    base = torch.randn([shape[i] for i in perm], generator=gen, device=device).to(dtype)
    return base.permute([perm.index(i) for i in range(4)])


# ---------------------------------------------------------------------------------------------
# forward (CPU)


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("dtype", [F32, BF16, F16, F64, torch.int64], ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 5, 8), (2, 1, 5, 8), (1, 4, 1, 16), (3, 2, 7, 24), (0, 2, 3, 8)])
def test_forward_matches_the_original(shape, dtype, dim):
    x = (torch.randn(shape) * 100).to(dtype)
    for n_rep in (1, 2, 3):
        y, want = fe.repeat_kv(x, n_rep, dim=dim), original_repeat_kv(x, n_rep, dim)
        assert y.shape == want.shape and y.dtype == want.dtype
        assert torch.equal(bits(y), bits(want))
        assert torch.equal(y, x.repeat_interleave(n_rep, dim=dim))
        if n_rep == 1:
            assert y is x  # as transformers: the input itself
            continue
        # a new contiguous tensor, like the copy the original's reshape makes; with one KV head the
        # original's reshape is a stride-0 view of x instead, and ours is still a contiguous copy
        assert y.is_contiguous()
        if y.numel() and x.shape[dim] > 1:
            assert y.stride() == want.stride()
        if y.numel():
            assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_forward_of_strided_inputs_and_writable_output():
    # a (b, s, h_k, d) projection output seen as (b, h_k, s, d), and a padded one
    x = torch.randn(2, 7, 3, 16).transpose(1, 2)
    padded = torch.randn(2, 3, 7, 24)[..., :16]
    for t in (x, padded, torch.randn(2, 1, 7, 16)):
        y = fe.repeat_kv(t, 4)
        assert torch.equal(y, original_repeat_kv(t, 4)) and y.is_contiguous()
        before = t.clone()
        y.add_(1)  # in place on the output never touches the input (a stride-0 view could not even do this)
        assert torch.equal(t, before)


def test_errors():
    x = torch.zeros(2, 2, 4, 8)
    cases = [
        ((x[0], 2), {}, r"x: rank: expected 4 dims.*got 3 dims, shape \(2, 4, 8\)"),
        (([1.0], 2), {}, r"x: expected a torch\.Tensor, got list"),
        ((x, 0), {}, r"n_rep: expected a positive int, got 0"),
        ((x, -2), {}, r"n_rep: expected a positive int, got -2"),
        ((x, True), {}, r"n_rep: expected a positive int, got bool"),
        ((x, 2.0), {}, r"n_rep: expected a positive int, got float"),
        ((x, 2), {"dim": 0}, r"dim: expected 1 \(or -3\) or 2 \(or -2\).*got 0"),
        ((x, 2), {"dim": 3}, r"dim: expected 1 \(or -3\) or 2 \(or -2\).*got 3"),
        ((x, 2), {"dim": 1.0}, r"dim: expected .*got float"),
    ]
    for args, kwargs, pattern in cases:
        with pytest.raises(fe.FlashEpilogueInputError, match=r"^flash_epilogue\.repeat_kv: " + pattern):
            fe.repeat_kv(*args, **kwargs)
    assert issubclass(fe.FlashEpilogueInputError, ValueError)
    # negative dims name the same dims
    assert torch.equal(fe.repeat_kv(x, 2, dim=-3), fe.repeat_kv(x, 2, dim=1))
    assert torch.equal(fe.repeat_kv(x, 2, dim=-2), fe.repeat_kv(x, 2, dim=2))
    # the ops check what they are given: the C++ ops raise ValueError, as every op of the extension
    # does (FlashEpilogueInputError, a ValueError, is the Python wrappers'); the Python definitions
    # without the extension raise FlashEpilogueInputError. Same messages, real and fake kernels.
    op_error = ValueError if R._CPP else fe.FlashEpilogueInputError
    g = torch.zeros(1, 4, 2, 8)
    op_cases = [
        (torch.ops.flash_epilogue.repeat_kv_backward, (g, 3, 1, [0, 1, 2]),
         r"repeat_kv_backward: grad: heads: expected a multiple of n_rep = 3 in dim 1, "
         r"got 4 \(shape \(1, 4, 2, 8\)\)$"),
        (torch.ops.flash_epilogue.repeat_kv_backward, (g, 2, 1, [0, 1, 1]),
         r"repeat_kv_backward: layout: expected a permutation of \[0, 1, 2\], got \[0, 1, 1\]$"),
        (torch.ops.flash_epilogue.repeat_kv_backward, (g, 2, 1, [0, 1]),
         r"repeat_kv_backward: layout: expected a permutation of \[0, 1, 2\], got \[0, 1\]$"),
        (torch.ops.flash_epilogue.repeat_kv_backward, (g[0], 2, 1, [0, 1, 2]),
         r"repeat_kv_backward: grad: rank: expected 4 dims: \(batch, heads, seqlen, head_dim\) for dim=1, "
         r"\(batch, seqlen, heads, head_dim\) for dim=2, got 3 dims, shape \(4, 2, 8\)$"),
        (torch.ops.flash_epilogue.repeat_kv_backward, (g, 0, 1, [0, 1, 2]),
         r"repeat_kv_backward: n_rep: expected a positive int, got 0$"),
        (torch.ops.flash_epilogue.repeat_kv_backward, (g, 2, 3, [0, 1, 2]),
         r"repeat_kv_backward: dim: expected 1 \(or -3\) or 2 \(or -2\): the KV-head dim of a 4-D tensor, got 3$"),
        (torch.ops.flash_epilogue.repeat_kv, (x[0], 2, 1),
         r"repeat_kv: x: rank: expected 4 dims: \(batch, kv_heads, seqlen, head_dim\) for dim=1, "
         r"\(batch, seqlen, kv_heads, head_dim\) for dim=2, got 3 dims, shape \(2, 4, 8\)$"),
        (torch.ops.flash_epilogue.repeat_kv, (x, -1, 1), r"repeat_kv: n_rep: expected a positive int, got -1$"),
        (torch.ops.flash_epilogue.repeat_kv, (x, 2, 0), r"repeat_kv: dim: expected 1 \(or -3\) or 2 \(or -2\).*got 0$"),
    ]
    for op, args, pattern in op_cases:
        with pytest.raises(op_error, match=r"^flash_epilogue\." + pattern) as raised:
            op(*args)
        assert type(raised.value) is op_error
        mode = FakeTensorMode()
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with mode, pytest.raises(fe.FlashEpilogueInputError, match=r"^flash_epilogue\." + pattern):
            op(*fake_args)
    # the ops normalize negative dims as the wrapper does
    assert torch.equal(torch.ops.flash_epilogue.repeat_kv(x, 2, -3), fe.repeat_kv(x, 2, dim=1))
    assert torch.equal(torch.ops.flash_epilogue.repeat_kv_backward(g, 2, -2, [0, 1, 2]),
                       R.group_sum_reference(g, 2, 2))


# ---------------------------------------------------------------------------------------------
# backward (CPU: the plain-PyTorch path)


def sequential_reference(grad, n_rep, dim):
    """The kernel's arithmetic through reference.py (heads in dim 2 of a (b, s, h, d) view)."""
    view = grad.transpose(1, 2) if dim == 1 else grad
    out = torch.empty(view.shape[:2] + (view.shape[2] // n_rep, view.shape[3]), dtype=grad.dtype)
    gqa_reduce_reference(view, view.shape[2] // n_rep, out=out, sequential=True)
    return out.transpose(1, 2) if dim == 1 else out


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
def test_backward_is_the_sequential_fp32_sum(dtype, dim, paths):
    gen = torch.Generator().manual_seed(dim + 10 * (BF16, F16, F32).index(dtype))
    for hk, n_rep in ((2, 4), (1, 8), (3, 2)):
        shape = (2, hk, 9, 16) if dim == 1 else (2, 9, hk, 16)
        x = torch.randn(shape, generator=gen).to(dtype).requires_grad_()
        y = fe.repeat_kv(x, n_rep, dim=dim)
        # values over many binades: the order of the additions matters
        g = (torch.randn(y.shape, generator=gen) * torch.exp2(torch.randint(-10, 11, y.shape, generator=gen))).to(dtype)
        (gx,) = torch.autograd.grad(y, x, g)
        assert gx.dtype == dtype and gx.shape == x.shape
        assert torch.equal(bits(gx), bits(sequential_reference(g, n_rep, dim)))
        assert torch.equal(bits(gx), bits(R.group_sum_reference(g, n_rep, dim)))
        assert_within_exact_bound(gx, g, n_rep, dim)
        # the original's backward: the same sum up to the order of fp32 additions
        (g0,) = torch.autograd.grad(original_repeat_kv(x, n_rep, dim), x, g)
        assert_within_exact_bound(g0, g, n_rep, dim)
    assert paths == ["reference"] * 3


def test_backward_sign_of_zero_and_specials():
    # 0 + (-0) = +0: the accumulator starts at +0.0 as the kernel's does; inf/nan propagate
    g = torch.tensor([-0.0, -0.0, 1.0, float("inf"), float("nan"), 2.0], dtype=BF16).view(1, 6, 1, 1)
    g = g.expand(1, 6, 1, 8).contiguous()
    out = R.group_sum_reference(g, 2, 1)
    assert out[0, 0, 0, 0].item() == 0.0 and not out[0, 0, 0, 0].signbit()
    assert out[0, 1, 0, 0].item() == float("inf") and out[0, 2, 0, 0].isnan()


@pytest.mark.parametrize("dim", [1, 2])
def test_gradient_follows_the_layout_of_x(dim):
    shape = (2, 3, 5, 16) if dim == 1 else (2, 5, 3, 16)
    for order in ((0, 1, 2), (0, 2, 1), (1, 0, 2), (2, 1, 0)):
        x = leading_order_storage(shape, order).requires_grad_()
        y = fe.repeat_kv(x, 2, dim=dim)
        g = torch.randn(y.shape)
        (gx,) = torch.autograd.grad(y, x, g)
        assert same_layout(gx, x), order
        assert torch.equal(gx, R.group_sum_reference(g, 2, dim))
    # a head dim that is not innermost in x: the gradient's still is (dense, last dim contiguous,
    # the leading dims in x's order)
    x = torch.randn(2, 16, 5, 3).permute(0, 3, 2, 1) if dim == 1 else torch.randn(2, 16, 3, 5).permute(0, 3, 2, 1)
    x.requires_grad_()
    y = fe.repeat_kv(x, 2, dim=dim)
    g = torch.randn(y.shape)
    (gx,) = torch.autograd.grad(y, x, g)
    assert gx.stride(-1) == 1 and gx.untyped_storage().nbytes() == gx.numel() * gx.element_size()
    assert [gx.stride(i) > gx.stride(j) for i, j in ((0, 1), (1, 2), (0, 2))] == \
        [x.stride(i) > x.stride(j) for i, j in ((0, 1), (1, 2), (0, 2))]
    assert torch.equal(gx, R.group_sum_reference(g, 2, dim))


@pytest.mark.parametrize("dim", [1, 2])
def test_gradcheck_fp64(dim):
    for shape in ((2, 3, 4, 8), (1, 1, 3, 8)):
        if dim == 2:
            shape = (shape[0], shape[2], shape[1], shape[3])
        x = torch.randn(shape, dtype=F64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda t: fe.repeat_kv(t, 3, dim=dim), (x,))
        assert torch.autograd.gradgradcheck(lambda t: fe.repeat_kv(t, 3, dim=dim), (x,))


def test_opcheck():
    from torch.library import opcheck

    for dim, shape in ((1, (2, 3, 5, 8)), (2, (2, 5, 3, 8)), (1, (1, 1, 4, 16))):
        x = torch.randn(shape, requires_grad=True)
        opcheck(torch.ops.flash_epilogue.repeat_kv.default, (x, 2, dim))
        opcheck(torch.ops.flash_epilogue.repeat_kv.default, (x.detach().bfloat16(), 3, dim))
        g = torch.randn(fe.repeat_kv(x, 2, dim=dim).shape, requires_grad=True)
        for layout in ([0, 1, 2], [0, 2, 1], [2, 0, 1]):
            opcheck(torch.ops.flash_epilogue.repeat_kv_backward.default, (g, 2, dim, layout))
        opcheck(torch.ops.flash_epilogue.repeat_kv_backward.default, (g.detach().half(), 2, dim, [0, 1, 2]))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(dynamic):
    # a GQA attention block (math SDPA on the CPU): forward and backward traced in one graph each,
    # results bitwise those of eager
    torch._dynamo.reset()

    def block(q, k, v):
        k = fe.repeat_kv(k, 4)
        v = fe.repeat_kv(v, 4, dim=2).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for s in (16, 24):
        gen = torch.Generator().manual_seed(s)
        q = torch.randn(2, 8, s, 32, generator=gen, requires_grad=True)
        k = torch.randn(2, 2, s, 32, generator=gen, requires_grad=True)
        v = torch.randn(2, s, 2, 32, generator=gen, requires_grad=True)
        dout = torch.randn(2, 8, s, 32, generator=gen)
        got = compiled(q, k, v)
        grads = torch.autograd.grad(got, (q, k, v), dout)
        want = block(q, k, v)
        want_grads = torch.autograd.grad(want, (q, k, v), dout)
        assert torch.equal(got, want)
        for a, b in zip(grads, want_grads):
            assert torch.equal(a, b) and a.stride() == b.stride()


# ---------------------------------------------------------------------------------------------
# the kernel path, intercepted (CPU)


class ReduceRecorder:
    """Stands in for the CPU kernel of torch.ops.flash_epilogue.gqa_reduce (the op the backward
    launches): records its arguments and computes the kernel's result with the reference.
    num_heads_kv is out's head count (the op has no such argument); kwargs holds the keyword
    arguments that differ from the op's defaults (the dispatcher passes only those)."""

    def __init__(self):
        self.calls = []

    def __call__(self, dk_partial, dv_partial, dk, dv, **kwargs):
        num_heads_kv = dk.shape[-2]
        self.calls.append({"partial": dk_partial, "dv_partial": dv_partial, "num_heads_kv": num_heads_kv,
                           "out": dk, "dv": dv, "kwargs": kwargs})
        gqa_reduce_reference(dk_partial, num_heads_kv, out=dk, sequential=True)


@pytest.fixture
def kernel_device():
    """Pretend the kernels run on the CPU: the C++ op's routing takes the kernel path for CPU
    tensors (a test hook of the extension) and launches gqa_reduce through the dispatcher, whose CPU
    kernel is a recorder here."""
    if not R._CPP:
        pytest.skip(f"the kernel path needs the C++ extension: {fe.UNAVAILABLE_REASON}")
    recorder = ReduceRecorder()
    lib = torch.library.Library("flash_epilogue", "IMPL")
    lib.impl("gqa_reduce", recorder, "CPU")
    _extension._C._repeat_kv_cpu_as_kernel_device(True)
    try:
        yield recorder
    finally:
        _extension._C._repeat_kv_cpu_as_kernel_device(False)
        lib._destroy()


@pytest.mark.parametrize("dim", [1, 2])
def test_kernel_reads_the_gradient_in_place(dim, kernel_device, paths):
    n_rep, hk = 4, 2
    # contiguous, and padded rows (a stride of 72 halves is a multiple of 16 bytes)
    for grad in (torch.randn(2, hk * n_rep, 9, 64).bfloat16() if dim == 1 else torch.randn(2, 9, hk * n_rep, 64).half(),
                 torch.randn(2, hk * n_rep, 9, 72).bfloat16()[..., :64] if dim == 1
                 else torch.randn(2, 9, hk * n_rep, 72).bfloat16()[..., :64]):
        for layout in ([0, 1, 2], [0, 2, 1]):
            kernel_device.calls.clear()
            out = torch.ops.flash_epilogue.repeat_kv_backward(grad, n_rep, dim, layout)
            (call,) = kernel_device.calls
            view = grad.transpose(1, 2) if dim == 1 else grad
            out_view = out.transpose(1, 2) if dim == 1 else out
            # the gradient in place (no copy), the single-tensor form, out = x's gradient seen as (b, s, h_k, d)
            assert call["partial"].data_ptr() == grad.data_ptr() and call["partial"].stride() == view.stride()
            assert call["dv_partial"] is None and call["dv"] is None
            assert call["num_heads_kv"] == hk and call["kwargs"] == {}
            assert call["out"].data_ptr() == out.data_ptr() and call["out"].stride() == out_view.stride()
            assert call["out"].shape == view.shape[:2] + (hk, 64)
            assert torch.equal(bits(out), bits(R.group_sum_reference(grad, n_rep, dim)))
    assert paths == ["kernel"] * 4


def test_kernel_path_copies_layouts_it_cannot_read(kernel_device, paths):
    # the stride-0 gradient of a .sum(), a row pitch that is not a multiple of 16 bytes, a
    # misaligned start: one contiguous copy, then the kernel (the result does not depend on it)
    shape = (2, 8, 9, 64)
    misaligned = torch.randn(2 * 8 * 9 * 64 + 1).bfloat16()[1:].view(shape)
    for grad in (torch.ones((), dtype=BF16).expand(shape), torch.randn(2, 8, 9, 68).bfloat16()[..., :64], misaligned):
        kernel_device.calls.clear()
        out = torch.ops.flash_epilogue.repeat_kv_backward(grad, 4, 1, [0, 1, 2])
        (call,) = kernel_device.calls
        assert call["partial"].data_ptr() != grad.data_ptr() and call["partial"].transpose(1, 2).is_contiguous()
        assert torch.equal(bits(out), bits(R.group_sum_reference(grad, 4, 1)))
    assert paths == ["kernel_copy"] * 3


def test_unsupported_inputs_take_the_reference_path(kernel_device, paths):
    # fp32/fp64 gradients (the kernel writes 16-bit only), head dims the kernel has no tile for, empty
    cases = [torch.randn(2, 8, 9, 64), torch.randn(2, 8, 9, 64, dtype=F64), torch.randn(2, 8, 9, 12).bfloat16(),
             torch.randn(2, 8, 9, 264).bfloat16(), torch.randn(2, 8, 0, 64).bfloat16(), torch.randn(0, 8, 9, 64).half()]
    for grad in cases:
        out = torch.ops.flash_epilogue.repeat_kv_backward(grad, 4, 1, [0, 1, 2])
        assert torch.equal(bits(out), bits(R.group_sum_reference(grad, 4, 1)))
    assert kernel_device.calls == []
    assert paths == ["reference"] * len(cases)
    # past the launchers' grid limits (batch or heads >= 65536): the reference path, not an error
    for shape, dim in (((65536, 2, 1, 8), 1), ((1, 1, 65536, 8), 2)):
        grad = torch.ones((), dtype=BF16).expand(shape)
        assert not R._kernel_supports(grad, dim) and R._kernel_supports(grad[:1] if dim == 1 else grad[:, :, :2], dim)


def test_kernel_device_rule(monkeypatch):
    assert not R._kernel_device(torch.device("cpu")) and not R._kernel_device(torch.device("meta"))
    if R._CPP:
        # the rule the C++ op applies to a CUDA device's compute capability and the build's archs
        for cap, archs, ok in (((9, 0), ("sm_90a",), True), ((8, 0), ("sm_90a",), False),
                               ((8, 6), ("sm_80", "sm_90a"), True), ((10, 0), ("sm_80", "sm_90a"), False),
                               ((9, 0), ("sm_80",), False)):
            assert _extension._C._has_kernels_for(*cap, list(archs)) is ok, (cap, archs)
    monkeypatch.setattr(_extension, "_C", None)  # kernels not built: never
    assert not R._kernel_device(torch.device("cuda", 0))


def test_the_cpp_ops_and_autograd_run_when_built():
    # with the extension loaded, what these CPU tests exercise is the C++ ops and C++ autograd
    if not fe.kernels_available():
        pytest.skip(f"no extension: {fe.UNAVAILABLE_REASON}")
    assert R._CPP and R._python_library is None
    x = torch.randn(2, 2, 3, 8, requires_grad=True)
    y = fe.repeat_kv(x, 2)
    assert "RepeatKvFunction" in y.grad_fn.name()
    (gx,) = torch.autograd.grad(y, x, torch.randn(y.shape, requires_grad=True), create_graph=True)
    assert "RepeatKvBackwardFunction" in gx.grad_fn.name()


@pytest.mark.parametrize("dim", [1, 2])
def test_backward_output_strides_are_the_fakes(dim):
    # the op allocates x's gradient itself (empty_strided in C++): the same strides as the fake
    # kernel's empty + permute, size-0 and size-1 dims included
    for shape in ((2, 6, 5, 8), (1, 2, 1, 8), (0, 4, 3, 8), (2, 4, 0, 8), (3, 2, 1, 1)):
        if dim == 2:
            shape = (shape[0], shape[2], shape[1], shape[3])
        g = torch.randn(shape)
        for layout in ([0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]):
            got = torch.ops.flash_epilogue.repeat_kv_backward(g, 2, dim, layout)
            want = R._repeat_kv_backward_fake(g, 2, dim, layout)
            assert got.shape == want.shape and got.stride() == want.stride(), (shape, layout)
            assert torch.equal(got, R.group_sum_reference(g, 2, dim))


def test_python_ops_without_the_extension():
    # FLASH_EPILOGUE_DISABLE_KERNELS=1: the package defines the ops in Python (plain-PyTorch
    # backward): forward, backward into x's layout, double backward, fake kernels, errors
    code = """
import torch, flash_epilogue as fe, importlib
R = importlib.import_module("flash_epilogue.repeat_kv")
assert not fe.kernels_available() and not R._CPP and R._python_library is not None
x = torch.randn(2, 5, 3, 16).transpose(1, 2).requires_grad_()
y = fe.repeat_kv(x, 4)
assert torch.equal(y, x.repeat_interleave(4, dim=1)) and y.is_contiguous()
g = torch.randn(y.shape).bfloat16().float()
with R._recording_paths() as paths:
    (gx,) = torch.autograd.grad(y, x, g)
    assert paths == ["reference"], paths
assert torch.equal(gx, R.group_sum_reference(g, 4, 1)) and gx.stride() == x.stride()
x64 = torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True)
assert torch.autograd.gradgradcheck(lambda t: fe.repeat_kv(t, 3, dim=2), (x64,))
with torch.device("meta"):
    m = torch.ops.flash_epilogue.repeat_kv_backward(torch.empty(2, 8, 3, 16), 4, 1, [0, 2, 1])
assert m.shape == (2, 2, 3, 16) and m.stride() == (96, 16, 32, 1)
try:
    torch.ops.flash_epilogue.repeat_kv_backward(torch.zeros(1, 4, 2, 8), 3, 1, [0, 1, 2])
except fe.FlashEpilogueInputError as e:
    print("RAISED", e)
"""
    env = dict(os.environ, FLASH_EPILOGUE_DISABLE_KERNELS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert ("RAISED flash_epilogue.repeat_kv_backward: grad: heads: expected a multiple of n_rep = 3 in dim 1, "
            "got 4 (shape (1, 4, 2, 8))") in out.stdout


# ---------------------------------------------------------------------------------------------
# GPU


def cuda_gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
def test_gpu_forward_bitwise(dtype, dim):
    gen = cuda_gen(1)
    for shape in ((2, 8, 300, 128), (1, 1, 77, 64), (3, 4, 129, 96)):
        if dim == 2:
            shape = (shape[0], shape[2], shape[1], shape[3])
        x = torch.randn(shape, device="cuda", generator=gen).to(dtype)
        for n_rep in (1, 4, 8):
            y, want = fe.repeat_kv(x, n_rep, dim=dim), original_repeat_kv(x, n_rep, dim)
            assert torch.equal(bits(y), bits(want)) and y.shape == want.shape
            assert y is x if n_rep == 1 else y.is_contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_gpu_backward_kernel_is_bitwise_the_sequential_sum(d, dtype, paths):
    gen = cuda_gen(d)
    for i, (dim, hk, n_rep, order) in enumerate(((1, 2, 4, (0, 1, 2)), (1, 1, 8, (0, 2, 1)), (2, 2, 3, (0, 1, 2)),
                                                 (2, 4, 2, (0, 2, 1)))):
        s = 131 + 64 * i
        shape = (2, hk, s, d) if dim == 1 else (2, s, hk, d)
        x = leading_order_storage(shape, order, dtype, "cuda", gen).requires_grad_()
        y = fe.repeat_kv(x, n_rep, dim=dim)
        g = (torch.randn(y.shape, device="cuda", generator=gen)
             * torch.exp2(torch.randint(-8, 9, y.shape, device="cuda", generator=gen))).to(dtype)
        grads = [g, g.transpose(1, 2).contiguous().transpose(1, 2)]  # and the other memory order
        for grad in grads:
            (gx,) = torch.autograd.grad(y, x, grad, retain_graph=True)
            assert same_layout(gx, x)
            assert torch.equal(bits(gx), bits(R.group_sum_reference(grad, n_rep, dim))), (dim, hk, n_rep, order)
            assert_within_exact_bound(gx, grad, n_rep, dim)
    assert paths == ["kernel"] * 8


@pytest.mark.gpu
def test_gpu_backward_copies_or_falls_back(paths):
    gen = cuda_gen(3)
    x = torch.randn(2, 2, 200, 128, device="cuda", generator=gen).bfloat16().requires_grad_()
    # the stride-0 gradient of a sum: copied, then the kernel
    fe.repeat_kv(x, 4).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 4.0))
    # fp32 (the kernel writes 16-bit only) and a head dim without a tile: the plain-PyTorch path
    x32 = torch.randn(2, 2, 200, 128, device="cuda", generator=gen, requires_grad=True)
    g32 = torch.randn(2, 8, 200, 128, device="cuda", generator=gen)
    (gx,) = torch.autograd.grad(fe.repeat_kv(x32, 4), x32, g32)
    assert torch.equal(bits(gx), bits(R.group_sum_reference(g32, 4, 1)))
    x12 = torch.randn(2, 2, 200, 12, device="cuda", generator=gen).half().requires_grad_()
    g12 = torch.randn(2, 8, 200, 12, device="cuda", generator=gen).half()
    (gx,) = torch.autograd.grad(fe.repeat_kv(x12, 4), x12, g12)
    assert torch.equal(bits(gx), bits(R.group_sum_reference(g12.cpu(), 4, 1).cuda()))
    assert paths == ["kernel_copy", "reference", "reference"]


@pytest.mark.gpu
def test_gpu_gradcheck_against_the_fp64_sum():
    # small shapes: bf16/fp16 kernel gradients within the derived bound of the exact fp64 sum, and
    # torch.autograd.gradcheck in fp64 (the plain-PyTorch path on the GPU)
    gen = cuda_gen(4)
    for dtype in (BF16, F16):
        for dim, shape, n_rep in ((1, (1, 2, 5, 64), 3), (2, (2, 3, 2, 128), 2), (1, (1, 1, 1, 256), 16)):
            x = torch.randn(shape, device="cuda", generator=gen).to(dtype).requires_grad_()
            y = fe.repeat_kv(x, n_rep, dim=dim)
            g = torch.randn(y.shape, device="cuda", generator=gen).to(dtype)
            (gx,) = torch.autograd.grad(y, x, g)
            assert_within_exact_bound(gx, g, n_rep, dim)
    x = torch.randn(1, 2, 3, 8, device="cuda", dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: fe.repeat_kv(t, 3), (x,))
    assert torch.autograd.gradgradcheck(lambda t: fe.repeat_kv(t, 3), (x,))


def assert_within_layer_bound(name, a, b, per_head, n_rep, dim):
    """|a - b| <= 2u * M + u * (|a| + |b|) + 2n * 2^-24 * M + smallest_normal * u, elementwise
    (derived in test_gpu_sdpa_layer_matches_enable_gqa), M from the per-query-head gradients."""
    u = UNIT_ROUNDOFF[a.dtype]
    m = per_head.double().abs().unflatten(dim, (-1, n_rep)).sum(dim + 1)
    bound = 2 * u * m + u * (a.double().abs() + b.double().abs()) + 2 * n_rep * 2.0**-24 * m \
        + torch.finfo(a.dtype).smallest_normal * u
    err = (a.double() - b.double()).abs()
    bad = err > bound
    same = float((bits(a) == bits(b)).float().mean())
    assert not bad.any(), (f"{name}: {int(bad.sum())} elements off, worst excess {(err - bound).max().item():.3e} "
                           f"({same:.4%} bitwise equal)")


def _sdpa_gqa_case(backend, dim, dtype, seed, b=2, hk=2, n_rep=4, s=256, d=128):
    """An attention layer over repeat_kv'd K/V and the same layer with enable_gqa=True, both
    pinned to `backend`: returns (ours (dk, dv), theirs (dk, dv), per-query-head (dk, dv))."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend)
    gen = cuda_gen(seed)
    hq = hk * n_rep
    q_shape, kv_shape = ((b, hq, s, d), (b, hk, s, d)) if dim == 1 else ((b, s, hq, d), (b, s, hk, d))
    q = torch.randn(q_shape, device="cuda", generator=gen).to(dtype)
    k = torch.randn(kv_shape, device="cuda", generator=gen).to(dtype)
    v = torch.randn(kv_shape, device="cuda", generator=gen).to(dtype)
    dout = torch.randn(b, hq, s, d, device="cuda", generator=gen).to(dtype)
    heads_major = (lambda t: t) if dim == 1 else (lambda t: t.transpose(1, 2))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    kr, vr = fe.repeat_kv(ka, n_rep, dim=dim), fe.repeat_kv(va, n_rep, dim=dim)
    kr.retain_grad()
    vr.retain_grad()
    with sdpa_kernel(backend):
        sdpa(heads_major(qa), heads_major(kr), heads_major(vr), is_causal=True).backward(dout)

    qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backend):
        try:
            out = sdpa(heads_major(qb), heads_major(kb), heads_major(vb), is_causal=True, enable_gqa=True)
        except RuntimeError as e:
            pytest.skip(f"{backend} has no enable_gqa kernel for this case in torch {torch.__version__}: {e}")
    out.backward(dout)
    return (ka.grad, va.grad), (kb.grad, vb.grad), (kr.grad, vr.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION"])
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_gpu_sdpa_layer_matches_enable_gqa(backend, dim, dtype, paths):
    """dK/dV of an attention layer over repeat_kv'd K and V against SDPA's own GQA (enable_gqa=True).

    Tolerance. Both compute S = sum_j g_j over the n query heads of a KV head, where g_j are the
    per-query-head gradients the attention kernel accumulates in fp32. Each path rounds to the
    dtype (unit roundoff u) at most twice: possibly each g_j before the sum (ours always does: the
    SDPA backward writes per-head dK/dV of the repeated tensors in the dtype; FlashAttention's GQA
    backward does too, other kernels may sum in fp32), error <= u * M with M = sum_j |g_j|, and
    once after it, error <= u * |result|; the fp32 sums add <= n * 2^-24 * M each. Hence

        |ours - theirs| <= 2u * M + u * (|ours| + |theirs|) + 2n * 2^-24 * M + smallest_normal * u,

    with M measured from our per-head gradients (retain_grad on the repeated tensors; they differ
    from the fp32 g_j by u relatively, covered by the slack of the fp32 term). With
    FLASH_ATTENTION the per-head values coincide, so the results typically agree bit for bit and
    differ by at most one unit in the last place where the two fp32 summation orders round apart.
    """
    n_rep = 4
    ours, theirs, per_head = _sdpa_gqa_case(backend, dim, dtype, seed=7 + dim, n_rep=n_rep)
    for name, a, b, g in zip(("dk", "dv"), ours, theirs, per_head):
        assert a.shape == b.shape and a.dtype == b.dtype == dtype
        # our gradient is exactly the sequential sum of the per-head gradients
        assert torch.equal(bits(a), bits(R.group_sum_reference(g, n_rep, dim))), name
        assert_within_layer_bound(name, a, b, g, n_rep, dim)
    assert len(paths) == 2 and set(paths) <= {"kernel", "kernel_copy"}


@pytest.mark.gpu
def test_gpu_sdpa_layer_gradients_are_repeatable(paths):
    # the same layer 10 times: dK and dV bitwise identical each time (SDPA's per-head dK/dV are
    # deterministic on FLASH_ATTENTION; the group reduce adds in a fixed order)
    first = None
    for _ in range(10):
        ours, _, per_head = _sdpa_gqa_case("FLASH_ATTENTION", 1, BF16, seed=11)
        if first is None:
            first = (ours, per_head)
            continue
        for a, b in zip(per_head, first[1]):
            assert torch.equal(bits(a), bits(b)), "SDPA's own per-head gradients differ between runs"
        for a, b in zip(ours, first[0]):
            assert torch.equal(bits(a), bits(b))
    # the reduce alone, on one fixed per-head gradient, 50 times
    g = first[1][0]
    x = torch.zeros(g.shape[0], g.shape[1] // 4, g.shape[2], g.shape[3], dtype=BF16, device="cuda", requires_grad=True)
    y = fe.repeat_kv(x, 4)
    want = torch.autograd.grad(y, x, g, retain_graph=True)[0]
    for _ in range(50):
        assert torch.equal(bits(torch.autograd.grad(y, x, g, retain_graph=True)[0]), bits(want))


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True])
def test_gpu_compile_fullgraph(dynamic, paths):
    torch._dynamo.reset()

    def expand_both(k, v):
        return fe.repeat_kv(k, 4), fe.repeat_kv(v, 4, dim=2)

    def layer(q, k, v, keep=None):
        kr, vr = expand_both(k, v)
        if keep is not None:  # eager only: the per-query-head gradients, for the bound
            kr.retain_grad()
            vr.retain_grad()
            keep.extend((kr, vr))
        return torch.nn.functional.scaled_dot_product_attention(q, kr, vr.transpose(1, 2), is_causal=True)

    compiled = torch.compile(expand_both, fullgraph=True, dynamic=dynamic)
    compiled_layer = torch.compile(layer, fullgraph=True, dynamic=dynamic)
    gen = cuda_gen(5)
    for s in (256, 384):
        k = torch.randn(2, 2, s, 128, device="cuda", generator=gen).bfloat16().requires_grad_()
        v = torch.randn(2, s, 2, 128, device="cuda", generator=gen).bfloat16().requires_grad_()
        gk = torch.randn(2, 8, s, 128, device="cuda", generator=gen).bfloat16()
        gv = torch.randn(2, s, 8, 128, device="cuda", generator=gen).bfloat16()
        got = compiled(k, v)
        want = expand_both(k, v)
        for a, b in zip(got, want):
            assert torch.equal(bits(a), bits(b))
        got_grads = torch.autograd.grad(got, (k, v), (gk, gv))
        want_grads = torch.autograd.grad(want, (k, v), (gk, gv))
        for a, b in zip(got_grads, want_grads):
            assert torch.equal(bits(a), bits(b)) and a.stride() == b.stride()
        # a whole layer compiled (inductor may lay SDPA's inputs out differently): within the
        # bound of test_gpu_sdpa_layer_matches_enable_gqa, M from the eager per-head gradients
        q = torch.randn(2, 8, s, 128, device="cuda", generator=gen).bfloat16().requires_grad_()
        dout = torch.randn(2, 8, s, 128, device="cuda", generator=gen).bfloat16()
        got_grads = torch.autograd.grad(compiled_layer(q, k, v), (k, v), dout)
        keep = []
        want_out = layer(q, k, v, keep)
        want_out.backward(dout)
        for name, a, b, g, dim in zip(("dk", "dv"), got_grads, (k.grad, v.grad), (keep[0].grad, keep[1].grad), (1, 2)):
            assert_within_layer_bound(name, a, b, g, 4, dim)
        k.grad = v.grad = q.grad = None
    assert len(paths) == 16 and set(paths) <= {"kernel", "kernel_copy"}  # never the plain-PyTorch path


@pytest.mark.gpu
@pytest.mark.parametrize("debug", (False, True), ids=("", "debug"))
def test_gpu_cuda_graph(paths, debug, monkeypatch):
    # forward and backward captured once; replays read new contents of the static input and gradient.
    # FLASH_EPILOGUE_DEBUG: the C++ backward synchronizes after its kernel, except under capture
    if debug:
        monkeypatch.setenv("FLASH_EPILOGUE_DEBUG", "1")
        fe.refresh_env_flags()
        assert _extension._C._debug_sync()
    gen = cuda_gen(6)
    x = torch.randn(2, 2, 300, 128, device="cuda", generator=gen).bfloat16().requires_grad_()
    gy = torch.randn(2, 8, 300, 128, device="cuda", generator=gen).bfloat16()

    def step():
        y = fe.repeat_kv(x, 4)
        (gx,) = torch.autograd.grad(y, x, gy)
        return y, gx

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            y, gx = step()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        with torch.no_grad():
            x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
            gy.copy_(torch.randn(gy.shape, device="cuda", generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(y), bits(original_repeat_kv(x.detach(), 4)))
        assert torch.equal(bits(gx), bits(R.group_sum_reference(gy, 4, 1)))
    assert "kernel" in paths
