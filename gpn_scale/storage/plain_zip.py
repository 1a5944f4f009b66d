"""Is a file one plain zip archive, as `torch.save` writes it, that every zip reader reads alike?

Zip readers disagree about archives that are not laid out plainly: Python's `zipfile` finds the
central directory from its size counted back from the end record, torch's reader (miniz) from the
offset the end record states; bytes before the first member, after the end record, or between
members can hold a second archive that one reader sees and the other does not. A file that one
reader sees as benign tensors and the other as a pickle that runs code must never reach a loader.

So a checkpoint file must be exactly what torch's writer produces, every byte accounted for:

    member 1: local header (name, 'FB' alignment padding in its extra field), data, data descriptor
    member 2: ...
    central directory: one entry per member, in one run
    zip64 end record, zip64 locator (torch always writes them), end record (no comment), end of file

The members tile the file from byte 0 to the central directory without gaps or overlaps, each local
header agrees with its central-directory entry (name, flags, method, CRC and sizes where stated), the
central directory ends where the end records begin, the end records agree with each other, names
are unique, and data is stored (torch never compresses). Only the headers are read: the cost does
not grow with the tensors. This guards the container only; what the pickle inside may do is
decided by torch's restricted unpickler (`gpn_scale.storage.safe_load`).
"""

from __future__ import annotations

import struct
from pathlib import Path

_LOCAL, _CENTRAL, _DESCRIPTOR = b"PK\x03\x04", b"PK\x01\x02", b"PK\x07\x08"
_END, _END64, _LOCATOR64 = b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07"
_END_SIZE, _LOCATOR64_SIZE, _END64_SIZE = 22, 20, 56
_LOCAL_SIZE, _CENTRAL_SIZE = 30, 46
_U16, _U32 = 0xFFFF, 0xFFFFFFFF
_FLAGS = 0x0808  # the only flag bits torch sets: data descriptor (3) and UTF-8 names (11)
_ZIP64_EXTRA, _PADDING_EXTRA = 0x0001, 0x4246  # zip64 sizes and offsets; torch's 'FB' alignment padding


class NotPlain(Exception):
    """Why a file is not one plain zip archive."""


def problem(path: str | Path) -> str | None:
    """None when `path` is one plain zip archive as torch writes it, else why not, in a few words."""
    try:
        with open(path, "rb") as f:
            _check(f, Path(path).stat().st_size)
    except NotPlain as e:
        return str(e)
    return None


def _read(f, offset: int, n: int) -> bytes:
    f.seek(offset)
    data = f.read(n)
    if len(data) != n:
        raise NotPlain(f"a record at byte {offset} runs past the end of the file")
    return data


def _check(f, size: int) -> None:
    if size < _LOCAL_SIZE + _END_SIZE or _read(f, 0, 4) != _LOCAL:
        raise NotPlain("not a zip archive (torch's checkpoints are; this one does not start with a member)")
    count, cd_size, cd_offset, cd_end = _end_records(f, size)
    entries = _central_directory(f, count, cd_offset, cd_size)
    if cd_offset + cd_size != cd_end:
        raise NotPlain(f"the central directory ({cd_size} bytes at {cd_offset}) does not end where the end records begin "
                       f"(byte {cd_end}): bytes between them, or a second directory")
    _members(f, entries, cd_offset)


def _end_records(f, size: int) -> tuple[int, int, int, int]:
    """(members, central directory size, its offset, where it must end) from the end records."""
    end = size - _END_SIZE
    sig, disk, cd_disk, here, count, cd_size, cd_offset, comment = struct.unpack("<4sHHHHIIH", _read(f, end, _END_SIZE))
    if sig != _END:
        raise NotPlain("the file does not end with a zip end record (trailing data, a comment, or a truncated file)")
    if comment:
        raise NotPlain("the end record has a comment (torch writes none)")
    if disk or cd_disk or here != count:
        raise NotPlain("the end record describes a multi-disk archive")
    locator = end - _LOCATOR64_SIZE
    if locator < 0 or _read(f, locator, 4) != _LOCATOR64:
        if _U16 in (here, count) or _U32 in (cd_size, cd_offset):
            raise NotPlain("the end record defers to zip64 records that are not there")
        return count, cd_size, cd_offset, end
    _, z_disk, z_offset, disks = struct.unpack("<4sIQI", _read(f, locator, _LOCATOR64_SIZE))
    if z_disk or disks != 1:
        raise NotPlain("the zip64 locator describes a multi-disk archive")
    if z_offset + _END64_SIZE != locator:
        raise NotPlain(f"the zip64 end record (at byte {z_offset}) is not right before its locator: bytes between them")
    sig64, record, _, _, d64, cd_d64, here64, count64, cd_size64, cd_offset64 = struct.unpack(
        "<4sQHHIIQQQQ", _read(f, z_offset, _END64_SIZE))
    if sig64 != _END64 or record != _END64_SIZE - 12:
        raise NotPlain("the zip64 locator does not point at a plain zip64 end record")
    if d64 or cd_d64 or here64 != count64:
        raise NotPlain("the zip64 end record describes a multi-disk archive")
    for name, short, full, saturated in (("member count", count, count64, _U16), ("directory size", cd_size, cd_size64, _U32),
                                         ("directory offset", cd_offset, cd_offset64, _U32)):
        if short != full and short != saturated:
            raise NotPlain(f"the end record and the zip64 end record disagree on the {name} ({short} vs {full})")
    return count64, cd_size64, cd_offset64, z_offset


