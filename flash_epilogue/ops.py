"""The Python API: thin wrappers over torch.ops.flash_epilogue.*, whose C++ checks every argument. A wrapper coerces
the Python scalars, checks what the op does not see (the GQAAccumulator, gqa_reduce's out, store_zero's index lists)
and raises the op's error as the package's; under torch.compile it calls the op directly. Also the fake kernels, and
repeat_kv's vmap rules and its plain-torch form (without the extension)."""
import operator
import warnings
from typing import Sequence

import torch

from . import _extension
from ._extension import refresh_env_flags
from .errors import INT64_MAX, INT64_MIN, FlashEpilogueTypeError, as_count, as_float, as_index, as_int, fail
from .gqa import GQAAccumulator
from .reference import group_sum_reference

__all__ = ["store", "store_zero", "gqa_accumulate", "gqa_postprocess", "gqa_reduce", "repeat_kv", "refresh_env_flags"]

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_HALF_DTYPES = (torch.float16, torch.bfloat16)
IndexArg = None | int | Sequence[int] | torch.Tensor


def store(dk_accum: torch.Tensor, dv_accum: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *,
          cu_seqlens: torch.Tensor | None = None, seqused: torch.Tensor | None = None,
          check_inputs: bool | None = None) -> None:
    """In place: dk and dv (bf16 or fp16) get the fp32 ``dk_accum``/``dv_accum`` of their shapes, rounded to nearest
    even, in their valid rows only.

    Layouts: batched, (batch, seqlen, num_heads_kv, head_dim); or varlen, (total_tokens, num_heads_kv, head_dim) with
    ``cu_seqlens`` (int32, (batch + 1,), on the tensors' device) giving each sequence's rows. ``seqused`` (int32,
    (batch,)) keeps the first seqused[b] rows of sequence b valid. Head dims: multiples of 8 up to 256, dv may differ
    from d. Any strides with the last dim contiguous and 16-byte multiples elsewhere. Runs on an sm_90 GPU (H100,
    H200); ``flash_epilogue.reference.store_reference`` computes the same bits on any device. Bad arguments raise
    FlashEpilogueInputError (FlashEpilogueTypeError for types and dtypes); ``check_inputs=True`` also checks the
    contents of cu_seqlens/seqused (a host sync)."""
    _store(dk_accum, dv_accum, dk, dv, cu_seqlens=cu_seqlens, seqused=seqused, check_inputs=check_inputs)


def _arch_of(op: str, arch) -> int:
    """The ops' private `_arch`: 0 runs the device's code path; 80 the sm_80 one on an sm_90 GPU, in a build that has it
    (the tests use it through the private twins _store, _store_zero and _gqa_reduce; the op checks the value)."""
    return arch if type(arch) is int and INT64_MIN <= arch <= INT64_MAX else as_int(op, "_arch", arch)


def _store(dk_accum, dv_accum, dk, dv, *, cu_seqlens=None, seqused=None, check_inputs=None, _arch=0) -> None:
    """:func:`store` on the code path `_arch` (see _arch_of)."""
    _extension.call_op("store", check_inputs, dk, dk_accum, dv_accum, dk, dv, cu_seqlens=cu_seqlens, seqused=seqused,
                       _arch=_arch_of("store", _arch))


def _index_tensor(name: str, idx: IndexArg, device) -> torch.Tensor | None:
    """batch_idx/head_idx as the op takes them: None or a tensor as given, an int or ints as a new int32 tensor."""
    if idx is None or isinstance(idx, torch.Tensor):
        return idx
    op, what = "store_zero", "None, an int, a sequence of ints or an int32 tensor"
    if isinstance(idx, (bool, str, bytes)):
        fail(op, name, what, type(idx).__name__, FlashEpilogueTypeError)
    # never operator.index of a list or tuple: under torch.compile its TypeError is dynamo's error, uncatchable here
    if not isinstance(idx, (list, tuple)):
        try:
            idx = operator.index(idx)
        except TypeError:
            try:
                idx = list(idx)
            except TypeError:
                fail(op, name, what, type(idx).__name__, FlashEpilogueTypeError)
    names = [name] if isinstance(idx, int) else [f"{name}[{i}]" for i in range(len(idx))]
    values = [idx] if isinstance(idx, int) else [as_index(op, n, v) for n, v in zip(names, idx)]
    for v, n in zip(values, names):
        if not _I32_MIN <= v <= _I32_MAX:
            fail(op, n, f"an int32 value in [{_I32_MIN}, {_I32_MAX}]", v)
    # host-built, then moved: on meta under torch.compile a traced op (torch.tensor on meta is real, dynamo rejects it)
    return torch.tensor(values, dtype=torch.int32).to(device)


