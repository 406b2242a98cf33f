"""Peer buffers over legacy CUDA IPC: one allocation per rank, handles exchanged once, opened once.

    peers = PeerBuffers(rank, world, nbytes, exchange, fill_u16=0x8000)
    peers.ptrs            # (base of rank 0's buffer, ..., base of rank world-1's), as mapped here
    ...
    peers.close()         # close the peers' mappings, then free our own buffer

`exchange(payload: bytes) -> list[bytes]` is the caller's all-gather: it is called with the same
kind of payload on every rank and returns every rank's payload in rank order. It can be an NCCL
all-gather (`collectives.nccl.NcclComm.all_gather_bytes`), the test launcher's pipe, or a CPU
group. It is called twice: the 64-byte IPC handles (plus the buffer size, so a rank with another
size is refused), then an "opened" vote, so that one rank's failed mapping fails every rank.

The buffer is filled BEFORE the handle exchange (optionally with a 16-bit pattern, e.g. the
one-shot all-reduce's -0.0 sentinel), and the exchange is an all-gather, so no peer can write into
it before it is initialised. Set-up only: nothing here runs inside a step or a capture.
"""
from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Sequence

from executor.cuda import CudaError, check, driver

HANDLE_BYTES = 64
_HEADER = struct.Struct("<iiQ")          # rank, world, nbytes
PAYLOAD_BYTES = _HEADER.size + HANDLE_BYTES
VOTE_BYTES = 256

Exchange = Callable[[bytes], Sequence[bytes]]


class PeerSetupError(RuntimeError):
    """The peer-buffer exchange failed on this rank or on another one; nothing is left mapped."""


def pack_handle(rank: int, world: int, nbytes: int, handle: bytes) -> bytes:
    if len(handle) != HANDLE_BYTES:
        raise ValueError(f"CUDA IPC handle must be {HANDLE_BYTES} bytes, got {len(handle)}")
    return _HEADER.pack(rank, world, nbytes) + handle


def unpack_handles(payloads: Sequence[bytes], rank: int, world: int, nbytes: int) -> list[bytes]:
    """Validate every rank's payload (size, rank order, same world and buffer size)."""
    if len(payloads) != world:
        raise PeerSetupError(f"rank {rank}: the exchange returned {len(payloads)} payloads for a "
                             f"world of {world}")
    handles = []
    for src, payload in enumerate(payloads):
        if not isinstance(payload, (bytes, bytearray)) or len(payload) != PAYLOAD_BYTES:
            raise PeerSetupError(f"rank {rank}: payload from rank {src} is not a "
                                 f"{PAYLOAD_BYTES}-byte IPC record")
        r, w, n = _HEADER.unpack_from(payload)
        if (r, w, n) != (src, world, nbytes):
            raise PeerSetupError(f"rank {rank}: payload #{src} says rank {r} of world {w} with a "
                                 f"{n}-byte buffer; expected rank {src} of {world}, {nbytes} B")
        handles.append(bytes(payload[_HEADER.size:]))
    return handles


def _vote_payload(ok: bool, why: str) -> bytes:
    """Fixed length: an NCCL all-gather needs the same count on every rank."""
    mine = b"ok" if ok else b"fail: " + why.encode()[:VOTE_BYTES - 6]
    return mine.ljust(VOTE_BYTES, b"\0")


def _vote(exchange: Exchange, rank: int, ok: bool, why: str) -> None:
    """Every rank learns whether every rank succeeded; the failures are named on all of them."""
    answers = [bytes(a).rstrip(b"\0") for a in exchange(_vote_payload(ok, why))]
    bad = {src: a for src, a in enumerate(answers) if a != b"ok"}
    if bad:
        detail = "; ".join(f"rank {src}: {a.decode(errors='replace')}" for src, a in bad.items())
        raise PeerSetupError(f"rank {rank}: peer-buffer set-up failed ({detail})")


class PeerBuffers:
    """This rank's IPC-exportable buffer and every peer's, mapped into this process."""

    def __init__(self, rank: int, world: int, nbytes: int, exchange: Exchange,
                 fill_u16: int | None = None):
        if not (isinstance(world, int) and world >= 1 and isinstance(rank, int)
                and 0 <= rank < world):
            raise ValueError(f"peer buffers: rank {rank!r} of world {world!r} is not a valid pair")
        if not isinstance(nbytes, int) or nbytes <= 0 or nbytes % 16:
            raise ValueError(f"peer buffers: nbytes must be a positive multiple of 16, "
                             f"got {nbytes!r}")
        cu = driver()
        self.rank, self.world, self.nbytes = rank, world, nbytes
        self._own = check(cu.cuMemAlloc(nbytes))
        self._opened: list = []
        self.ptrs: tuple[int, ...] = ()
        ptrs: list[int] = []
        try:
            if fill_u16 is not None:
                check(cu.cuMemsetD16(self._own, fill_u16, nbytes // 2))
            check(cu.cuCtxSynchronize())          # filled before any peer can see the handle
            handle = check(cu.cuIpcGetMemHandle(self._own))
            raw = ctypes.string_at(handle.getPtr(), HANDLE_BYTES)
            handles = unpack_handles(exchange(pack_handle(rank, world, nbytes, raw)),
                                     rank, world, nbytes)
            ptrs, why = self._open_all(handles)
            _vote(exchange, rank, not why, why)
        except BaseException:
            self.close()
            raise
        self.ptrs = tuple(ptrs)

    def _open_all(self, handles: list[bytes]) -> tuple[list[int], str]:
        cu = driver()
        flags = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.value
        ptrs = []
        for src, raw in enumerate(handles):
            if src == self.rank:
                ptrs.append(int(self._own))
                continue
            handle = cu.CUipcMemHandle()
            ctypes.memmove(handle.getPtr(), raw, HANDLE_BYTES)
            try:
                mapped = check(cu.cuIpcOpenMemHandle(handle, flags),
                               call=f"cuIpcOpenMemHandle[rank {src}'s buffer]")
            except CudaError as exc:
                return ptrs, str(exc)
            self._opened.append(mapped)
            ptrs.append(int(mapped))
        return ptrs, ""

    @property
    def own(self) -> int:
        return int(self._own) if self._own is not None else 0

    def close(self) -> None:
        """Close every peer mapping, then free our buffer (idempotent). Peers must have stopped
        using our buffer: close after a final synchronizing exchange or at process exit."""
        cu = driver()
        while self._opened:
            check(cu.cuIpcCloseMemHandle(self._opened.pop()))
        if self._own is not None:
            check(cu.cuMemFree(self._own))
            self._own = None
        self.ptrs = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
