"""Import-time shims that let SGLang 0.5.23 run on a CPU-only machine.

This file is copied verbatim into the harness virtualenv's site-packages as
`servetwin_cpu_shim.py`, and a `.pth` file there calls `activate()` at interpreter
start-up, so it runs in every process of that venv, including the scheduler and
detokenizer processes that SGLang spawns. It does nothing unless the environment
variable `SERVETWIN_CPU_HARNESS=1` is set, so the venv stays an ordinary Python
environment otherwise.

Two problems are solved, both found on these machines (see docs/cpu-harness.md):

* PyPI's torchvision 0.28.0 is a CUDA build; on the CPU torch its import fails with
  `operator torchvision::nms does not exist`. Defining the schemas of
  `torchvision::nms` and `torchvision::qnms` before torchvision's first import makes
  it import. We do that lazily, from a meta-path hook on `torchvision`, so processes
  that never import torchvision do not pay for importing torch.
* With `SGLANG_USE_CPU_ENGINE=1`, SGLang imports `sgl_kernel` unconditionally and no
  CPU build of it is on PyPI. On a CPU without Intel AMX SGLang takes plain-torch
  paths, so a placeholder module whose attributes are inert dummies is enough.

Standard library only at import time: this runs before anything else in the venv.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

ENV_SWITCH = "SERVETWIN_CPU_HARNESS"
PLACEHOLDER_ROOT = "sgl_kernel"

_TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor",
)
_torchvision_library = None  # keeps the schema definitions alive for the process


def activate() -> None:
    """Install both shims if the harness switch is on; otherwise do nothing."""
    if os.environ.get(ENV_SWITCH) != "1":
        return
    if any(isinstance(f, (_TorchvisionHook, _PlaceholderFinder)) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchvisionHook())
    sys.meta_path.append(_PlaceholderFinder())


def define_torchvision_schemas() -> None:
    """Define `torchvision::nms` and `torchvision::qnms` unless torch already has them."""
    global _torchvision_library
    if _torchvision_library is not None:
        return
    import torch

    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _TORCHVISION_SCHEMAS:
        name = schema.split("(", 1)[0]
        if not _has_op(torch, name):
            library.define(schema)
    _torchvision_library = library


def _has_op(torch: types.ModuleType, name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
    except RuntimeError:
        return False
    return True


class _TorchvisionHook(importlib.abc.MetaPathFinder):
    """Runs `define_torchvision_schemas()` just before torchvision is first imported.

    It finds nothing itself: it returns None so the normal finders load torchvision.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            define_torchvision_schemas()
        return None


class _Dummy:
    """An inert stand-in: callable, subscriptable, and every attribute is another dummy."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Dummy:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Dummy(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs) -> _Dummy:
        return _Dummy(f"{self._name}()")

    def __getitem__(self, key) -> _Dummy:
        return _Dummy(f"{self._name}[]")

    def __repr__(self) -> str:
        return f"<servetwin placeholder {self._name}>"


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Dummy:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Dummy(f"{self.__name__}.{attr}")


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `sgl_kernel` and all its submodules as placeholder packages.

    Appended to the end of `sys.meta_path`, so a real `sgl_kernel`, if one is ever
    installed, wins.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname != PLACEHOLDER_ROOT and not fullname.startswith(PLACEHOLDER_ROOT + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+servetwin.placeholder"
        return module

    def exec_module(self, module) -> None:
        return None
