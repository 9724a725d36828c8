"""Build flash_epilogue: a torch CUDAExtension (ninja) over CUTLASS/CuTe headers.

Environment:
  FLASH_EPILOGUE_SKIP_CUDA_BUILD=1   pure-Python install: the reference functions and repeat_kv in plain torch, no
                                     kernels or ops (the headers are shipped all the same); 1/true/yes/on, or
                                     0/false/no/off/empty to build
  FLASH_EPILOGUE_HEAD_DIMS           ';'-separated tile head dims to build, of 64;96;128;192;256 (default all); a call
                                     needing a tile left out raises an error naming this knob
  FLASH_EPILOGUE_CUDA_ARCHS          ';'-separated gencode archs of 80, 86, 89, 90a (90 means 90a, as
                                     TORCH_CUDA_ARCH_LIST's "9.0" does), default "90a"; "90a;80" adds sm_80 code.
                                     Unset, TORCH_CUDA_ARCH_LIST is honoured ("+PTX" ignored). sm_90a must be among
                                     them: the sm_90 kernels are the product
  FLASH_EPILOGUE_SM80_PATH           the sm_80 code path (FA3's Ampere epilogue): built with an sm_8x arch (the code an
                                     sm_8x GPU runs), else left out (unset or auto); 1/true/yes/on also builds it for
                                     sm_90a, where the tests run it (`_arch=80`; the GPU check sets it); 0/false/no/off
                                     leaves it out (refused beside an sm_8x arch)
  FLASH_EPILOGUE_CUTLASS_DIR         a CUTLASS checkout (its include/) instead of the nvidia-cutlass wheel's headers
  MAX_JOBS                           parallel compile jobs (torch's BuildExtension reads it)
  CUDA_HOME                          the CUDA toolkit; unset, the toolkit of the nvcc on PATH where its headers are,
                                     else /usr/local/cuda. Its nvcc's CUDA major must be torch's

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


def flag(name: str, auto: bool = False) -> bool | None:
    """An on/off knob, strictly: a value that is neither is refused, listing both. With ``auto``, unset or "auto" is
    None (the caller decides), and the refusal lists it too."""
    value = os.environ.get(name, "")
    if auto and value.strip().lower() in ("", "auto"):
        return None
    if value.strip().lower() in ("", "0", "false", "no", "off"):
        return False
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    sys.exit(f"{name}={value!r}: expected 1, true, yes or on (set), or 0, false, no, off or empty (unset)"
             + (", or auto" if auto else ""))


SKIP_CUDA = flag("FLASH_EPILOGUE_SKIP_CUDA_BUILD")
ARCHS_KNOWN = ("80", "86", "89", "90a")  # the gencode archs the kernels compile for


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
    """FLASH_EPILOGUE_CUDA_ARCHS, else TORCH_CUDA_ARCH_LIST, else 90a; 9.0 and 90 mean 90a (the kernels use its
    instructions) in both spellings."""
    ours, torchs = os.environ.get("FLASH_EPILOGUE_CUDA_ARCHS", ""), os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if ours:
        entries, source = ours.split(";"), "FLASH_EPILOGUE_CUDA_ARCHS"
    elif torchs:
        entries, source = torchs.replace(",", ";").replace(" ", ";").split(";"), "TORCH_CUDA_ARCH_LIST"
        entries = [e.strip().removesuffix("+PTX").replace(".", "") for e in entries]
    else:
        return ["90a"]
    archs = ["90a" if e.strip() in ("90", "90a") else e.strip() for e in entries if e.strip()]
    unknown = [a for a in archs if a not in ARCHS_KNOWN]
    if unknown or not archs:
        sys.exit(f"{source}={ours or torchs!r}: expected ';'-separated archs of {', '.join(ARCHS_KNOWN)} "
                 f"(TORCH_CUDA_ARCH_LIST: 8.0, 8.6, 8.9, 9.0 or 9.0a), got {', '.join(unknown) or 'none'}")
    if "90a" not in archs:
        sys.exit(f"{source}={ours or torchs!r}: flash_epilogue's kernels need sm_90a; add 90a "
                 "(FLASH_EPILOGUE_CUDA_ARCHS) or 9.0a (TORCH_CUDA_ARCH_LIST)")
    return list(dict.fromkeys(archs))


def sm80_path(archs: list[str]) -> bool:
    """Whether the build compiles the sm_80 code path (FLASH_EPILOGUE_SM80_PATH; unset or auto: with an sm_8x arch)."""
    ampere = [a for a in archs if a.startswith("8")]
    wanted = flag("FLASH_EPILOGUE_SM80_PATH", auto=True)
    if wanted is None:
        return bool(ampere)
    if not wanted and ampere:
        sys.exit(f"FLASH_EPILOGUE_SM80_PATH={os.environ['FLASH_EPILOGUE_SM80_PATH']!r} beside "
                 f"sm_{', sm_'.join(ampere)} in the archs: those GPUs run the sm_80 path; leave it unset (auto) or set "
                 "it on, or build for 90a alone")
    return wanted


def cuda_home() -> Path:
    """The CUDA toolkit (flash_epilogue/_toolkit.py), or a stop naming CUDA_HOME."""
    try:
        return _load("flash_epilogue/_toolkit.py").cuda_home()
    except RuntimeError as e:
        sys.exit(str(e))


def check_cuda_major(home: Path) -> None:
    """nvcc's CUDA major must be torch's: an extension built with another does not load."""
    import re
    import subprocess

    import torch

    out = subprocess.run([str(home / "bin" / "nvcc"), "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\d+\.\d+)", out)
    nvcc_cuda = found.group(1) if found else "unknown"
    if not torch.version.cuda:
        sys.exit(f"torch {torch.__version__} is a CPU-only build: install a CUDA {nvcc_cuda} build of torch "
                 "(https://pytorch.org/get-started/locally/), or set FLASH_EPILOGUE_SKIP_CUDA_BUILD=1 for the "
                 "pure-Python install")
    if nvcc_cuda.split(".")[0] != torch.version.cuda.split(".")[0]:
        sys.exit(f"{home}/bin/nvcc is CUDA {nvcc_cuda} but torch was built with CUDA {torch.version.cuda}: the "
                 f"extension must be built with torch's CUDA major. Point CUDA_HOME at a CUDA "
                 f"{torch.version.cuda.split('.')[0]}.x toolkit, or install a torch built for CUDA "
                 f"{nvcc_cuda.split('.')[0]} (https://pytorch.org/get-started/locally/)")


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
    ARCHS, HEAD_DIMS = cuda_archs(), head_dims()
    SM80_PATH = sm80_path(ARCHS)
    CUDA_HOME = cuda_home()
    check_cuda_major(CUDA_HOME)
    import torch
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    class BuildExt(BuildExtension.with_options(use_ninja=True)):
        """The extension, and beside it _build_info.py: the torch and CUDA it was built with, read before loading it
        so that a torch mismatch is reported by name instead of as an undefined symbol (the rest of what the build
        holds, its archs and head dims, the extension itself reports: _C.build_info())."""

        def run(self):
            units = sum(len(ext.sources) for ext in self.extensions)
            jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
            parallel = min(int(jobs), os.cpu_count() or 1) if jobs.isdigit() and int(jobs) > 0 else 1
            minutes = max(1, round(units * 20 / 60 / parallel))  # about 20 s a unit on one core
            paths = "sm_90 and sm_80" if SM80_PATH else "sm_90"
            print(f"flash_epilogue: building {units} units (head dims {';'.join(map(str, HEAD_DIMS))}, archs "
                  f"{';'.join(ARCHS)}, code paths {paths}) with {jobs} jobs and {CUDA_HOME}/bin/nvcc: about "
                  f"{minutes} min", flush=True)
            super().run()
            info = (f"# Generated by setup.py's build_ext; do not edit.\n"
                    f"TORCH_VERSION = {torch.__version__!r}\nCUDA_VERSION = {torch.version.cuda!r}\n")
            for ext in self.extensions:
                Path(self.get_ext_fullpath(ext.name)).with_name("_build_info.py").write_text(info)

    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    defines = ['-DFLASH_EPILOGUE_COMPILED_ARCHS="' + ",".join("sm_" + a for a in ARCHS) + '"',
               *[f"-DFLASH_EPILOGUE_DISABLE_HDIM{d}" for d in ALL_HEAD_DIMS if d not in HEAD_DIMS],
               *([] if SM80_PATH else ["-DFLASH_EPILOGUE_NO_SM80_PATH"])]
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
    # and code paths built
    instantiations = [f for f in glob("csrc/instantiations", "*.cu") if int(f.split("_hdim")[1].split("_")[0])
                      in HEAD_DIMS and (SM80_PATH or not f.endswith("_sm80.cu"))]
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
    package_data={"flash_epilogue": ["schema.inc"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
