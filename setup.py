"""The optional compiled parts of servetwin (issue 14): twin/_recordsc.pyx, the records'
per-request work, and twin/_loopc.pyx, the scheduler loop's decode pass (twin/compiled.py
loads them). Everything else is in pyproject.toml.

Cython comes from PyPI as a build requirement (pyproject.toml). The extension is optional:
where it cannot be built (no C compiler, a failed compile), the install still succeeds,
and the Python code writes the same records, more slowly (`servetwin simulate` says so).
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing: setuptools' `optional=True` lets a
    missing compiler executable through as an error."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any failure leaves the Python code
            self.warn(f"servetwin: the compiled modules were not built ({exc}); "
                      "the Python code gives the same results, more slowly")


try:
    from Cython.Build import cythonize
except ImportError:  # a build without the PEP 517 requirements: the Python code only
    ext_modules = []
else:
    try:
        ext_modules = cythonize(
            [Extension("twin._recordsc", ["twin/_recordsc.pyx"]),
             # the loop's floats in the source's order: no fused multiply-adds
             Extension("twin._loopc", ["twin/_loopc.pyx"],
                       extra_compile_args=["-ffp-contract=off"]),
             Extension("twin._corec", ["twin/_corec.pyx"],
                       extra_compile_args=["-ffp-contract=off"])],
            compiler_directives={"language_level": 3}, quiet=True)
    except Exception as exc:  # noqa: BLE001 - a Cython that rejects the source: Python only
        print(f"servetwin: the compiled modules were not translated ({exc}); the Python "
              "code gives the same results, more slowly", file=sys.stderr)
        ext_modules = []

setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
