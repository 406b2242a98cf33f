"""Checked CUDA driver calls: `check(cu.cuXxx(...))` returns the values or raises `CudaError`.

cuda.bindings returns `(CUresult, *values)` from every driver call. `check` strips the result code
and raises `CudaError(call, code, meaning)` when it is not CUDA_SUCCESS. The call's name is read
from the caller's source line only on failure (the success path costs one comparison); pass
`call=` where the source line does not name it.

cuda.bindings is imported lazily (`driver()`), so CPU-only code imports this module without it.
"""
from __future__ import annotations

import linecache
import re
import sys

_CALL_RE = re.compile(r"\b(cu[A-Z][A-Za-z0-9_]*)\s*\(")
_driver = None


def driver():
    """The cuda.bindings driver module, imported on first use."""
    global _driver
    if _driver is None:
        from cuda.bindings import driver as cu
        _driver = cu
    return _driver


class CudaError(RuntimeError):
    """A CUDA driver call failed: which call, which CUresult, and what the driver says it means."""

    def __init__(self, call: str, code, meaning: str):
        self.call = call
        self.code = code
        self.code_name = getattr(code, "name", None) or f"CUresult({int(code)})"
        self.meaning = meaning
        super().__init__(f"{call} failed: {self.code_name} ({int(code)}): {meaning}")


def describe(code) -> tuple[str, str]:
    """(name, meaning) of a CUresult, asking the driver; falls back to the enum name."""
    name = getattr(code, "name", None) or f"CUresult({int(code)})"
    try:
        cu = driver()
        err, text = cu.cuGetErrorString(code)
        if err == cu.CUresult.CUDA_SUCCESS and text:
            return name, text.decode() if isinstance(text, bytes) else str(text)
    except Exception as exc:  # noqa: BLE001 - no driver to ask: say so instead of hiding the error
        return name, f"(no description: the driver could not be asked: {type(exc).__name__})"
    return name, "(the driver has no description for this code)"


def _caller_call_name(depth: int) -> str:
    frame = sys._getframe(depth + 1)
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    found = _CALL_RE.findall(line)
    if found:
        return found[0]
    return f"CUDA call at {frame.f_code.co_filename}:{frame.f_lineno}"


def check(result, call: str | None = None):
    """Unpack a cuda.bindings result tuple: None, the single value, or a tuple of values.

    Raises CudaError naming the call (given, or read from the caller's source line), the
    CUresult name and the driver's description.
    """
    if isinstance(result, tuple):
        code, values = result[0], result[1:]
    else:
        code, values = result, ()
    if code != 0:  # CUresult is an int enum; CUDA_SUCCESS == 0
        name = call or _caller_call_name(1)
        _, meaning = describe(code)
        raise CudaError(name, code, meaning)
    if not values:
        return None
    return values[0] if len(values) == 1 else values
