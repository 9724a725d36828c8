"""Build flash_epilogue: a torch CUDAExtension (ninja) over CUTLASS/CuTe headers.

Environment:
  FLASH_EPILOGUE_SKIP_CUDA_BUILD=1   pure-Python install: the reference functions and repeat_kv in plain torch, no
                                     kernels or ops (the headers are shipped all the same)
  FLASH_EPILOGUE_HEAD_DIMS           ';'-separated tile head dims to build, of 64;96;128;192;256 (default all); a call
                                     needing a tile left out raises an error naming this knob
  FLASH_EPILOGUE_CUDA_ARCHS          ';'-separated gencode archs, default "90a"; "90a;80" adds sm_80 code. Unset,
                                     TORCH_CUDA_ARCH_LIST is honoured ("9.0" meaning sm_90a, "+PTX" ignored). sm_90a
                                     must be among them: the sm_90 kernels are the product
  FLASH_EPILOGUE_CUTLASS_DIR         a CUTLASS checkout (its include/) instead of the nvidia-cutlass wheel's headers
  MAX_JOBS                           parallel compile jobs (torch's BuildExtension reads it)
  CUDA_HOME                          the CUDA toolkit (on the CPU machines: /usr/local/cuda)

Install with `pip install --no-build-isolation .`: the extension must be compiled against the
torch that will import it (the C++ ABI is per torch build), so the build has to see the
installed torch rather than a fresh one in an isolated build environment. Nothing is written into the source tree
but setuptools' build/ folder (and, for an editable install, the built extension beside the package as usual).
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _load(path: str):
    """A module of this repository loaded by path: importing the package would need the build."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_flash_epilogue_" + Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cutlass_include_dirs = _load("flash_epilogue/_cutlass.py").cutlass_include_dirs
ALL_HEAD_DIMS = _load("scripts/generate_instantiations.py").HEAD_DIMS  # the tile head dims (static_switch.h's)
SKIP_CUDA = os.environ.get("FLASH_EPILOGUE_SKIP_CUDA_BUILD", "0") not in ("", "0")


def head_dims() -> list[int]:
    value = os.environ.get("FLASH_EPILOGUE_HEAD_DIMS", "")
    if not value:
        return list(ALL_HEAD_DIMS)
    try:
        dims = sorted({int(d) for d in value.replace(",", ";").split(";") if d.strip()})
    except ValueError:
        dims = []
    if not dims or not set(dims) <= set(ALL_HEAD_DIMS):
        sys.exit(f"FLASH_EPILOGUE_HEAD_DIMS={value!r}: expected a ';'-separated subset of "
                 f"{';'.join(map(str, ALL_HEAD_DIMS))}")
    return dims


def cuda_archs() -> list[str]:
    """FLASH_EPILOGUE_CUDA_ARCHS, else TORCH_CUDA_ARCH_LIST translated, else 90a."""
    ours, torchs = os.environ.get("FLASH_EPILOGUE_CUDA_ARCHS", ""), os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if ours:
        archs, source = [a for a in ours.split(";") if a], "FLASH_EPILOGUE_CUDA_ARCHS"
    elif torchs:
        archs, source = [], "TORCH_CUDA_ARCH_LIST"
        for entry in torchs.replace(",", ";").replace(" ", ";").split(";"):
            entry = entry.strip().removesuffix("+PTX")
            if entry:
                arch = entry.replace(".", "").rstrip("a")
                archs.append("90a" if arch == "90" else arch)
    else:
        return ["90a"]
    if "90a" not in archs:
        sys.exit(f"{source}={ours or torchs!r}: flash_epilogue's kernels need sm_90a; add 90a "
                 "(FLASH_EPILOGUE_CUDA_ARCHS) or 9.0a (TORCH_CUDA_ARCH_LIST)")
    print(f"flash_epilogue: building for {';'.join(archs)} (from {source})")
    return list(dict.fromkeys(archs))


def version() -> str:
    for line in (ROOT / "flash_epilogue" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=")[1].strip().strip('"')
    raise RuntimeError("no __version__ in flash_epilogue/__init__.py")


class BuildPy(build_py):
    """The package, and the collectives' headers inside it (flash_epilogue/include/flash_epilogue), where
    flash_epilogue.get_include() finds them in an installed package."""

    def find_package_modules(self, package, package_dir):
        # _build_info.py is build_ext's output (an editable build leaves one in the checkout): never a source
        return [m for m in super().find_package_modules(package, package_dir) if m[1] != "_build_info"]

    def run(self):
        super().run()
        shutil.copytree(ROOT / "csrc" / "include" / "flash_epilogue",
                        Path(self.build_lib) / "flash_epilogue" / "include" / "flash_epilogue", dirs_exist_ok=True)


ext_modules = []
cmdclass = {"build_py": BuildPy}
if not SKIP_CUDA:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    ARCHS, HEAD_DIMS = cuda_archs(), head_dims()

    class BuildExt(BuildExtension.with_options(use_ninja=True)):
        """The extension, and beside it _build_info.py: the torch and CUDA it was built with, read before loading it
        so that a torch mismatch is reported by name instead of as an undefined symbol (the rest of what the build
        holds, its archs and head dims, the extension itself reports: _C.build_info())."""

        def run(self):
            super().run()
            info = (f"# Generated by setup.py's build_ext; do not edit.\n"
                    f"TORCH_VERSION = {torch.__version__!r}\nCUDA_VERSION = {torch.version.cuda!r}\n")
            for ext in self.extensions:
                Path(self.get_ext_fullpath(ext.name)).with_name("_build_info.py").write_text(info)

    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    defines = ['-DFLASH_EPILOGUE_COMPILED_ARCHS="' + ",".join("sm_" + a for a in ARCHS) + '"',
               *[f"-DFLASH_EPILOGUE_DISABLE_HDIM{d}" for d in ALL_HEAD_DIMS if d not in HEAD_DIMS]]
    nvcc_flags = [
        "-std=c++20",  # the kernels' own standard (the host files take torch's, from BuildExtension)
        "-O3",
        "-DNDEBUG",
        "-lineinfo",
        "--expt-relaxed-constexpr",
        # torch defines these to keep its own half types apart; CUTLASS wants the operators.
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__",
        *gencode,
        *defines,
    ]

    def glob(folder: str, pattern: str) -> list[str]:
        return sorted(str(p.relative_to(ROOT)) for p in (ROOT / folder).glob(pattern))

    # the torch binding (checks, ops, registration), the tile table, the generated instantiations of the head dims
    # built
    instantiations = [f for f in glob("csrc/instantiations", "*.cu") if int(f.split("_hdim")[1].split("_")[0])
                      in HEAD_DIMS]
    sources = [*glob("csrc/binding", "*.cpp"), "csrc/kernels/config_table.cu", *instantiations]
    ext_modules.append(
        CUDAExtension(
            name="flash_epilogue._C",
            sources=sources,
            include_dirs=[str(ROOT / "csrc/include"), str(ROOT / "csrc/kernels"), *cutlass_include_dirs()],
            extra_compile_args={"cxx": ["-O3", *defines], "nvcc": nvcc_flags},
        )
    )
    cmdclass["build_ext"] = BuildExt

setup(
    name="flash_epilogue",
    version=version(),
    packages=find_packages(include=["flash_epilogue", "flash_epilogue.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
