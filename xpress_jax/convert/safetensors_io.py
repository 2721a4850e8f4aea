"""A strict safetensors reader and writer (numpy + ml_dtypes; no torch, no safetensors package).

Format: an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
(``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``), then the data
section. `SafetensorsFile` validates the whole header on open, as the reference library does:
sizes match ``prod(shape) * itemsize`` and the tensors cover the data section exactly (no holes,
overlaps, trailing or missing bytes). Tensors are read on request, in chunks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np

from .errors import ConversionError

__all__ = ["SAFETENSORS_DTYPES", "SafetensorsError", "SafetensorsFile", "TensorInfo", "load_file", "save_file"]

#: safetensors dtype code -> numpy dtype (little-endian).
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_CODE_OF = {dt: code for code, dt in SAFETENSORS_DTYPES.items()}
# Codes of the format without a numpy spelling here: listed, refused when read.
_UNREADABLE = {"F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "C64"}
_MAX_HEADER = 100 * 1024 * 1024  # the reference library's limit
_CHUNK = 8 * 1024 * 1024


class SafetensorsError(ConversionError):
    """A truncated, corrupt or unsupported safetensors file."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One header entry: dtype code, shape and absolute byte range in the file."""

    name: str
    code: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_header(fail: Callable[[str], SafetensorsError], raw: bytes, start: int, data_len: int):
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise fail(f"header is not UTF-8 ({e})") from None
    except json.JSONDecodeError as e:
        raise fail(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise fail(f"header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise fail("__metadata__ must be an object")
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        where = f"tensor {name!r}"
        if not isinstance(entry, dict):
            raise fail(f"{where}: entry must be an object, got {type(entry).__name__}")
        code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if code not in SAFETENSORS_DTYPES and code not in _UNREADABLE:
            raise fail(f"{where}: unknown dtype {code!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise fail(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))
                and 0 <= offsets[0] <= offsets[1]):
            raise fail(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
        begin, end = offsets
        if code in SAFETENSORS_DTYPES and end - begin != (want := math.prod(shape) * SAFETENSORS_DTYPES[code].itemsize):
            raise fail(f"{where}: {code}{tuple(shape)} needs {want} bytes but data_offsets span {end - begin}")
        if end > data_len:
            raise fail(f"{where} ends at byte {end} of the data section, but only {data_len} bytes are present "
                       "(the file is truncated)")
        infos[name] = TensorInfo(name, code, tuple(shape), start + begin, start + end)
    pos = 0
    for info in sorted(infos.values(), key=lambda i: (i.begin, i.end)):
        begin = info.begin - start
        if begin != pos:
            what = "overlaps the previous tensor" if begin < pos else f"leaves a hole of {begin - pos} bytes"
            raise fail(f"tensor {info.name!r} starts at data byte {begin}: it {what}")
        pos = info.end - start
    if pos != data_len:
        raise fail(f"the tensors cover {pos} bytes of the data section, but it has {data_len} (trailing bytes)")
    return infos, metadata


class SafetensorsFile:
    """Header of one safetensors file, validated on open; tensors read with `get`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

        def fail(msg: str) -> SafetensorsError:
            return SafetensorsError(f"{self.path}: not a valid safetensors file: {msg}")

        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise fail(f"file is {size} bytes, too short for the 8-byte header length")
                (n,) = struct.unpack("<Q", head)
                if n == 0 or n > _MAX_HEADER:
                    raise fail(f"header length {n} is out of range (1 .. {_MAX_HEADER})")
                if 8 + n > size:
                    raise fail(f"header length {n} runs past the end of the {size}-byte file (truncated)")
                raw = f.read(n)
        except OSError as e:
            raise SafetensorsError(f"{self.path}: cannot read: {e}") from None
        self.data_start = 8 + n
        self.tensors, self.metadata = _parse_header(fail, raw, self.data_start, size - self.data_start)

    def get(self, key: str) -> np.ndarray:
        """One tensor as a fresh numpy array."""
        info = self.tensors[key]
        if info.code not in SAFETENSORS_DTYPES:
            raise SafetensorsError(f"{self.path}: tensor {key!r} has dtype {info.code}, which cannot be read here")
        out = np.empty(info.shape, dtype=SAFETENSORS_DTYPES[info.code])
        buf = memoryview(out.reshape(-1).view(np.uint8))
        try:
            with open(self.path, "rb") as f:
                f.seek(info.begin)
                pos = 0
                while pos < info.nbytes:
                    got = f.readinto(buf[pos : min(pos + _CHUNK, info.nbytes)])
                    if not got:
                        raise SafetensorsError(f"{self.path}: tensor {key!r}: unexpected end of file")
                    pos += got
        except OSError as e:
            raise SafetensorsError(f"{self.path}: cannot read tensor {key!r}: {e}") from None
        return out


def load_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as numpy arrays."""
    f = SafetensorsFile(path)
    return {k: f.get(k) for k in f.tensors}


def save_file(tensors: Mapping[str, Any], path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> None:
    """Write numpy-convertible arrays as a safetensors file."""
    header: dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}} if metadata else {}
    arrays, pos = [], 0
    for name, t in tensors.items():
        a = np.ascontiguousarray(np.asarray(t))
        a = a.astype(a.dtype.newbyteorder("<"), copy=False) if a.dtype.byteorder == ">" else a
        code = _CODE_OF.get(a.dtype)
        if code is None:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} has no safetensors code")
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [pos, pos + a.nbytes]}
        arrays.append(a)
        pos += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for a in arrays:
            f.write(a.tobytes())
