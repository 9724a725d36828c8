"""flash_epilogue.repeat_kv: transformers' repeat_kv with the deterministic group reduce as backward.

Against transformers' expand + reshape on the same inputs: the forward bitwise, every gradient bitwise the head-order
fp32 sum (group_sum) and within the bound below, the GPU's kernel path seen by torch.profiler; under every autograd
mode (forward AD, torch.func's transforms and their compositions, double backward, forward-over-reverse, fp64
gradcheck), torch.compile and CUDA graphs. Errors: test_bad_inputs.py.

Bound (u: the gradient dtype's unit roundoff; u32 = 2^-24, the fp32 accumulator's; M = sum_j |g_j|
over a group of n query-head gradients g_j): the backward computes rnd(fl(0 + g_0 + ... + g_{n-1})); the n - 1
additions after the exact first each err by <= u32 * M, the rounding by <= u * |result| (+ smallest_normal * u):

    |result - sum_j g_j| <= u * |sum_j g_j| + 2 * n * u32 * M + smallest_normal * u.
"""
import functools
import itertools

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.library import opcheck
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import flash_epilogue as fe
from conftest import cuda_graph
from flash_epilogue.reference import gqa_reduce_reference
from flash_epilogue.testing import bits, generator, same

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
UNIT_ROUNDOFF = {BF16: 2.0**-8, F16: 2.0**-11, F32: 2.0**-24}
FLASH_KERNELS = ("TileStreamKernel", "GqaReduceKernel")


def original_repeat_kv(x, n_rep, dim=1):
    """What transformers' Llama repeat_kv does (dim=1), and its analogue for (b, s, h_k, d)."""
    if n_rep == 1:
        return x
    return x.unsqueeze(dim + 1).expand(*x.shape[:dim + 1], n_rep, *x.shape[dim + 1:]).flatten(dim, dim + 1)


def kv_shape(shape, dim):
    """A (b, h, s, d) shape with its heads in `dim` (1 or 2)."""
    return tuple(shape) if dim == 1 else (shape[0], shape[2], shape[1], shape[3])


def assert_within(a, b, bound, name=""):
    err = (a.double() - b.double()).abs()
    bad = err > bound
    assert not bad.any(), f"{name}: {int(bad.sum())} elements off, worst excess {(err - bound).max().item():.3e}"


def group_sum(grad, n_rep, dim=1):
    """The backward's arithmetic (independently of reference.py): for every KV head, 0 + g_0 + ... + g_{n-1} in fp32
    (fp64 for fp64 gradients), rounded once to the gradient's dtype."""
    parts = grad.unflatten(dim % 4, (-1, n_rep)).unbind(dim % 4 + 1)
    acc = torch.zeros_like(parts[0], dtype=torch.promote_types(grad.dtype, F32))
    for g in parts:
        acc = acc + g
    return acc.to(grad.dtype)


def launches(fn, device="cuda"):
    """(fn's result, how many flash_epilogue kernels it launched: torch.profiler's CUDA kernel names; None on the CPU,
    where none is counted)."""
    if device == "cpu":
        return fn(), None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, sum(e.count for e in prof.key_averages() if any(k in e.key for k in FLASH_KERNELS))


@pytest.fixture(scope="module")
def profiler_sees_kernels():
    """launches works here: a plain gqa_reduce shows its kernel (else CUPTI is missing)."""
    p = torch.randn(1, 64, 4, 64, device="cuda")
    if not launches(lambda: fe.gqa_reduce(p, num_heads_kv=2))[1]:
        pytest.skip("torch.profiler shows no CUDA kernel names here")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda":
        request.getfixturevalue("profiler_sees_kernels")
    return request.param