def store_zero(dk: torch.Tensor, dv: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
               seqused: torch.Tensor | None = None, batch_idx: IndexArg = None, head_idx: IndexArg = None,
               row_start: int = 0, row_end: int | None = None, check_inputs: bool | None = None) -> None:
    """In place: zeros in dk and dv (bf16 or fp16, layouts as :func:`store`'s) in rows [row_start, row_end) (counted
    from each sequence's start, clipped to its valid rows) of the sequences ``batch_idx`` and heads ``head_idx``
    (None: all; an int, ints, or an int32 tensor on dk's device; out-of-range entries are skipped). Runs on an sm_90
    GPU; ``flash_epilogue.reference.store_zero_reference`` is the same on any device."""
    _store_zero(dk, dv, cu_seqlens=cu_seqlens, seqused=seqused, batch_idx=batch_idx, head_idx=head_idx,
                row_start=row_start, row_end=row_end, check_inputs=check_inputs)


def _store_zero(dk, dv, *, cu_seqlens=None, seqused=None, batch_idx=None, head_idx=None, row_start=0, row_end=None,
                check_inputs=None, _arch=0) -> None:
    """:func:`store_zero` on the code path `_arch` (see _arch_of)."""
    op = "store_zero"
    if (batch_idx is not None or head_idx is not None) and isinstance(dk, torch.Tensor):
        batch_idx = _index_tensor("batch_idx", batch_idx, dk.device)
        head_idx = _index_tensor("head_idx", head_idx, dk.device)
    if type(row_start) is not int or not INT64_MIN <= row_start <= INT64_MAX:
        row_start = as_int(op, "row_start", row_start)
    if row_end is not None and (type(row_end) is not int or not INT64_MIN <= row_end <= INT64_MAX):
        row_end = as_int(op, "row_end", row_end, "None or an int")
    _extension.call_op(op, check_inputs, dk, dk, dv, cu_seqlens=cu_seqlens, seqused=seqused, batch_idx=batch_idx,
                       head_idx=head_idx, row_start=row_start, row_end=row_end, _arch=_arch_of(op, _arch))


def _check_acc(op: str, acc, k, v, cu_seqlens, k_name: str, v_name: str) -> None:
    """`acc` is a GQAAccumulator. The op sees only its tensors: where their shapes are not those of this call's
    problem, the field of `acc` sized for another problem is named (the op reports everything else)."""
    if not isinstance(acc, GQAAccumulator):
        fail(op, "acc", "a flash_epilogue.GQAAccumulator (from flash_epilogue.gqa_accumulator)", type(acc).__name__,
             FlashEpilogueTypeError)
    varlen = cu_seqlens is not None
    rank = 3 if varlen else 4
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == rank == v.dim()):
        return
    if varlen and not (isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1):
        return
    want = (cu_seqlens.numel() - 1 if varlen else k.shape[0], k.shape[0 if varlen else 1], k.shape[-1], v.shape[-1])
    if (acc.varlen, acc.batch, acc.rows, acc.head_dim, acc.head_dim_v) == (varlen, *want):
        return
    # sized with dk's heads (postprocess) or the accumulator's, as the op does
    heads = k.shape[-2] if op == "gqa_postprocess" else acc.dk_accum.shape[1]
    try:
        layout = _extension._C.gqa_accum_layout(heads, *want[2:], *want[:2], varlen, acc.arch, k.device)
    except (TypeError, ValueError):  # arguments the op rejects itself
        return
    if tuple(map(tuple, layout["shapes"])) != (tuple(acc.dk_accum.shape), tuple(acc.dv_accum.shape)):
        return  # the op's own shape check comes first
    if acc.varlen != varlen:
        kind = "varlen (cu_seqlens given)" if varlen else "batched (cu_seqlens None)"
        fail(op, "acc.varlen", f"{varlen}: the call's layout is {kind}", acc.varlen)
    whys = ("cu_seqlens.numel() - 1", f"{k_name}.shape[0], the total tokens") if varlen else (
        f"{k_name}.shape[0]", f"{k_name}.shape[1], the seqlen")
    for field, w, why in zip(("batch", "rows", "head_dim", "head_dim_v"), want,
                             whys + (f"{k_name}.shape[-1]", f"{v_name}.shape[-1]")):
        if getattr(acc, field) != w:
            fail(op, f"acc.{field}", f"{w} ({why})", getattr(acc, field))


def gqa_accumulate(dk_partial: torch.Tensor, dv_partial: torch.Tensor, acc: GQAAccumulator, *,
                   deterministic: bool | None = None, cu_seqlens: torch.Tensor | None = None,
                   seqused: torch.Tensor | None = None, check_inputs: bool | None = None) -> None:
    """In place: add the fp32 per-query-head partials ``dk_partial``/``dv_partial`` ((batch, seqlen, num_heads_q,
    d) or varlen (total_tokens, num_heads_q, d)) into ``acc`` (a :class:`GQAAccumulator` of this problem), in their
    valid rows: query head j adds into KV head j // (num_heads_q / num_heads_kv), a group's heads in head order.

    ``deterministic`` (default: as ``acc`` was allocated, or torch's deterministic-algorithms switch) selects the
    sm_80 path's ordered mode, which needs ``acc`` allocated with it; the sm_90 path is deterministic in both modes.
    Runs on an sm_90 GPU; ``flash_epilogue.reference.gqa_accumulate_reference`` gives the dense sums on any
    device."""
    op = "gqa_accumulate"
    _check_acc(op, acc, dk_partial, dv_partial, cu_seqlens, "dk_partial", "dv_partial")
    if deterministic is None:  # with warn_only, an accumulator allocated without it runs the atomic mode, warning
        deterministic = acc.deterministic or (torch.are_deterministic_algorithms_enabled() and
                                              not torch.is_deterministic_algorithms_warn_only_enabled())
    elif type(deterministic) is not bool:
        fail(op, "deterministic", "a bool", type(deterministic).__name__, FlashEpilogueTypeError)
    if not deterministic and acc.arch == 80 and torch.are_deterministic_algorithms_enabled() and \
            torch.is_deterministic_algorithms_warn_only_enabled():  # without warn_only the op raises torch's error
        warnings.warn("flash_epilogue.gqa_accumulate(deterministic=False) on the sm_80 path does not have a "
                      "deterministic implementation, but you set 'torch.use_deterministic_algorithms(True, "
                      "warn_only=True)'", stacklevel=2)
    _extension.call_op(op, check_inputs, dk_partial, dk_partial, dv_partial, acc.dk_accum, acc.dv_accum,
                       acc.semaphores if deterministic else None, cu_seqlens=cu_seqlens, seqused=seqused,
                       deterministic=deterministic, _arch=acc.arch)


def gqa_postprocess(acc: GQAAccumulator, dk: torch.Tensor, dv: torch.Tensor, *, scale_dk: float = 1.0,
                    scale_dv: float = 1.0, cu_seqlens: torch.Tensor | None = None,
                    seqused: torch.Tensor | None = None, check_inputs: bool | None = None) -> None:
    """In place: the valid rows of dk/dv (bf16 or fp16, num_heads_kv heads, layouts as :func:`store`'s) get
    ``(accum * fp32(scale)).to(dtype)`` of ``acc``'s accumulators, bitwise; ``acc`` is unchanged (``acc.reset()``
    before reusing it). Runs on an sm_90 GPU."""
    op = "gqa_postprocess"
    _check_acc(op, acc, dk, dv, cu_seqlens, "dk", "dv")
    scale_dk = scale_dk if type(scale_dk) is float else as_float(op, "scale_dk", scale_dk)
    scale_dv = scale_dv if type(scale_dv) is float else as_float(op, "scale_dv", scale_dv)
    _extension.call_op(op, check_inputs, dk, acc.dk_accum, acc.dv_accum, dk, dv, scale_dk=scale_dk, scale_dv=scale_dv,
                       cu_seqlens=cu_seqlens, seqused=seqused, _arch=acc.arch)


def _new_output(name: str, partial, num_heads_kv: int, varlen: bool, out_dtype):
    """gqa_reduce's new output for `partial` (None: None; a placeholder for one the op rejects, which it reports)."""
    if not isinstance(partial, torch.Tensor):
        return None if partial is None else torch.empty(0)
    dtype = out_dtype or (partial.dtype if partial.dtype in _HALF_DTYPES else torch.bfloat16)
    if partial.dim() != (3 if varlen else 4):
        return partial.new_empty(0, dtype=dtype)
    h_q = partial.shape[-2]
    if h_q < 1 or h_q % num_heads_kv != 0:
        fail("gqa_reduce", "num_heads_kv", f"a divisor of the {h_q} query heads ({name}.shape[-2])", num_heads_kv)
    return partial.new_empty(tuple(partial.shape[:-2]) + (num_heads_kv, partial.shape[-1]), dtype=dtype)


def gqa_reduce(dk_partial: torch.Tensor, dv_partial: torch.Tensor | None = None, *, num_heads_kv: int,
               cu_seqlens: torch.Tensor | None = None, seqused: torch.Tensor | None = None,
               out: torch.Tensor | tuple | None = None, out_dtype: torch.dtype | None = None,
               scale_dk: float = 1.0, scale_dv: float = 1.0, check_inputs: bool | None = None):
    """dK (and dV) of the KV heads from per-query-head partials in one call: each group of ``num_heads_q /
    num_heads_kv`` heads summed in fp32 in head order (0 + p_0 + ... + p_{g-1}), times the fp32 scale, rounded once.

    Partials: (batch, seqlen, num_heads_q, d), or varlen (total_tokens, num_heads_q, d) with ``cu_seqlens``; fp32, or
    the outputs' bf16/fp16. Outputs: ``out`` (dk, or (dk, dv) when dv_partial is given; num_heads_kv heads), else new
    tensors of ``out_dtype`` (default: the partials' dtype if 16-bit, else bf16) whose rows outside the valid ones
    are uninitialized. Returns dk, or (dk, dv). Runs on an sm_90 GPU;
    ``flash_epilogue.reference.gqa_reduce_reference`` gives the same bits on any device."""
    return _gqa_reduce(dk_partial, dv_partial, num_heads_kv=num_heads_kv, cu_seqlens=cu_seqlens, seqused=seqused,
                       out=out, out_dtype=out_dtype, scale_dk=scale_dk, scale_dv=scale_dv, check_inputs=check_inputs)


def _gqa_reduce(dk_partial, dv_partial=None, *, num_heads_kv, cu_seqlens=None, seqused=None, out=None, out_dtype=None,
                scale_dk=1.0, scale_dv=1.0, check_inputs=None, _arch=0):
    """:func:`gqa_reduce` on the code path `_arch` (see _arch_of)."""
    op = "gqa_reduce"
    if type(num_heads_kv) is not int or num_heads_kv < 1:
        num_heads_kv = as_count(op, "num_heads_kv", num_heads_kv, "a positive int", 1)
    varlen = cu_seqlens is not None
    if out_dtype is not None and out_dtype not in _HALF_DTYPES:
        fail(op, "out_dtype", "None, torch.float16 or torch.bfloat16", out_dtype)
    if out is None:
        dk = _new_output("dk_partial", dk_partial, num_heads_kv, varlen, out_dtype)
        dv = _new_output("dv_partial", dv_partial, num_heads_kv, varlen, out_dtype)
    elif isinstance(out, torch.Tensor) and dv_partial is not None:
        fail(op, "out", "a (dk, dv) pair because dv_partial is given", "a torch.Tensor")
    elif isinstance(out, torch.Tensor) or isinstance(out, (tuple, list)) and len(out) == 2:
        dk, dv = (out, None) if isinstance(out, torch.Tensor) else out
        if isinstance(dk, torch.Tensor) and out_dtype is not None and dk.dtype != out_dtype:
            fail(op, "out_dtype", f"None or {dk.dtype} (the dtype of out)", out_dtype)
        if isinstance(dk, torch.Tensor) and dk.dim() == (3 if varlen else 4) and dk.shape[-2] != num_heads_kv:
            fail(op, "num_heads_kv", f"{dk.shape[-2]} (the heads of out: dk.shape[-2])", num_heads_kv)
    else:
        length = f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""
        fail(op, "out", "None, a tensor (dk) or a (dk, dv) pair", f"a {type(out).__name__}{length}")
    scale_dk = scale_dk if type(scale_dk) is float else as_float(op, "scale_dk", scale_dk)
    scale_dv = scale_dv if type(scale_dv) is float else as_float(op, "scale_dv", scale_dv)
    _extension.call_op(op, check_inputs, dk_partial, dk_partial, dv_partial, dk, dv, cu_seqlens=cu_seqlens,
                       seqused=seqused, scale_dk=scale_dk, scale_dv=scale_dv, _arch=_arch_of(op, _arch))
    return dk if dv_partial is None else (dk, dv)


def repeat_kv(x: torch.Tensor, n_rep: int, dim: int = 1) -> torch.Tensor:
    """``x.repeat_interleave(n_rep, dim)`` of x (batch, kv_heads, seqlen, d) with ``dim=1`` (transformers' repeat_kv) or
    (batch, seqlen, kv_heads, d) with ``dim=2``, differentiable in every torch tool; its backward is the group sum
    in fp32 (or the gradient's wider dtype) in head order, rounded once (gqa_reduce's kernel on an sm_90 GPU, the
    same bits in plain PyTorch elsewhere). Runs on any device."""
    op = "repeat_kv"
    if not isinstance(x, torch.Tensor):
        fail(op, "x", "a torch.Tensor", type(x).__name__, FlashEpilogueTypeError)
    if x.dim() != 4:
        fail(op, "x: rank", "4 dims: (batch, kv_heads, seqlen, head_dim) for dim=1, "
             "(batch, seqlen, kv_heads, head_dim) for dim=2", f"{x.dim()} dims, shape {tuple(x.shape)}")
    n = as_int(op, "n_rep", n_rep, "a positive int")
    if n < 1:
        fail(op, "n_rep", "a positive int", n)
    dim_expected = "1 (or -3) or 2 (or -2): the KV-head dim of a 4-D tensor"
    dim = as_int(op, "dim", dim, dim_expected)
    if dim not in (1, 2, -3, -2):
        fail(op, "dim", dim_expected, dim)
    if n == 1:
        return x
    if _extension._C is None:
        return (_RepeatKvCompiled if torch.compiler.is_compiling() else _RepeatKv).apply(x, n, dim % 4)
    return torch.ops.flash_epilogue.repeat_kv(x, n, dim % 4)


def _expanded(x, n_rep: int, dim: int) -> torch.Tensor:
    """x repeated, a new contiguous tensor, copied before the flatten: under torch.compile, torch 2.11 drops the
    backward of a Function whose output comes out of a no-op .contiguous() (the gradient came back zero)."""
    shape = list(x.shape)
    shape.insert(dim + 1, n_rep)
    return x.unsqueeze(dim + 1).expand(shape).clone(memory_format=torch.contiguous_format).flatten(dim, dim + 1)


def _layout_of(x) -> list[int]:
    """x's first three dims in memory order, outermost first, stably: an insertion sort (traced on symbolic strides)."""
    order = [0]
    for i in (1, 2):
        j = len(order)
        while j > 0 and x.stride(order[j - 1]) < x.stride(i):
            j -= 1
        order.insert(j, i)
    return order


def _gradient_like(grad, n_rep: int, dim: int, layout) -> torch.Tensor:
    """An empty gradient of x (what the op allocates): its dims dense in the order layout + [3]."""
    shape = list(grad.shape)
    shape[dim % 4] //= n_rep
    perm = [int(i) for i in layout] + [3]
    return grad.new_empty([shape[i] for i in perm]).permute([perm.index(i) for i in range(4)])


