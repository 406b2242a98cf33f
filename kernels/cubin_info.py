"""Read what the build must check from a kernel's PTX and cubin, with no CUDA tool installed.

PTX gives the `.entry` symbol, the parameter list (the launch ABI), `.reqntid`, whether dynamic
shared memory is declared and the `griddepcontrol` instructions. The cubin (an NVIDIA ELF) gives
what ptxas decided: registers (EIATTR_REGCOUNT), the stack frame (EIATTR_FRAME_SIZE, where every
spill lands), the required block (EIATTR_REQNTID) and the parameter sizes (EIATTR_KPARAM_INFO).
Parsing the ELF ourselves works on any CI box; `cuobjdump`/`nvdisasm` are not always installed.
Exact spill-store/load byte counts come from ptxas' own log when the build captured it
(`parse_ptxas_log`); the cubin alone bounds them by the frame size.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass

EM_CUDA = 190
SHT_CUDA_INFO = 0x70000000
# .nv.info attribute ids (the cuobjdump names) and formats
EIATTR_FRAME_SIZE = 0x11
EIATTR_MIN_STACK_SIZE = 0x12
EIATTR_KPARAM_INFO = 0x17
EIATTR_MAX_STACK_SIZE = 0x23
EIATTR_REGCOUNT = 0x2F
EIATTR_REQNTID = 0x10
EIFMT_NVAL, EIFMT_BVAL, EIFMT_HVAL, EIFMT_SVAL = 1, 2, 3, 4
PTX_PARAM_TYPES = {"u64": "u64", "u32": "u32", "s32": "u32", "b32": "u32", "f32": "f32"}
ABI_TO_PTX = {"u64": "u64", "u32": "u32", "i32": "u32", "f32": "f32"}  # Int32 is .u32 in PTX


class KernelBinaryError(ValueError):
    """A PTX or cubin that is not what the build expects (named kernel, what was found)."""


@dataclass(frozen=True)
class PtxInfo:
    target: str
    entry: str
    params: tuple[str, ...]          # PTX types in order: "u64" | "u32" | "f32"
    reqntid: tuple[int, int, int] | None
    dynamic_smem: bool
    pdl_wait: bool
    pdl_trigger: bool


@dataclass(frozen=True)
class CubinInfo:
    sm: int
    abi_version: int
    registers: int
    frame_bytes: int                 # stack frame = local memory per thread (spills land here)
    stack_bytes: int
    reqntid: tuple[int, int, int] | None
    param_sizes: tuple[int, ...]     # bytes per parameter, in ordinal order


def parse_ptx(ptx: str, name: str) -> PtxInfo:
    """The single `.entry` of a kernel's PTX; raises KernelBinaryError naming `name` otherwise."""
    target = re.search(r"^\s*\.target\s+(\S+)", ptx, re.MULTILINE)
    entries = re.findall(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.DOTALL)
    if len(entries) != 1:
        raise KernelBinaryError(f"{name}: expected one .entry in the PTX, found {len(entries)}")
    entry, plist = entries[0]
    params = []
    for decl in filter(None, (p.strip() for p in plist.split(","))):
        m = re.match(r"\.param\s+\.(\w+)\b", decl)
        if not m or m.group(1) not in PTX_PARAM_TYPES:
            raise KernelBinaryError(
                f"{name}: PTX parameter {decl!r} is not a pointer-ABI scalar (.u64/.u32/.f32); "
                "a cute.Tensor argument becomes a .b8 struct - pass cute.Pointer and Int32/Float32")
        params.append(PTX_PARAM_TYPES[m.group(1)])
    ntid = re.search(r"\.reqntid\s+(\d+)\s*,\s*(\d+)\s*,\s*(\d+)", ptx)
    return PtxInfo(
        target=target.group(1).rstrip(",") if target else "",
        entry=entry,
        params=tuple(params),
        reqntid=tuple(int(v) for v in ntid.groups()) if ntid else None,
        dynamic_smem=bool(re.search(r"\.extern\s+\.shared", ptx)),
        pdl_wait="griddepcontrol.wait" in ptx,
        pdl_trigger="griddepcontrol.launch_dependents" in ptx,
    )


