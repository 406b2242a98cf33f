"""NCCL communicator on nccl4py: created from a unique id or split from a caller's ncclComm_t.

    uid = NcclComm.unique_id()                          # rank 0; the caller sends the 128 bytes
    comm = NcclComm.from_unique_id(uid, rank, world)    # collective over the ranks
    comm = NcclComm.split_from(vllm_comm_ptr, rank)     # or: a private split of the caller's comm
    comm.all_reduce(send, recv, count, "bf16", stream)  # one low-level binding call (~0.5 us)
    comm.close()

The hot path calls `nccl.bindings.nccl.all_reduce` with integers only (the high-level
`Communicator.allreduce` re-resolves its buffers per call: 13-21 us of host time). It is
graph-capturable: NCCL records its kernels into the capturing stream.

NVLink SHARP / multicast stays off: `require_nvls_disabled()` sets NCCL_NVLS_ENABLE=0 when it is
unset and refuses any other value, before NCCL reads its environment (at the first communicator
or unique id of the process).
"""
from __future__ import annotations

import os

NVLS_VARIABLE = "NCCL_NVLS_ENABLE"
DTYPES = {"bf16": 9, "f32": 7, "u8": 1}           # ncclBfloat16, ncclFloat32, ncclUint8
DTYPE_BYTES = {"bf16": 2, "f32": 4, "u8": 1}
SUM = 0                                           # ncclSum


class NcclError(RuntimeError):
    """An NCCL call failed: which call, on which rank, and NCCL's message."""


def require_nvls_disabled() -> None:
    """Project rule: NCCL_NVLS_ENABLE=0 (no NVLink multicast). Set it if unset; raise otherwise."""
    value = os.environ.get(NVLS_VARIABLE)
    if value is None:
        os.environ[NVLS_VARIABLE] = "0"
    elif value.strip() != "0":
        raise NcclError(f"{NVLS_VARIABLE}={value!r}: hopdec never uses NVLink SHARP/multicast; "
                        f"unset it or set it to 0")


def _bindings():
    from nccl.bindings import nccl as nb
    return nb


def _call(what: str, fn, *args):
    """Run one nccl4py call, turning its exception into NcclError naming the call."""
    try:
        return fn(*args)
    except Exception as exc:  # nccl4py raises NCCLError or NcclInvalid
        raise NcclError(f"{what} failed: {type(exc).__name__}: {exc}") from exc


def check_count(count: int, dtype: str, who: str = "all_reduce") -> int:
    if dtype not in DTYPES:
        raise ValueError(f"{who}: dtype {dtype!r}, expected one of {sorted(DTYPES)}")
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise ValueError(f"{who}: count must be a positive int, got {count!r}")
    return count


class NcclComm:
    """An NCCL communicator this object owns (created or split here), destroyed by close()."""

    def __init__(self, communicator, rank: int, world: int):
        self._communicator = communicator           # nccl.core.Communicator (owned)
        self._comm = communicator._comm             # binding object the low-level calls take
        self.rank = rank
        self.world = world
        self._all_reduce = _bindings().all_reduce

    @staticmethod
    def unique_id() -> bytes:
        """A fresh 128-byte ncclUniqueId; keep this process alive until every rank has joined."""
        require_nvls_disabled()
        import nccl.core as nccl
        return bytes(_call("ncclGetUniqueId", nccl.get_unique_id))

    @classmethod
    def from_unique_id(cls, uid: bytes, rank: int, world: int) -> NcclComm:
        """ncclCommInitRank on the current device (collective over all `world` ranks)."""
        require_nvls_disabled()
        if not isinstance(uid, (bytes, bytearray)) or len(uid) != 128:
            raise ValueError(f"NCCL unique id must be 128 bytes, got {type(uid).__name__} "
                             f"of {len(uid) if hasattr(uid, '__len__') else '?'}")
        if not (isinstance(world, int) and world >= 1 and isinstance(rank, int)
                and 0 <= rank < world):
            raise ValueError(f"NCCL: rank {rank!r} of world {world!r} is not a valid pair")
        import nccl.core as nccl
        comm = _call(f"ncclCommInitRank(rank {rank} of {world})", nccl.Communicator.init,
                     world, rank, nccl.UniqueId.from_bytes(bytes(uid)))
        return cls(comm, rank, world)

    @classmethod
    def split_from(cls, comm_ptr: int, key: int, color: int = 0) -> NcclComm:
        """ncclCommSplit of a caller-owned ncclComm_t (e.g. vLLM's TP comm): a private comm, so
        our collective sequence stays independent of the caller's. Collective on the parent;
        the parent is wrapped, never destroyed."""
        require_nvls_disabled()
        if isinstance(comm_ptr, bool) or not isinstance(comm_ptr, int) or comm_ptr <= 0:
            raise ValueError(f"NCCL split: parent ncclComm_t must be a non-null int, "
                             f"got {comm_ptr!r}")
        import nccl.core as nccl
        parent = nccl.Communicator(ptr=comm_ptr)
        child = _call("ncclCommSplit", parent.split, color, key)
        return cls(child, child.rank, child.nranks)

    @property
    def ptr(self) -> int:
        """The owned ncclComm_t as an int (0 once closed)."""
        return int(self._comm.handle) if self._comm is not None else 0

    def all_reduce(self, send: int, recv: int, count: int, dtype: str, stream: int) -> None:
        """Sum `count` elements of `dtype` over the ranks into recv (may equal send), on stream.

        Hot path: integers in, one binding call; `count`/`dtype` are validated by
        `check_count` where a plan is built, not here."""
        try:
            self._all_reduce(send, recv, count, DTYPES[dtype], SUM, self._comm, stream)
        except Exception as exc:
            raise NcclError(f"ncclAllReduce(rank {self.rank}, {count} x {dtype}) failed: "
                            f"{exc}") from exc

    def all_reduce_rows(self, send: int, recv: int, rows: int, width: int, dtype: str,
                        stream: int) -> None:
        """all_reduce of a [rows, width] matrix, validated (setup paths and tests)."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"all_reduce_rows: rows must be a positive int, got {rows!r}")
        self.all_reduce(send, recv, check_count(rows * width, dtype), dtype, stream)

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's equal-length payload, in rank order (set-up only: allocates, syncs).
        The exchange function for `collectives.ipc.PeerBuffers`."""
        import numpy as np

        from executor.cuda import check, driver
        cu = driver()
        n = len(payload)
        if n == 0:
            raise ValueError("all_gather_bytes: empty payload")
        send = check(cu.cuMemAlloc(n))
        recv = check(cu.cuMemAlloc(n * self.world))
        try:
            check(cu.cuMemcpyHtoD(send, payload, n))
            _call("ncclAllGather", _bindings().all_gather, int(send), int(recv), n, DTYPES["u8"],
                  self._comm, 0)
            check(cu.cuCtxSynchronize())
            out = np.empty(n * self.world, np.uint8)
            check(cu.cuMemcpyDtoH(out, recv, n * self.world))
        finally:
            check(cu.cuMemFree(send))
            check(cu.cuMemFree(recv))
        return [out[i * n:(i + 1) * n].tobytes() for i in range(self.world)]

    def close(self) -> None:
        """ncclCommDestroy (collective on intra-node peers; idempotent)."""
        if self._communicator is not None:
            _call("ncclCommDestroy", self._communicator.destroy)
            self._communicator = None
            self._comm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
