"""Builds vattn._C. Needs a C++17 compiler and pybind11; not torch, not CUDA."""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

SOURCES = [
    "csrc/cuda_vmm/bench_helpers.cpp",
    "csrc/cuda_vmm/bindings.cpp",
    "csrc/cuda_vmm/cuda_backend.cpp",
    "csrc/cuda_vmm/cuda_driver.cpp",
    "csrc/cuda_vmm/cuda_uvm_backend.cpp",
    "csrc/cuda_vmm/host_backend.cpp",
    "csrc/cuda_vmm/page_manager.cpp",
    "csrc/cuda_vmm/vmm_backend.cpp",
]

ext = Pybind11Extension(
    "vattn._C",
    SOURCES,
    include_dirs=["csrc/cuda_vmm", "driver_patch"],  # driver_patch/vattn_uvm_ioctl.h: the patched module's ABI
    cxx_std=17,
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
    libraries=["dl"],  # dlopen of libcuda.so.1 at run time
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
