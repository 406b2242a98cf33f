"""Read a tensor's address, dtype, shape, strides and device through the DLPack protocol, no copy.

`describe(obj)` asks `obj.__dlpack_device__()` and `obj.__dlpack__(...)` for an unversioned
"dltensor" capsule and reads the `DLManagedTensor` it points to with ctypes (dlpack.h v0.8
layout, unchanged in v1.x for the unversioned struct). The capsule is NOT consumed: it is left
named "dltensor", so when it is garbage-collected its destructor calls the producer's deleter. The
memory stays valid as long as the producer object does; the binding keeps that object alive.

Stream argument: CUDA producers get `stream=-1` ("do not synchronize"): binding records addresses
only, it orders no work. CPU producers (numpy) must get `stream=None`.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED = 1, 2, 3, 13
DEVICE_NAMES = {KDL_CPU: "cpu", KDL_CUDA: "cuda", KDL_CUDA_HOST: "cuda_host",
                KDL_CUDA_MANAGED: "cuda_managed"}

# (type code, bits) -> dtype name; lanes must be 1. Codes: dlpack.h DLDataTypeCode.
DTYPE_NAMES = {(0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
               (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
               (2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
               (4, 16): "bfloat16", (6, 8): "bool"}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                            ("deleter", DELETER)]

_CAPSULE_NAME = b"dltensor"
_api = ctypes.pythonapi
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def device_name(device_type: int, device_id: int) -> str:
    """'cuda:0', 'cpu:0', ... as error messages print a DLPack device."""
    return f"{DEVICE_NAMES.get(device_type, f'dl{device_type}')}:{device_id}"


class DLPackError(TypeError):
    """An object is not a usable DLPack producer; the message names the bound tensor."""


@dataclass(frozen=True)
class TensorView:
    """What DLPack says about one tensor. `strides` are in elements, None when compact."""

    address: int                 # data + byte_offset
    device_type: int
    device_id: int
    dtype: str                   # a DTYPE_NAMES value, or "code=C bits=B lanes=L" when unknown
    itemsize: int
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None

    @property
    def device(self) -> str:
        return device_name(self.device_type, self.device_id)

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n

    def is_compact(self) -> bool:
        """Row-major contiguous (strides of size-1 dimensions do not matter)."""
        if self.strides is None:
            return True
        expected = 1
        for dim, stride in zip(reversed(self.shape), reversed(self.strides)):
            if dim != 1 and stride != expected:
                return False
            expected *= dim
        return True


def describe(obj, name: str) -> TensorView:
    """The DLPack view of `obj`; DLPackError naming `name` if obj is not a DLPack producer."""
    if not hasattr(obj, "__dlpack__") or not hasattr(obj, "__dlpack_device__"):
        raise DLPackError(f"bind: tensor {name!r} ({type(obj).__name__}) is not a DLPack "
                          f"producer (needs __dlpack__ and __dlpack_device__)")
    try:
        device_type, _device_id = obj.__dlpack_device__()
        stream = None if int(device_type) == KDL_CPU else -1
        capsule = obj.__dlpack__(stream=stream)
    except (BufferError, TypeError, ValueError, RuntimeError) as exc:
        raise DLPackError(f"bind: tensor {name!r} ({type(obj).__name__}) refused DLPack "
                          f"export: {type(exc).__name__}: {exc}") from None
    if not _api.PyCapsule_IsValid(capsule, _CAPSULE_NAME):
        raise DLPackError(f"bind: tensor {name!r}: __dlpack__ did not return an unused "
                          f"'dltensor' capsule (got {type(capsule).__name__})")
    managed = DLManagedTensor.from_address(_api.PyCapsule_GetPointer(capsule, _CAPSULE_NAME))
    t = managed.dl_tensor
    ndim = int(t.ndim)
    shape = tuple(int(t.shape[i]) for i in range(ndim))
    strides = tuple(int(t.strides[i]) for i in range(ndim)) if t.strides else None
    code, bits, lanes = int(t.dtype.code), int(t.dtype.bits), int(t.dtype.lanes)
    dtype = DTYPE_NAMES.get((code, bits)) if lanes == 1 else None
    view = TensorView(address=int(t.data or 0) + int(t.byte_offset),
                      device_type=int(t.device.device_type), device_id=int(t.device.device_id),
                      dtype=dtype or f"code={code} bits={bits} lanes={lanes}",
                      itemsize=max(1, bits * lanes // 8), shape=shape, strides=strides)
    del capsule  # its destructor runs the producer's deleter; obj keeps the memory alive
    return view