def grad_of(x, y, g, **kw):
    return torch.autograd.grad(y, x, g, **kw)[0]


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("dtype", [F32, BF16, F16, F64, torch.int64], ids=str)
def test_forward_matches_the_original(device, dtype, dim):
    gen = torch.Generator(device).manual_seed(dim)
    shapes = [(2, 3, 5, 8), (2, 1, 5, 8), (2, 3, 7, 16), (2, 1, 7, 16), (1, 4, 1, 16), (3, 2, 7, 24), (0, 2, 3, 8),
              *(kv_shape(s, dim) for s in ((2, 8, 300, 128), (1, 1, 77, 64), (3, 4, 129, 96)))]
    for shape in shapes:
        x = (torch.randn(shape, generator=gen, device=device) * 100).to(dtype)
        # contiguous; a (b, s, h_k, d) projection output seen as (b, h_k, s, d), padded rows (the small ones)
        layouts = (x, x.transpose(1, 2).contiguous().transpose(1, 2), torch.nn.functional.pad(x, (0, 8))[..., :-8])
        for x, n_rep in itertools.product(layouts[:3 if x.numel() < 10**4 else 1], (1, 2, 3, 4, 8)):
            y, want = fe.repeat_kv(x, n_rep, dim=dim), original_repeat_kv(x, n_rep, dim)
            assert same(y, want) and torch.equal(y, x.repeat_interleave(n_rep, dim=dim))
            if n_rep == 1:
                assert y is x  # as transformers: the input itself
                continue
            # a new contiguous tensor, like the copy the original's reshape makes; with one KV head the
            # original's reshape is a stride-0 view of x instead, and ours is still a contiguous copy
            assert y.is_contiguous()
            if y.numel() and x.shape[dim] > 1:
                assert y.stride() == want.stride()
            # writable apart from x (a stride-0 view could not even be written)
            before = x.clone()
            y.add_(1)
            assert same(x, before)


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
@pytest.mark.parametrize("d", [16, 64, 80, 96, 128, 192, 256])
def test_backward_is_the_sequential_fp32_sum(device, d, dtype):
    # x in every memory order of its leading dims, and with its head dim not innermost; gradients in both orders and
    # with padded rows (a pitch of d + 8 elements, a multiple of 16 bytes: on the GPU the kernel reads all three);
    # values over many binades: the order of the additions matters
    gen = torch.Generator(device).manual_seed(d + 1000 * (BF16, F16, F32).index(dtype))
    # (batch, KV heads, n_rep, sequence length; the CPU's at most 9: its reference is slow)
    shapes = ((2, 2, 4, 131), (2, 1, 8, 195), (2, 2, 3, 259), (2, 4, 2, 323), (2, 3, 2, 9), (2, 3, 2, 5), (1, 2, 3, 5),
              (2, 2, 2, 3), (1, 1, 16, 1))
    orders = ((0, 1, 2, 3), (0, 2, 1, 3), (1, 0, 2, 3), (2, 1, 0, 3), (0, 3, 2, 1))  # x's dims in memory, outer first
    for (b, hk, n_rep, s), dim, order in itertools.product(shapes, (1, 2), orders):
        s = s if device == "cuda" else min(s, 9)
        shape = kv_shape((b, hk, s, d), dim)
        x = torch.randn([shape[i] for i in order], generator=gen, device=device).to(dtype)
        x = x.permute([order.index(i) for i in range(4)]).requires_grad_()
        # its gradient's layout: dense, the last dim innermost, the leading dims in x's order
        lead = [i for i in order if i != 3] + [3]
        layout = torch.empty([shape[i] for i in lead]).permute([lead.index(i) for i in range(4)])
        y = fe.repeat_kv(x, n_rep, dim=dim)
        g = (torch.randn(y.shape, generator=gen, device=device)
             * torch.exp2(torch.randint(-10, 11, y.shape, generator=gen, device=device))).to(dtype)
        grads = [g, g.transpose(1, 2).contiguous().transpose(1, 2), torch.nn.functional.pad(g, (0, 8))[..., :-8]]
        gxs, launched = launches(lambda: [grad_of(x, y, gy, retain_graph=True) for gy in grads], device)
        assert launched is None or (launched == 0 if dtype == F32 else launched >= 2)
        for gy, gx in zip(grads, gxs):
            case = (b, hk, n_rep, s, dim, order)
            # x's layout (equal strides on every dim longer than 1: a size-1 dim's stride is arbitrary), own storage
            assert gx.dtype == dtype and gx.untyped_storage().nbytes() == gx.numel() * gx.element_size(), case
            assert all(sa == sb for n, sa, sb in zip(gx.shape, gx.stride(), layout.stride()) if n > 1), case
            # the kernel's arithmetic through reference.py (heads in dim 2 of a (b, s, h, d) view)
            view = gy.transpose(1, 2) if dim == 1 else gy
            ref = gqa_reduce_reference(view, num_heads_kv=hk, out_dtype=dtype, sequential=True)
            assert torch.equal(bits(gx), bits(ref.transpose(1, 2) if dim == 1 else ref)), case
            assert torch.equal(bits(gx), bits(group_sum(gy, n_rep, dim))), case
        # the original's backward: the same sum up to the order of fp32 additions, within the module docstring's bound
        got, g64 = grad_of(x, original_repeat_kv(x, n_rep, dim), g), g.double().unflatten(dim, (-1, n_rep))
        exact, u = g64.sum(dim + 1), UNIT_ROUNDOFF[dtype]
        assert_within(got, exact, u * exact.abs() + 2 * n_rep * 2.0**-24 * g64.abs().sum(dim + 1)
                      + torch.finfo(dtype).smallest_normal * u)


