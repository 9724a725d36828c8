"""`python -m flash_epilogue.info`: what this install is and what it can run here."""
from __future__ import annotations

import torch

from . import __version__, _extension


def info() -> dict:
    build = _extension._build_info
    d = {
        "flash_epilogue": __version__,
        "kernels": "available" if _extension._C is not None else f"unavailable: {_extension.UNAVAILABLE_REASON}",
        "built_with_torch": getattr(build, "TORCH_VERSION", None),
        "built_with_cuda": getattr(build, "CUDA_VERSION", None),
        "compiled_archs": list(_extension.compiled_archs()),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": None,
        "compute_capability": None,
    }
    if _extension._C is not None:
        d["build_info"] = dict(_extension._C.build_info())
        d["compiled_configs"] = [dict(c) for c in _extension._C.compiled_configs()]
        d["tile_configs"] = [dict(c) for c in _extension._C.tile_configs()]
    if torch.cuda.is_available():
        d["device"] = torch.cuda.get_device_name()
        major, minor = torch.cuda.get_device_capability()
        d["compute_capability"] = f"sm_{major}{minor}"
    return d


def main() -> None:
    d = info()
    configs = d.pop("compiled_configs", [])
    tiles = d.pop("tile_configs", [])
    d.pop("build_info", None)
    width = max(len(k) for k in d)
    for k, v in d.items():
        print(f"{k:<{width}}  {v}")
    if tiles:
        print("\ntile configs (the C++ table): arch path, head_dim -> kBlockN, threads, swapAB, atom_layout_n, "
              "GQA accumulator floats per tile")
        for c in tiles:
            print(f"  sm_{c['arch']} {c['head_dim']:>3} -> {c['block_n']:>3}, {c['num_threads']}, {c['swap_ab']!s:5}, "
                  f"{c['atom_layout_n']}, {c['accum_tile_elems']}")
    if configs:
        ops = sorted({c["op"] for c in configs})
        print(f"\ncompiled kernels: {len(configs)} ({', '.join(ops)}; "
              f"dtypes {sorted({c['dtype'] for c in configs})}; head dims {sorted({c['head_dim'] for c in configs})})")


if __name__ == "__main__":
    main()
