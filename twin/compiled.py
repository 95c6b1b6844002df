"""The optional compiled modules (issue 14), loaded in one place: `twin._recordsc` (the
records' per-request work, twin/_recordsc.pyx) and `twin._loopc` (the scheduler loop's
decode pass, twin/_loopc.pyx). Each has a Python specification that runs where the module
is not built (no C compiler at install) or when `SERVETWIN_PURE_PYTHON` is set; the bytes
written are the same either way."""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def load(name: str, what: str) -> tuple[ModuleType | None, str | None]:
    """`twin.<name>` and None, or None and why the Python code runs instead."""
    if os.environ.get("SERVETWIN_PURE_PYTHON"):
        return None, "SERVETWIN_PURE_PYTHON is set"
    try:
        return importlib.import_module(f"twin.{name}"), None
    except ImportError as exc:
        return None, (f"the compiled {what} is not built ({exc}); "
                      "reinstall with a C compiler (pip install -e .) for speed")