def test_backward_sign_of_zero_and_specials():
    # 0 + (-0) = +0: the accumulator starts at +0.0 as the kernel's does; inf/nan propagate
    g = torch.tensor([-0.0, -0.0, 1.0, float("inf"), float("nan"), 2.0], dtype=BF16).view(1, 6, 1, 1)
    x = torch.zeros(1, 3, 1, 8, dtype=BF16, requires_grad=True)
    out = grad_of(x, fe.repeat_kv(x, 2), g.expand(1, 6, 1, 8).contiguous())
    assert out[0, 0, 0, 0].item() == 0.0 and not out[0, 0, 0, 0].signbit()
    assert out[0, 1, 0, 0].item() == float("inf") and out[0, 2, 0, 0].isnan()


@pytest.mark.ops
@pytest.mark.parametrize("dim", [1, 2])
def test_opcheck_and_backward_output_strides(dim):
    for shape in ((2, 3, 5, 8), (1, 1, 4, 16)):
        x = torch.randn(kv_shape(shape, dim), requires_grad=True)
        opcheck(torch.ops.flash_epilogue.repeat_kv.default, (x, 2, dim))
        opcheck(torch.ops.flash_epilogue.repeat_kv.default, (x.detach().bfloat16(), 3, dim))
        g = torch.randn(fe.repeat_kv(x, 2, dim=dim).shape, requires_grad=True)
        for layout in ([0, 1, 2], [0, 2, 1], [2, 0, 1]):
            opcheck(torch.ops.flash_epilogue.repeat_kv_backward.default, (g, 2, dim, layout))
        opcheck(torch.ops.flash_epilogue.repeat_kv_backward.default, (g.detach().half(), 2, dim, [0, 1, 2]))
    # the backward op allocates x's gradient itself: the same strides as its fake kernel's, size-0 and size-1 dims
    # included
    for shape in ((2, 6, 5, 8), (1, 2, 1, 8), (0, 4, 3, 8), (2, 4, 0, 8), (3, 2, 1, 1)):
        g = torch.randn(kv_shape(shape, dim))
        for layout in ([0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]):
            got = torch.ops.flash_epilogue.repeat_kv_backward(g, 2, dim, layout)
            with FakeTensorMode() as mode:
                want = torch.ops.flash_epilogue.repeat_kv_backward(mode.from_tensor(g), 2, dim, layout)
            assert got.shape == want.shape and got.stride() == want.stride(), (shape, layout)
            assert torch.equal(got, group_sum(g, 2, dim))
    # negative dims name the same dims
    x = torch.randn(2, 2, 4, 8)
    assert torch.equal(torch.ops.flash_epilogue.repeat_kv_backward(x, 2, -2, [0, 1, 2]), group_sum(x, 2, 2))
    assert torch.equal(torch.ops.flash_epilogue.repeat_kv(x, 2, -3), fe.repeat_kv(x, 2, dim=1))
    assert torch.equal(fe.repeat_kv(x, 2, dim=-2), fe.repeat_kv(x, 2, dim=2))
    # 0 KV heads divide by any n_rep (no loop of n_rep steps over empty slices)
    assert torch.ops.flash_epilogue.repeat_kv_backward(torch.empty(2, 0, 3, 8), 2**40, 1, [0, 1, 2]).shape == \
        (2, 0, 3, 8)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(device, dynamic):
    # repeat_kv alone and in a GQA attention layer, forward and backward traced in one graph each (the compiled
    # backward takes the kernel path on the GPU, never the plain-PyTorch one): results and gradients bitwise eager's,
    # but the GPU layer's (inductor may lay SDPA's inputs out differently): within assert_within_layer_bound's bound,
    # M from the eager per-head gradients
    torch._dynamo.reset()

    def expand_both(k, v):
        return fe.repeat_kv(k, 4), fe.repeat_kv(v, 4, dim=2)

    def layer(q, k, v):  # and the repeated K and V (their per-query-head gradients bound the GPU's)
        kr, vr = expand_both(k, v)
        return torch.nn.functional.scaled_dot_product_attention(q, kr, vr.transpose(1, 2), is_causal=True), kr, vr

    backend = "aot_eager" if device == "cpu" else "inductor"  # the CPU's SDPA: the math one
    compiled, compiled_layer = (torch.compile(f, fullgraph=True, backend=backend, dynamic=dynamic)
                                for f in (expand_both, layer))
    gen = torch.Generator(device).manual_seed(5)
    dtype, d = (F32, 32) if device == "cpu" else (BF16, 128)
    for s in ((16, 24) if device == "cpu" else (256, 384)):
        q, k, gk, dout = (torch.randn(2, h, s, d, generator=gen, device=device).to(dtype) for h in (8, 2, 8, 8))
        v, gv = (torch.randn(2, s, h, d, generator=gen, device=device).to(dtype) for h in (2, 8))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        got, want = compiled(k, v), expand_both(k, v)
        assert all(map(same, got, want))
        grads, launched = launches(lambda: torch.autograd.grad(got, (k, v), (gk, gv)), device)
        assert launched is None or launched >= 2
        for a, b in zip(grads, torch.autograd.grad(want, (k, v), (gk, gv))):
            assert same(a, b) and a.stride() == b.stride()
        out = compiled_layer(q, k, v)[0]
        grads, launched = launches(lambda: torch.autograd.grad(out, (q, k, v), dout), device)
        assert launched is None or launched >= 2
        want, kr, vr = layer(q, k, v)
        want_grads = torch.autograd.grad(want, (q, k, v, kr, vr), dout)
        if device == "cpu":
            assert torch.equal(out, want)
            for a, b in zip(grads, want_grads):
                assert torch.equal(a, b) and a.stride() == b.stride()
        else:
            for name, a, b, g, dim in zip(("dk", "dv"), grads[1:], want_grads[1:3], want_grads[3:], (1, 2)):
                assert_within_layer_bound(name, a, b, g, 4, dim)


