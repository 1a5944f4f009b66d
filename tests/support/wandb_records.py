"""Reads the history rows of an offline wandb run file (`run-*.wandb`).

The file is a 7-byte header followed by a LevelDB-style log: 32 KiB blocks of records, each with
a 7-byte header (crc32, little-endian length, type: 1 full, 2 first, 3 middle, 4 last) and a
serialized `wandb.proto.wandb_internal_pb2.Record` as payload.
"""

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024


def _payloads(data: bytes):
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < 7:
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
        else:  # zero padding at the end of a block
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0


def history(path: Path) -> list[dict]:
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for payload in _payloads(Path(path).read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows
