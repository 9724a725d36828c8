"""Op schemas of torch.ops.flash_epilogue.*, as csrc/bindings.cpp registers them.

The C++ extension defines the ops (TORCH_LIBRARY). When it is absent (a pure-Python install,
FLASH_EPILOGUE_SKIP_CUDA_BUILD=1) or cannot load, the same schemas are defined here with
kernels that raise FlashEpilogueBuildError, so code that calls or traces the ops still resolves
them. tests/test_schemas.py checks both definitions agree.
"""
from __future__ import annotations

import torch

LIBRARY = "flash_epilogue"

# `_arch` (0 = the device's own path) forces the sm_80 code path (ArchTag Sm80 collectives and
# tile configs) on an sm_90 GPU: a testing knob, not part of the public API.
SCHEMAS = {
    "store": "store(Tensor dk_accum, Tensor dv_accum, Tensor(a!) dk, Tensor(b!) dv, *, "
    "Tensor? cu_seqlens=None, Tensor? seqused=None, int _arch=0) -> ()",
    "store_zero": "store_zero(Tensor(a!) dk, Tensor(b!) dv, *, Tensor? cu_seqlens=None, Tensor? seqused=None, "
    "Tensor? batch_idx=None, Tensor? head_idx=None, int row_start=0, int? row_end=None, int _arch=0) -> ()",
    # GQA. Accumulators are fp32 (batch_extent, h_k, num_tiles, tile_elems) in the fragment order of
    # the dK/dV TiledMma (opaque); semaphores are an int32 workspace, zeroed by the op itself.
    "gqa_accumulate": "gqa_accumulate(Tensor dk_partial, Tensor dv_partial, Tensor(a!) dk_accum, Tensor(b!) dv_accum, "
    "Tensor(c!)? semaphores=None, *, Tensor? cu_seqlens=None, Tensor? seqused=None, bool deterministic=False, "
    "int _arch=0) -> ()",
    "gqa_postprocess": "gqa_postprocess(Tensor dk_accum, Tensor dv_accum, Tensor(a!) dk, Tensor(b!) dv, *, "
    "float scale_dk=1.0, float scale_dv=1.0, Tensor? cu_seqlens=None, Tensor? seqused=None, int _arch=0) -> ()",
    "gqa_accum_to_dense": "gqa_accum_to_dense(Tensor accum, Tensor(a!) out, *, int head_dim, Tensor? cu_seqlens=None, "
    "Tensor? seqused=None, int _arch=0) -> ()",
    "gqa_reduce": "gqa_reduce(Tensor dk_partial, Tensor? dv_partial, Tensor(a!) dk, Tensor(b!)? dv, *, "
    "Tensor? cu_seqlens=None, Tensor? seqused=None, float scale_dk=1.0, float scale_dv=1.0, int _arch=0) -> ()",
    # autograd: transformers' repeat_kv and its group-sum backward (x's gradient allocated with its
    # first three dims in memory in the order `layout`)
    "repeat_kv": "repeat_kv(Tensor x, int n_rep, int dim) -> Tensor",
    "repeat_kv_backward": "repeat_kv_backward(Tensor grad, int n_rep, int dim, int[] layout) -> Tensor",
}

# Ops that work without the kernels (plain PyTorch): without the extension, repeat_kv.py defines
# them with kernels of their own rather than with the raising ones below.
PYTHON_FALLBACK_OPS = ("repeat_kv", "repeat_kv_backward")

_fallback_library = None


def define_fallback_ops(reason: str) -> None:
    """Define every schema but PYTHON_FALLBACK_OPS with CPU/CUDA kernels that raise a clear error
    naming `reason`."""
    global _fallback_library
    if _fallback_library is not None:
        return
    from .validation import FlashEpilogueBuildError

    lib = torch.library.Library(LIBRARY, "DEF")
    for name, schema in SCHEMAS.items():
        if name in PYTHON_FALLBACK_OPS:
            continue
        lib.define(schema)

        def unavailable(*args, _name=name, **kwargs):
            raise FlashEpilogueBuildError(f"flash_epilogue.{_name}: the CUDA kernels are not available: {reason}")

        for key in ("CPU", "CUDA"):
            lib.impl(name, unavailable, key)
    _fallback_library = lib
