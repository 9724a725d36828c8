"""repeat_kv under every autograd mode, against transformers' repeat_kv (expand + reshape) on the same inputs:
forward-mode AD (forward_ad, torch.func.jvp: the repeated tangent, bitwise), torch.func's grad, vjp and vmap and their
compositions (jacrev, jacfwd, hessian, per-sample gradients), double backward, forward-over-reverse, fp64 gradcheck
and gradgradcheck. Every gradient is bitwise the head-order fp32 sum (test_repeat_kv.group_sum) and within rounding of
transformers'. CPU (the extension's CPU path, or without it the plain-torch one) and, on an sm_90 GPU, the kernels.
"""
import functools

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import flash_epilogue as fe
from conftest import same
from test_repeat_kv import group_sum, kv_shape, original_repeat_kv

N_REP = 3
pytestmark = [pytest.mark.parametrize("dim", [1, 2]),
              pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])]


def inputs(device, dim, dtype=torch.float32, batch=()):
    """x of `batch` + (2, 2, 40, 64), its heads in dim (of each example), a tangent of x and a cotangent of
    repeat_kv(x)."""
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (*batch, *kv_shape((2, 2, 40, 64), dim))
    out_shape = list(shape)
    out_shape[len(batch) + dim] *= N_REP
    return [torch.randn(s, generator=gen, device=device).to(dtype) for s in (shape, shape, out_shape)]


def test_forward_ad_carries_the_repeated_tangent(device, dim):
    x, t, _ = inputs(device, dim, torch.bfloat16)
    with fwAD.dual_level():
        primal, tangent = fwAD.unpack_dual(fe.repeat_kv(fwAD.make_dual(x, t), N_REP, dim=dim))
    assert tangent is not None, "the tangent was dropped"
    # forward_ad, torch.func.jvp, and jvp of the raw op
    raw = [lambda a: torch.ops.flash_epilogue.repeat_kv(a, N_REP, dim)] if fe.kernels_available() else []
    results = [(primal, tangent)] + [jvp(f, (x,), (t,)) for f in [lambda a: fe.repeat_kv(a, N_REP, dim=dim), *raw]]
    for primal, tangent in results:
        assert same(primal, original_repeat_kv(x, N_REP, dim))
        assert same(tangent, original_repeat_kv(t, N_REP, dim))


def test_func_grad_and_vjp_are_the_head_order_sum(device, dim):
    x, _, g = inputs(device, dim, torch.bfloat16)
    y, pullback = vjp(lambda a: fe.repeat_kv(a, N_REP, dim=dim), x)
    assert same(y, original_repeat_kv(x, N_REP, dim))
    assert same(pullback(g)[0], group_sum(g, N_REP, dim))
    gx = grad(lambda a: (fe.repeat_kv(a, N_REP, dim=dim).float() * g.float()).sum())(x)
    assert same(gx, group_sum(g, N_REP, dim))
    # transformers' gradient: the same fp32 sum in torch's order, rounded once
    torch.testing.assert_close(gx, vjp(lambda a: original_repeat_kv(a, N_REP, dim), x)[1](g)[0])


def test_vmap_over_a_batch_of_inputs(device, dim):
    xs, ts, gs = inputs(device, dim, torch.bfloat16, batch=(4,))
    f = functools.partial(fe.repeat_kv, n_rep=N_REP, dim=dim)
    ys = vmap(f)(xs)
    assert same(ys, torch.stack([original_repeat_kv(x, N_REP, dim) for x in xs]))
    for in_dim in (1, 3):  # the vmapped dim elsewhere than in front
        assert same(vmap(f, in_dims=in_dim)(xs.movedim(0, in_dim)), ys)
    # per-sample vjp and jvp under vmap
    gxs = vmap(lambda a, g: vjp(f, a)[1](g)[0])(xs, gs)
    assert same(gxs, torch.stack([group_sum(g, N_REP, dim) for g in gs]))
    tangents = vmap(lambda a, t: jvp(f, (a,), (t,))[1])(xs, ts)
    assert same(tangents, torch.stack([original_repeat_kv(t, N_REP, dim) for t in ts]))


def test_jacobians_and_hessian_match_transformers(device, dim):
    x = torch.randn(kv_shape((1, 2, 3, 8), dim), dtype=torch.float64, device=device)
    w = torch.randn(kv_shape((1, 4, 3, 8), dim), dtype=torch.float64, device=device)
    mine, theirs = (lambda a: fe.repeat_kv(a, 2, dim=dim)), (lambda a: original_repeat_kv(a, 2, dim))
    for jac in (jacrev, jacfwd):
        assert torch.equal(jac(mine)(x), jac(theirs)(x))
    assert torch.equal(hessian(lambda a: (mine(a) ** 2 * w).sum())(x), hessian(lambda a: (theirs(a) ** 2 * w).sum())(x))


def test_gradcheck_fp64(device, dim):
    for shape in ((2, 3, 4, 8), (1, 1, 3, 8), (1, 2, 3, 8)):
        x = torch.randn(kv_shape(shape, dim), dtype=torch.float64, device=device, requires_grad=True)
        assert torch.autograd.gradcheck(lambda t: fe.repeat_kv(t, 3, dim=dim), (x,))
        assert torch.autograd.gradgradcheck(lambda t: fe.repeat_kv(t, 3, dim=dim), (x,))


def test_double_backward_and_forward_over_reverse(device, dim):
    x, t, g = inputs(device, dim)
    x.requires_grad_()
    g.requires_grad_()
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