# ---- autograd modes
N_REP = 3


def inputs(device, dim, dtype=torch.float32, batch=()):
    """x of `batch` + (2, 2, 40, 64) (heads in dim of each example), a tangent of x, a cotangent of repeat_kv(x)."""
    gen = torch.Generator(device=device).manual_seed(0)
    shape, out_shape = ((*batch, *kv_shape((2, h, 40, 64), dim)) for h in (2, 2 * N_REP))
    return [torch.randn(s, generator=gen, device=device).to(dtype) for s in (shape, shape, out_shape)]


@pytest.mark.parametrize("dim", [1, 2])
def test_forward_reverse_and_vmap(device, dim):
    # forward mode (forward_ad, torch.func.jvp, jvp of the raw op): the repeated tangent; reverse mode (torch.func's
    # vjp and grad): the head-order sum, within rounding of transformers' (the same fp32 sum in torch's order); both
    # per sample under vmap over a batch of inputs
    x, t, g = inputs(device, dim, torch.bfloat16)
    f = functools.partial(fe.repeat_kv, n_rep=N_REP, dim=dim)
    with fwAD.dual_level():
        primal, tangent = fwAD.unpack_dual(f(fwAD.make_dual(x, t)))
    raw = [lambda a: torch.ops.flash_epilogue.repeat_kv(a, N_REP, dim)] if fe.kernels_available() else []
    for primal, tangent in [(primal, tangent)] + [jvp(h, (x,), (t,)) for h in [f, *raw]]:
        assert same(primal, original_repeat_kv(x, N_REP, dim)) and same(tangent, original_repeat_kv(t, N_REP, dim))
    y, pullback = vjp(f, x)
    assert same(y, original_repeat_kv(x, N_REP, dim)) and same(pullback(g)[0], group_sum(g, N_REP, dim))
    gx = grad(lambda a: (f(a).float() * g.float()).sum())(x)
    assert same(gx, group_sum(g, N_REP, dim))
    torch.testing.assert_close(gx, vjp(lambda a: original_repeat_kv(a, N_REP, dim), x)[1](g)[0])
    xs, ts, gs = inputs(device, dim, torch.bfloat16, batch=(4,))
    ys = vmap(f)(xs)
    assert same(ys, torch.stack([original_repeat_kv(x, N_REP, dim) for x in xs]))
    for in_dim in (1, 3):  # the vmapped dim elsewhere than in front
        assert same(vmap(f, in_dims=in_dim)(xs.movedim(0, in_dim)), ys)
    gxs = vmap(lambda a, g: vjp(f, a)[1](g)[0])(xs, gs)
    assert same(gxs, torch.stack([group_sum(g, N_REP, dim) for g in gs]))
    tangents = vmap(lambda a, t: jvp(f, (a,), (t,))[1])(xs, ts)
    assert same(tangents, torch.stack([original_repeat_kv(t, N_REP, dim) for t in ts]))


