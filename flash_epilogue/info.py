"""`python -m flash_epilogue.info`: what this install is and what it can run here."""
import torch

from . import __version__, _extension


def info() -> dict:
    C, build, cuda = _extension._C, _extension._build_info, torch.cuda.is_available()
    d = {
        "flash_epilogue": __version__,
        "kernels": "available" if C is not None else f"unavailable: {_extension.UNAVAILABLE_REASON}",
        "built_with_torch": getattr(build, "TORCH_VERSION", None),
        "built_with_cuda": getattr(build, "CUDA_VERSION", None),
        "compiled_archs": list(_extension.compiled_archs()),
        "code_paths": list(_extension.code_paths()),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if cuda else None,
        "compute_capability": "sm_{}{}".format(*torch.cuda.get_device_capability()) if cuda else None,
    }
    if C is not None:
        d.update(build_info=dict(C.build_info()), compiled_configs=[dict(c) for c in C.compiled_configs()],
                 tile_configs=[dict(c) for c in C.tile_configs()])
    return d


def main() -> None:
    d = info()
    configs, tiles, _ = d.pop("compiled_configs", []), d.pop("tile_configs", []), d.pop("build_info", None)
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
        print(f"\ncompiled kernels: {len(configs)} ({', '.join(sorted({c['op'] for c in configs}))}; "
              f"dtypes {sorted({c['dtype'] for c in configs})}; head dims {sorted({c['head_dim'] for c in configs})})")


if __name__ == "__main__":
    main()