def _extras(data: bytes, allowed: tuple[int, ...], where: str) -> dict[int, bytes]:
    """The extra fields of a header, each id once and of an allowed kind, filling it exactly."""
    fields, i = {}, 0
    while i < len(data):
        if i + 4 > len(data):
            raise NotPlain(f"{where}: a truncated extra field")
        kind, n = struct.unpack_from("<HH", data, i)
        if kind not in allowed or kind in fields or i + 4 + n > len(data):
            raise NotPlain(f"{where}: an unexpected, repeated or overlong extra field (id {kind:#06x})")
        fields[kind] = data[i + 4:i + 4 + n]
        i += 4 + n
    return fields


def _central_directory(f, count: int, offset: int, size: int) -> list[dict]:
    entries, names, pos, end = [], set(), offset, offset + size
    for _ in range(count):
        if pos + _CENTRAL_SIZE > end:
            raise NotPlain("the central directory is shorter than the member count says")
        (sig, _, _, flags, method, _, _, crc, csize, usize, n_name, n_extra, n_comment, disk, _, _,
         header) = struct.unpack("<4sHHHHHHIIIHHHHHII", _read(f, pos, _CENTRAL_SIZE))
        if sig != _CENTRAL:
            raise NotPlain(f"the central directory holds something else at byte {pos}")
        name = _read(f, pos + _CENTRAL_SIZE, n_name)
        where = f"member {name.decode('utf-8', 'replace')!r}"
        extras = _extras(_read(f, pos + _CENTRAL_SIZE + n_name, n_extra), (_ZIP64_EXTRA,), where)
        if flags & ~_FLAGS or method != 0 or n_comment or disk:
            raise NotPlain(f"{where}: compressed, encrypted, commented or on another disk (torch stores members plainly)")
        if name in names:
            raise NotPlain(f"{where} appears twice")
        names.add(name)
        zip64 = extras.get(_ZIP64_EXTRA, b"")
        usize, zip64 = _wide(usize, zip64, where)
        csize, zip64 = _wide(csize, zip64, where)
        header, zip64 = _wide(header, zip64, where)
        if zip64:
            raise NotPlain(f"{where}: its zip64 field holds more than the sizes and offset it stands for")
        if csize != usize:
            raise NotPlain(f"{where}: stored, yet its compressed and uncompressed sizes differ")
        entries.append({"name": name, "where": where, "flags": flags, "crc": crc, "size": csize, "header": header})
        pos += _CENTRAL_SIZE + n_name + n_extra
    if pos != end:
        raise NotPlain("the central directory holds more than its members")
    return entries


def _wide(value: int, zip64: bytes, where: str) -> tuple[int, bytes]:
    """A 32-bit field, or its 64-bit value from the zip64 extra field when it is saturated."""
    if value != _U32:
        return value, zip64
    if len(zip64) < 8:
        raise NotPlain(f"{where}: a saturated size or offset without its zip64 value")
    return struct.unpack_from("<Q", zip64)[0], zip64[8:]


def _members(f, entries: list[dict], cd_offset: int) -> None:
    """Each member's local header, data and descriptor, in file order, tiling [0, cd_offset)."""
    entries = sorted(entries, key=lambda e: e["header"])
    expected = 0
    for i, e in enumerate(entries):
        where = e["where"]
        if e["header"] != expected:
            raise NotPlain(f"{where} starts at byte {e['header']}, the previous member ends at {expected}: "
                           "bytes between members, or members that overlap")
        (sig, _, flags, method, _, _, crc, csize, usize, n_name, n_extra) = struct.unpack(
            "<4sHHHHHIIIHH", _read(f, expected, _LOCAL_SIZE))
        name = _read(f, expected + _LOCAL_SIZE, n_name)
        if sig != _LOCAL or name != e["name"]:
            raise NotPlain(f"{where}: its local header is missing or names another member")
        _extras(_read(f, expected + _LOCAL_SIZE + n_name, n_extra), (_ZIP64_EXTRA, _PADDING_EXTRA), where)
        if flags != e["flags"] or method != 0:
            raise NotPlain(f"{where}: its local header and directory entry disagree on its flags or method")
        described = bool(flags & 0x08)  # CRC and sizes follow the data
        if crc not in ((0, e["crc"]) if described else (e["crc"],)) or any(
                s not in ((0, e["size"], _U32) if described else (e["size"], _U32)) for s in (csize, usize)):
            raise NotPlain(f"{where}: its local header and directory entry disagree on its CRC or size")
        data_end = expected + _LOCAL_SIZE + n_name + n_extra + e["size"]
        following = entries[i + 1]["header"] if i + 1 < len(entries) else cd_offset
        expected = data_end + (_descriptor(f, e, data_end, following - data_end) if described else 0)
    if expected != cd_offset:
        raise NotPlain(f"the members end at byte {expected}, the central directory starts at {cd_offset}: "
                       "bytes between them, or members that overlap it")


def _descriptor(f, e: dict, at: int, room: int) -> int:
    """The length of the data descriptor after a member's data (16 bytes, or 24 with 64-bit sizes):
    the one that fills the room up to the next record and repeats the directory's CRC and size."""
    for n, fmt in ((16, "<4sIII"), (24, "<4sIQQ")):
        if room == n:
            sig, crc, csize, usize = struct.unpack(fmt, _read(f, at, n))
            if sig == _DESCRIPTOR and crc == e["crc"] and csize == usize == e["size"]:
                return n
    raise NotPlain(f"{e['where']}: no data descriptor that agrees with its directory entry right after its data")
