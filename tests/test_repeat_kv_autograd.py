"""repeat_kv under every autograd mode, against transformers' repeat_kv (expand + reshape) on the same inputs:
forward-mode AD (torch.autograd.forward_ad and torch.func.jvp: the repeated tangent, bitwise), torch.func's grad, vjp
and vmap and their compositions (jacrev, jacfwd, hessian, per-sample gradients), double backward and
forward-over-reverse. Every gradient is bitwise the head-order fp32 sum (reference.group_sum_reference) and within
rounding of transformers'. CPU (the extension's own CPU path, or without the extension the plain-torch one) and, on an
sm_90 GPU, the kernels.
"""
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import flash_epilogue as fe
from conftest import bits
from flash_epilogue.reference import group_sum_reference
from test_repeat_kv import original_repeat_kv

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
N_REP = 3


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def inputs(device, dim, dtype=torch.float32, batch=(), seed=0):
    """x of `batch` + (2, 2, 40, 64) for dim 1, + (2, 40, 2, 64) for dim 2 (the KV heads in dim of each example), a
    tangent of x and a cotangent of repeat_kv(x)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (*batch, 2, 2, 40, 64) if dim == 1 else (*batch, 2, 40, 2, 64)
    out_shape = list(shape)
    out_shape[len(batch) + dim] *= N_REP

    def rnd(s):
        return torch.randn(s, generator=gen, device=device).to(dtype)

    return rnd(shape), rnd(shape), rnd(out_shape)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [1, 2])
def test_forward_ad_carries_the_repeated_tangent(device, dim):
    x, t, _ = inputs(device, dim, torch.bfloat16)
    with fwAD.dual_level():
        y = fe.repeat_kv(fwAD.make_dual(x, t), N_REP, dim=dim)
        primal, tangent = fwAD.unpack_dual(y)
    assert tangent is not None, "the tangent was dropped"
    assert same_bits(primal, original_repeat_kv(x, N_REP, dim))
    assert same_bits(tangent, original_repeat_kv(t, N_REP, dim))
    # torch.func.jvp, and the raw op
    raw = [lambda a: torch.ops.flash_epilogue.repeat_kv(a, N_REP, dim)] if fe.kernels_available() else []
    for f in [lambda a: fe.repeat_kv(a, N_REP, dim=dim), *raw]:
        primal, tangent = jvp(f, (x,), (t,))
        assert same_bits(primal, original_repeat_kv(x, N_REP, dim))
        assert same_bits(tangent, original_repeat_kv(t, N_REP, dim))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [1, 2])
def test_func_grad_and_vjp_are_the_head_order_sum(device, dim):
    x, _, g = inputs(device, dim, torch.bfloat16)
    want = group_sum_reference(g, N_REP, dim)
    y, pullback = vjp(lambda a: fe.repeat_kv(a, N_REP, dim=dim), x)
    assert same_bits(y, original_repeat_kv(x, N_REP, dim))
    (gx,) = pullback(g)
    assert same_bits(gx, want)
    gx = grad(lambda a: (fe.repeat_kv(a, N_REP, dim=dim).float() * g.float()).sum())(x)
    assert same_bits(gx, want)
    # transformers' gradient: the same fp32 sum in torch's order, rounded once
    _, original_pullback = vjp(lambda a: original_repeat_kv(a, N_REP, dim), x)
    torch.testing.assert_close(gx, original_pullback(g)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [1, 2])
def test_vmap_over_a_batch_of_inputs(device, dim):
    xs, ts, gs = inputs(device, dim, torch.bfloat16, batch=(4,))

    def f(a):
        return fe.repeat_kv(a, N_REP, dim=dim)

    ys = vmap(f)(xs)
    assert same_bits(ys, torch.stack([original_repeat_kv(x, N_REP, dim) for x in xs]))
    for in_dim in (1, 3):  # the vmapped dim elsewhere than in front
        assert same_bits(vmap(f, in_dims=in_dim)(xs.movedim(0, in_dim)), ys)
    # per-sample vjp and jvp under vmap
    gxs = vmap(lambda a, g: vjp(f, a)[1](g)[0])(xs, gs)
    assert same_bits(gxs, torch.stack([group_sum_reference(g, N_REP, dim) for g in gs]))
    tangents = vmap(lambda a, t: jvp(f, (a,), (t,))[1])(xs, ts)
    assert same_bits(tangents, torch.stack([original_repeat_kv(t, N_REP, dim) for t in ts]))


@pytest.mark.parametrize("device", DEVICES)
def test_jacobians_and_hessian_match_transformers(device):
    x = torch.randn(1, 2, 3, 8, dtype=torch.float64, device=device)

    def mine(a):
        return fe.repeat_kv(a, 2)

    def theirs(a):
        return original_repeat_kv(a, 2)

    for jac in (jacrev, jacfwd):
        assert torch.equal(jac(mine)(x), jac(theirs)(x))
    w = torch.randn(1, 4, 3, 8, dtype=torch.float64, device=device)
    h = hessian(lambda a: (mine(a) ** 2 * w).sum())(x)
    assert torch.equal(h, hessian(lambda a: (theirs(a) ** 2 * w).sum())(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [1, 2])
def test_double_backward_and_forward_over_reverse(device, dim):
    x, t, g = inputs(device, dim)
    x.requires_grad_()
    g.requires_grad_()
    y = fe.repeat_kv(x, N_REP, dim=dim)
    (gx,) = torch.autograd.grad(y, x, g, create_graph=True)
    if fe.kernels_available():  # the extension's nodes
        assert (y.grad_fn.name(), gx.grad_fn.name()) == ("RepeatKvBackward", "RepeatKvBackwardBackward")
    assert same_bits(gx, group_sum_reference(g.detach(), N_REP, dim))
    (gg,) = torch.autograd.grad(gx, g, t)  # the backward's adjoint: the expand again
    assert same_bits(gg, original_repeat_kv(t, N_REP, dim))
    # forward-over-reverse: a tangent of the cotangent through the backward (the group sum of the tangent)
    with fwAD.dual_level():
        y = fe.repeat_kv(x, N_REP, dim=dim)
        dual_g = fwAD.make_dual(g.detach(), original_repeat_kv(t, N_REP, dim))
        (gx,) = torch.autograd.grad(y, x, dual_g)
        primal, tangent = fwAD.unpack_dual(gx)
    assert same_bits(primal, group_sum_reference(g.detach(), N_REP, dim))
    assert same_bits(tangent, group_sum_reference(original_repeat_kv(t, N_REP, dim), N_REP, dim))
    # torch.func: the hessian-vector product of a quadratic through the op, forward over reverse
    w = torch.randn(y.shape, device=device)

    def loss(a):
        return (fe.repeat_kv(a, N_REP, dim=dim) ** 2 * w).sum()

    _, hvp = jvp(grad(loss), (x.detach(),), (t,))
    torch.testing.assert_close(hvp, group_sum_reference(2 * w * original_repeat_kv(t, N_REP, dim), N_REP, dim))
