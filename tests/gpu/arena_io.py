"""Host arrays through one device Arena around one kernel launch: the GPU tests' upload, launch,
download helper."""
from __future__ import annotations

import numpy as np

from executor.runtime import Arena


def launch_on_arrays(dev, stream, arrays: dict, launch) -> dict:
    """Upload `arrays` (name -> host array, each its own arena slice of at least 16 bytes) into one
    arena, launch `launch(ptrs)` on `stream` (ptrs: name -> device address) and wait for it, and
    return every slice back as numpy in its array's dtype and shape."""
    import cupy as cp  # lazily: collecting the GPU tests needs no CuPy
    with Arena(dev, [(n, max(a.nbytes, 16)) for n, a in arrays.items()]) as arena:
        for name, a in arrays.items():
            raw = np.ascontiguousarray(a).view(np.uint8).ravel()
            arena.view(name, np.uint8, (raw.size,))[...] = cp.asarray(raw)
        cp.cuda.Device().synchronize()
        launch({n: arena.ptr(n) for n in arrays}).launch(stream)
        stream.synchronize()
        return {n: cp.asnumpy(arena.view(n, np.uint8, (a.nbytes,))).view(a.dtype).reshape(a.shape)
                for n, a in arrays.items()}