@pytest.mark.parametrize("dim", [1, 2])
def test_higher_order(device, dim):
    # fp64: jacrev, jacfwd and the hessian bitwise transformers'; gradcheck and gradgradcheck
    mine, theirs = functools.partial(fe.repeat_kv, n_rep=2, dim=dim), (lambda a: original_repeat_kv(a, 2, dim))
    x, w = (torch.randn(kv_shape((1, h, 3, 8), dim), dtype=F64, device=device) for h in (2, 4))
    for jac in (jacrev, jacfwd):
        assert torch.equal(jac(mine)(x), jac(theirs)(x))
    assert torch.equal(hessian(lambda a: (mine(a) ** 2 * w).sum())(x), hessian(lambda a: (theirs(a) ** 2 * w).sum())(x))
    for shape in ((2, 3, 4, 8), (1, 1, 3, 8), (1, 2, 3, 8)):
        x = torch.randn(kv_shape(shape, dim), dtype=F64, device=device, requires_grad=True)
        f = functools.partial(fe.repeat_kv, n_rep=3, dim=dim)
        assert torch.autograd.gradcheck(f, (x,)) and torch.autograd.gradgradcheck(f, (x,))
    # double backward
    x, t, g = inputs(device, dim)
    x, g = x.requires_grad_(), g.requires_grad_()
    y = fe.repeat_kv(x, N_REP, dim=dim)
    (gx,) = torch.autograd.grad(y, x, g, create_graph=True)
    if fe.kernels_available():  # the extension's nodes
        assert (y.grad_fn.name(), gx.grad_fn.name()) == ("RepeatKvBackward", "RepeatKvBackwardBackward")
    assert same(gx, group_sum(g.detach(), N_REP, dim))
    (gg,) = torch.autograd.grad(gx, g, t)  # the backward's adjoint: the expand again
    assert same(gg, original_repeat_kv(t, N_REP, dim))
    # forward-over-reverse: a tangent of the cotangent through the backward (the group sum of the tangent)
    with fwAD.dual_level():
        y = fe.repeat_kv(x, N_REP, dim=dim)
        dual_g = fwAD.make_dual(g.detach(), original_repeat_kv(t, N_REP, dim))
        primal, tangent = fwAD.unpack_dual(torch.autograd.grad(y, x, dual_g)[0])
    assert same(primal, group_sum(g.detach(), N_REP, dim))
    assert same(tangent, group_sum(original_repeat_kv(t, N_REP, dim), N_REP, dim))
    # torch.func: the hessian-vector product of a quadratic through the op, forward over reverse
    w = torch.randn(y.shape, device=device)
    _, hvp = jvp(grad(lambda a: (fe.repeat_kv(a, N_REP, dim=dim) ** 2 * w).sum()), (x.detach(),), (t,))
    torch.testing.assert_close(hvp, group_sum(2 * w * original_repeat_kv(t, N_REP, dim), N_REP, dim))


