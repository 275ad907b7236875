"""The one compiled part: the trace-slice column scanner (lib/servelab/analyse/trace/_scan.c). Optional: when
no C compiler is there the install still succeeds and the loader decodes every slice with msgspec (slower,
same frame). Everything else about the package is in pyproject.toml."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("servelab.analyse.trace._scan", ["lib/servelab/analyse/trace/_scan.c"],
                             extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra"], optional=True)])
