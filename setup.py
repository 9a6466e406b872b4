"""The optional compiled build (mypyc), beside pyproject.toml, which holds everything else.

    KVROUTE_COMPILE=1 pip install .       # compiles the modules listed in src/kvroute/buildinfo.py
    make compiled                         # the same into build/compiled, for this checkout (README)

Without KVROUTE_COMPILE this adds nothing: the package is pure Python, as always. The build asks
for the mypy that the dev extra pins (mypyc ships inside mypy) and pydantic (its mypy plugin) in its
isolated build environment.
Editable installs refuse to compile: a compiled module built in place beside its .py would be
loaded instead of the source being edited.
"""

import os
import runpy
import tomllib

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def _compiler_requires() -> list[str]:
    """The dev extra's mypy (the compiler is the checker's version) and pydantic, whose mypy plugin
    pyproject.toml's [tool.mypy] loads — both as pyproject.toml pins them."""
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    return [next(r for r in project["optional-dependencies"]["dev"] if r.startswith("mypy==")),
            next(r for r in project["dependencies"] if r.startswith("pydantic"))]


class NotInPlace(build_ext):
    """Refuses in-place builds: an editable install keeps the source tree pure Python."""

    def run(self) -> None:
        if self.inplace or getattr(self, "editable_mode", False):
            raise SystemExit("KVROUTE_COMPILE=1 does not build in place (editable install): a compiled module "
                             "beside its .py would shadow the source; use `make compiled` (README)")
        super().run()


kw: dict = {}
if os.environ.get("KVROUTE_COMPILE", "") not in ("", "0"):
    try:
        from mypyc.build import mypycify
    except ImportError:  # first pass of an isolated build: ask for mypy, then setup.py runs again
        kw["setup_requires"] = _compiler_requires()
    else:
        info = runpy.run_path(os.path.join(HERE, "src", "kvroute", "buildinfo.py"))
        # a build folder of its own: a later pure `pip install .` must never pick up a compiled
        # module left in the shared build/lib* (`make clean` removes both); tests set their own
        base = os.environ.get("KVROUTE_COMPILE_BUILD") or os.path.join("build", "mypyc")
        kw["ext_modules"] = mypycify([info["module_path"](n) for n in info["COMPILED"]],
                                     opt_level=os.environ.get("KVROUTE_COMPILE_OPT", "3"),
                                     target_dir=os.path.join(base, "c"))
        kw["cmdclass"] = {"build_ext": NotInPlace}
        kw["options"] = {"build": {"build_base": base}}

setup(**kw)