# ---- GPU
def backward_path(gy, n_rep=4, dim=1):
    """(the gradient of x, the number of flash_epilogue kernels its backward launched) for repeat_kv's output
    gradient `gy` (x: a leaf of gy's dtype, KV heads in `dim`), the gradient checked bitwise."""
    shape = list(gy.shape)
    shape[dim] //= n_rep
    x = torch.zeros(shape, dtype=gy.dtype, device=gy.device, requires_grad=True)
    y = fe.repeat_kv(x, n_rep, dim=dim)
    gx, launched = launches(lambda: grad_of(x, y, gy))
    assert torch.equal(bits(gx), bits(group_sum(gy, n_rep, dim)))
    return gx, launched


@pytest.mark.gpu
def test_gpu_backward_path(profiler_sees_kernels):
    # (gradients the kernel reads as they are: test_backward_is_the_sequential_fp32_sum) the stride-0 gradient of a
    # .sum(), a row pitch that is not a multiple of 16 bytes, a misaligned start: one contiguous copy, then the kernel
    # (the result does not depend on it)
    shape = (2, 8, 9, 64)
    misaligned = torch.randn(2 * 8 * 9 * 64 + 1, device="cuda").bfloat16()[1:].view(shape)
    for gy in (torch.ones((), dtype=BF16, device="cuda").expand(shape),
               torch.randn(2, 8, 9, 68, device="cuda").bfloat16()[..., :64], misaligned):
        assert backward_path(gy)[1]
    x = torch.randn(2, 2, 200, 128, device="cuda").bfloat16().requires_grad_()
    assert launches(lambda: fe.repeat_kv(x, 4).sum().backward())[1]
    assert torch.equal(x.grad, torch.full_like(x, 4.0))
    # plain PyTorch, no flash_epilogue kernel, no error: fp64 gradients (the kernel writes 16-bit only; fp32: as in
    # test_backward_is_the_sequential_fp32_sum), head dims without a tile, empty ones, and past the launchers' grid
    # limits (batch or heads >= 65536)
    for gy in (torch.randn(2, 8, 9, 64, dtype=F64), torch.randn(2, 8, 9, 12).bfloat16(),
               torch.randn(2, 8, 9, 264).bfloat16(), torch.randn(2, 8, 0, 64).bfloat16(),
               torch.randn(0, 8, 9, 64).half()):
        assert backward_path(gy.cuda())[1] == 0, (gy.dtype, gy.shape)
    for shape, dim in (((65536, 2, 1, 8), 1), ((1, 1, 65536, 8), 2)):
        assert backward_path(torch.ones((), dtype=BF16, device="cuda").expand(shape), n_rep=2, dim=dim)[1] == 0


def assert_within_layer_bound(name, a, b, per_head, n_rep, dim):
    """Two gradients a, b of one GQA layer, each the sum over a group of n query heads of per-head gradients g_j that
    the attention kernel accumulates in fp32. Each path rounds to the dtype (u) at most twice: possibly each g_j
    before the sum (ours does: SDPA writes the per-head dK/dV of the repeated tensors in the dtype; FlashAttention's
    GQA backward too), error <= u * M, M = sum_j |g_j| (measured on our per-head gradients, which differ from the
    fp32 g_j by u relatively: covered by the fp32 term's slack), and once after it, <= u * |result|; the fp32 sums
    add <= n * 2^-24 * M each. Hence, elementwise,

        |a - b| <= 2u * M + u * (|a| + |b|) + 2n * 2^-24 * M + smallest_normal * u.
    """
    u = UNIT_ROUNDOFF[a.dtype]
    m = per_head.double().abs().unflatten(dim, (-1, n_rep)).sum(dim + 1)
    bound = 2 * u * m + u * (a.double().abs() + b.double().abs()) + 2 * n_rep * 2.0**-24 * m \
        + torch.finfo(a.dtype).smallest_normal * u
    assert_within(a, b, bound, f"{name} ({(bits(a) == bits(b)).float().mean():.4%} bitwise equal)")