def _group_sum(grad, n_rep: int, dim: int, layout) -> torch.Tensor:  # the kernels' bits, in x's layout
    return _gradient_like(grad, n_rep, dim, layout).copy_(group_sum_reference(grad, n_rep, dim))


class _RepeatKvCompiled(torch.autograd.Function):
    """Without the extension, under torch.compile (dynamo traces neither a Function's jvp nor a Function applied in a
    backward): the repeat, its backward the group sum. Eager: _RepeatKv, the pair of Functions with their jvps."""

    generate_vmap_rule = True
    forward = staticmethod(_expanded)

    @staticmethod
    def setup_context(ctx, inputs, output):
        # the layout as a string: one pytree leaf for torch.func's generated vmap rule (a list would be three)
        ctx.n_rep, ctx.dim, ctx.layout = inputs[1], inputs[2], "".join(map(str, _layout_of(inputs[0])))

    @staticmethod
    def backward(ctx, grad):
        return _group_sum(grad, ctx.n_rep, ctx.dim, ctx.layout), None, None


class _RepeatKv(_RepeatKvCompiled):
    @staticmethod
    def backward(ctx, grad):
        return _GroupSum.apply(grad, ctx.n_rep, ctx.dim, ctx.layout), None, None

    @staticmethod
    def jvp(ctx, x_t, *_):
        return _expanded(x_t, ctx.n_rep, ctx.dim)


class _GroupSum(torch.autograd.Function):
    generate_vmap_rule = True
    forward = staticmethod(_group_sum)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.n_rep, ctx.dim, ctx.layout = inputs[1:]

    @staticmethod
    def backward(ctx, grad):
        return _RepeatKv.apply(grad, ctx.n_rep, ctx.dim), None, None, None

    @staticmethod
    def jvp(ctx, g_t, *_):
        return _group_sum(g_t, ctx.n_rep, ctx.dim, ctx.layout)


def _fake_of(name: str):
    """The fake kernel of an op that only writes its arguments. A meta tensor among CUDA or CPU ones dispatches here
    too: refused with the op's message, expecting the first CUDA tensor's device, else the first non-meta one's."""
    names = [a.name for a in getattr(torch.ops.flash_epilogue, name).default._schema.arguments]

    def fake(*args, **kwargs) -> None:
        tensors = [(n, t) for n, t in (*zip(names, args), *kwargs.items()) if isinstance(t, torch.Tensor)]
        cuda = [(n, t) for n, t in tensors if t.is_cuda]
        real = [(n, t) for n, t in tensors if not t.is_meta]
        if not (cuda or real):
            return
        ref_name, ref = (cuda or real)[0]
        for n, t in tensors:
            if t.device != ref.device:
                fail(name, f"{n}: device", f"{ref.device} (the device of {ref_name})", t.device)

    return fake


if _extension._C is not None:
    for _name in ("store", "store_zero", "gqa_accumulate", "gqa_postprocess", "gqa_accum_to_dense", "gqa_reduce"):
        torch.library.register_fake(f"flash_epilogue::{_name}")(_fake_of(_name))

    @torch.library.register_fake("flash_epilogue::repeat_kv")
    def _repeat_kv_fake(x, n_rep, dim):
        return x.new_empty([s * n_rep if i == dim % 4 else s for i, s in enumerate(x.shape)])

    torch.library.register_fake("flash_epilogue::repeat_kv_backward")(_gradient_like)

    def _folded(op):
        """The vmap rule of a per-head-group op: the vmapped dim of x (its one tensor) folded into the batch dim."""

        def rule(info, in_dims, x, *rest):
            x = x.movedim(in_dims[0], 0)
            return op(x.flatten(0, 1), *rest).unflatten(0, (x.shape[0], x.shape[1])), 0

        return rule

    for _name in ("repeat_kv", "repeat_kv_backward"):
        torch.library.register_vmap(f"flash_epilogue::{_name}")(_folded(getattr(torch.ops.flash_epilogue, _name)))