def _sections(blob: bytes):
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = raw[shstrndx][4]

    def name_at(off: int) -> str:
        end = blob.index(b"\0", strtab_off + off)
        return blob[strtab_off + off:end].decode()

    return [(name_at(s[0]), s[1], blob[s[4]:s[4] + s[5]], s[6], s[7]) for s in raw]


def _symbols(sections) -> dict[int, str]:
    """Symbol index -> name, from .symtab and its string table."""
    for _, typ, data, link, _ in sections:
        if typ == 2:  # SHT_SYMTAB
            strtab = sections[link][2]
            out = {}
            for i in range(len(data) // 24):
                name_off, = struct.unpack_from("<I", data, i * 24)
                out[i] = strtab[name_off:strtab.index(b"\0", name_off)].decode()
            return out
    return {}


def _attributes(data: bytes):
    """(attr, payload) records of one .nv.info section."""
    pos = 0
    while pos + 2 <= len(data):
        fmt, attr = data[pos], data[pos + 1]
        if fmt == EIFMT_SVAL:
            size, = struct.unpack_from("<H", data, pos + 2)
            yield attr, data[pos + 4:pos + 4 + size]
            pos += 4 + size
        elif fmt == EIFMT_HVAL:
            yield attr, data[pos + 2:pos + 4]
            pos += 4
        elif fmt == EIFMT_BVAL:
            yield attr, data[pos + 2:pos + 3]
            pos += 3
        else:
            yield attr, b""
            pos += 2


def parse_cubin(blob: bytes, entry: str, name: str) -> CubinInfo:
    """Resources of `entry` in a cubin; raises KernelBinaryError naming `name` if it is not one."""
    if blob[:4] != b"\x7fELF" or blob[4] != 2:
        raise KernelBinaryError(f"{name}: cubin is not a 64-bit ELF file")
    machine, = struct.unpack_from("<H", blob, 0x12)
    if machine != EM_CUDA:
        raise KernelBinaryError(f"{name}: ELF machine {machine}, expected {EM_CUDA} (NVIDIA CUDA)")
    abi_version = blob[8]
    flags, = struct.unpack_from("<I", blob, 0x30)
    sm = flags & 0xFF if abi_version < 8 else (flags >> 8) & 0xFF   # CUDA 12 vs CUDA 13 layout
    sections = _sections(blob)
    symbols = _symbols(sections)
    values: dict[int, int] = {}
    reqntid, kparams = None, {}
    for sec_name, typ, data, _, _ in sections:
        if typ != SHT_CUDA_INFO:
            continue
        for attr, payload in _attributes(data):
            if sec_name == ".nv.info" and len(payload) == 8:      # (symbol index, value) records
                sym, value = struct.unpack("<II", payload)
                if symbols.get(sym) == entry:
                    values[attr] = value
            elif sec_name == f".nv.info.{entry}":
                if attr == EIATTR_REQNTID and len(payload) == 12:
                    reqntid = struct.unpack("<III", payload)
                elif attr == EIATTR_KPARAM_INFO and len(payload) == 12:
                    _, ordinal, _, packed = struct.unpack("<IHHI", payload)
                    kparams[ordinal] = (packed >> 18) & 0x3FFF
    if EIATTR_REGCOUNT not in values:
        raise KernelBinaryError(f"{name}: cubin has no register count for entry {entry!r}")
    return CubinInfo(
        sm=sm, abi_version=abi_version, registers=values[EIATTR_REGCOUNT],
        frame_bytes=values.get(EIATTR_FRAME_SIZE, 0),
        stack_bytes=max(values.get(EIATTR_MIN_STACK_SIZE, 0), values.get(EIATTR_MAX_STACK_SIZE, 0)),
        reqntid=reqntid, param_sizes=tuple(kparams[i] for i in sorted(kparams)))


def parse_ptxas_log(log: str, entry: str) -> dict[str, int] | None:
    """Spill and register numbers of `entry` from a `ptxas -v` log, or None if it is not there."""
    block = log.split(f"Function properties for {entry}", 1)
    if len(block) != 2:
        return None
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                  block[1])
    regs = re.search(r"Used (\d+) registers", block[1])
    if not m:
        return None
    out = {"frame_bytes": int(m.group(1)), "spill_stores": int(m.group(2)),
           "spill_loads": int(m.group(3))}
    if regs:
        out["registers"] = int(regs.group(1))
    return out