def _sdpa_gqa_case(backend, dim, dtype, seed, b=2, hk=2, n_rep=4, s=256, d=128):
    """An attention layer over repeat_kv'd K/V and the same layer with enable_gqa=True, both
    pinned to `backend`: returns (ours (dk, dv), theirs (dk, dv), per-query-head (dk, dv))."""
    backend = getattr(SDPBackend, backend)
    gen = generator(seed)
    hq = hk * n_rep
    q, k, v = (torch.randn(kv_shape((b, h, s, d), dim), device="cuda", generator=gen).to(dtype) for h in (hq, hk, hk))
    dout = torch.randn(b, hq, s, d, device="cuda", generator=gen).to(dtype)
    heads_major = (lambda t: t) if dim == 1 else (lambda t: t.transpose(1, 2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    kr, vr = fe.repeat_kv(ka, n_rep, dim=dim), fe.repeat_kv(va, n_rep, dim=dim)
    for t in (kr, vr):
        t.retain_grad()
    qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backend):
        sdpa(heads_major(qa), heads_major(kr), heads_major(vr), is_causal=True).backward(dout)
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
def test_gpu_sdpa_layer_matches_enable_gqa(backend, dim, dtype, profiler_sees_kernels):
    # dK/dV over repeat_kv'd K and V against SDPA's own GQA (enable_gqa=True), within assert_within_layer_bound's
    # bound (FLASH_ATTENTION: the per-head values coincide, so typically bitwise, at most one ulp apart where the two
    # fp32 summation orders round apart); on FLASH_ATTENTION, whose per-head dK/dV are deterministic, the same layer 10
    # times: dK and dV bitwise identical each time (the group reduce adds in a fixed order)
    n_rep = 4
    (ours, theirs, per_head), launched = launches(lambda: _sdpa_gqa_case(backend, dim, dtype, 7 + dim, n_rep=n_rep))
    assert launched >= 2
    for name, a, b, g in zip(("dk", "dv"), ours, theirs, per_head):
        assert a.shape == b.shape and a.dtype == b.dtype == dtype
        # our gradient is exactly the sequential sum of the per-head gradients
        assert torch.equal(bits(a), bits(group_sum(g, n_rep, dim))), name
        assert_within_layer_bound(name, a, b, g, n_rep, dim)
    for _ in range(9 if backend == "FLASH_ATTENTION" else 0):
        again, _, again_per_head = _sdpa_gqa_case(backend, dim, dtype, 7 + dim, n_rep=n_rep)
        assert all(map(same, again_per_head, per_head)), "SDPA's own per-head gradients differ between runs"
        assert all(map(same, again, ours))
    for _ in range(50):  # the reduce alone, on one fixed per-head gradient: bitwise group_sum each time
        backward_path(per_head[0], n_rep, dim)


@pytest.mark.gpu
@pytest.mark.parametrize("debug", (False, True), ids=("", "debug"))
def test_gpu_cuda_graph(debug, monkeypatch, profiler_sees_kernels):
    # forward and backward captured once; replays read new contents of the static input and gradient.
    # FLASH_EPILOGUE_DEBUG: the C++ backward synchronizes after its kernel, except under capture
    if debug:
        monkeypatch.setenv("FLASH_EPILOGUE_DEBUG", "1")
        fe.refresh_env_flags()
    gen = generator(6)
    x = torch.randn(2, 2, 300, 128, device="cuda", generator=gen).bfloat16().requires_grad_()
    gy = torch.randn(2, 8, 300, 128, device="cuda", generator=gen).bfloat16()

    def step():
        y = fe.repeat_kv(x, 4)
        return y, grad_of(x, y, gy)

    assert launches(step)[1]  # the kernel path
    graph, (y, gx) = cuda_graph(step, warmup=2)
    for _ in range(3):
        with torch.no_grad():
            for t in (x, gy):
                t.copy_(torch.randn(t.shape, device="cuda", generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        assert same(y, original_repeat_kv(x.detach(), 4)) and same(gx, group_sum(gy, 4, 1))
