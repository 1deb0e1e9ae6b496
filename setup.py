"""Builds the optional CPU kernel (aadl_func/_src/_dots.c) when the package is installed.

The kernel is plain C loaded with ctypes (aadl_func/_src/native.py), not a Python module. It
is an optional extension: without a working compiler the build only warns, the package still
installs, and aadl_func uses its torch path (the same values). The kernel is built with OpenMP
where the compiler supports it, else single-threaded. Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError

OPENMP = ["-fopenmp"]


class BuildKernel(build_ext):
    def build_extension(self, ext: Extension) -> None:
        ext.extra_compile_args += OPENMP
        ext.extra_link_args += OPENMP
        try:
            super().build_extension(ext)
            return
        except CCompilerError as error:  # e.g. a compiler without OpenMP: build it without
            self.warn(f"building {ext.name} with OpenMP failed ({error}); trying without")
        ext.extra_compile_args = [a for a in ext.extra_compile_args if a not in OPENMP]
        ext.extra_link_args = [a for a in ext.extra_link_args if a not in OPENMP]
        super().build_extension(ext)


setup(
    ext_modules=[
        Extension(
            "aadl_func._src._dots",
            sources=["aadl_func/_src/_dots.c"],
            # Python's CFLAGS come first; -fno-wrapv undoes their -fwrapv, which changes the
            # loop code (with it the machine code is that of a plain `cc -O3` build).
            extra_compile_args=["-O3", "-std=c11", "-fno-wrapv"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildKernel},
)
