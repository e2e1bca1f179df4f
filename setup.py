"""Build of the native extension ``osd_kernels._C``.

C++ CPU kernels are always built. CUDA kernels are added when the installed torch has
CUDA and nvcc is found; ``OSD_SKIP_CUDA=1`` skips them. Sources are picked up by glob, so
adding an op means its schema line in ``csrc/ops.cpp`` and its files under ``csrc/``:

    csrc/ops.cpp                every schema (TORCH_LIBRARY); csrc/module.cpp: the Python module
    csrc/<op>_checks.h          argument checks shared by the CPU and CUDA implementations
    csrc/kernels/<op>.h|.cu     torch-free kernels (also compiled alone by ``make cuda-check``)
    csrc/cpu/<op>.cpp           C++ CPU kernel (TORCH_LIBRARY_IMPL CPU)
    csrc/cuda/<op>.cpp          CUDA launch glue (TORCH_LIBRARY_IMPL CUDA)
"""

import glob
import os

from setuptools import setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def _with_cuda() -> bool:
    if os.environ.get("OSD_SKIP_CUDA", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def _extension():
    here = os.path.dirname(os.path.abspath(__file__))
    include = [os.path.join(here, "csrc")]
    sources = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
    cxx = ["-O3", "-fopenmp", "-std=c++20"]
    if _with_cuda():
        sources += sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/kernels/*.cu"))
        nvcc = ["-O3", "-std=c++17", "-lineinfo"]
        return CUDAExtension(
            "osd_kernels._C",
            sources,
            include_dirs=include,
            define_macros=[("OSD_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx + ["-DOSD_WITH_CUDA=1"], "nvcc": nvcc},
            extra_link_args=["-fopenmp"],
        )
    return CppExtension(
        "osd_kernels._C",
        sources,
        include_dirs=include,
        extra_compile_args={"cxx": cxx},
        extra_link_args=["-fopenmp"],
    )


setup(
    ext_modules=[_extension()], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)}
)
