"""A small, strict safetensors reader and writer (numpy + ml_dtypes, no torch, no safetensors package).

File format: an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
(``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``),
then the data section; offsets are relative to the start of the data section.

`SafetensorsFile` validates the whole header on open, like the reference
``safetensors`` library does, so a truncated or corrupt file is refused with a
message naming the file and the problem before any tensor is read:

- the file is at least 8 bytes and the header length fits inside it;
- the header is UTF-8 JSON, an object, with well-formed entries;
- every tensor's byte size equals ``prod(shape) * itemsize`` for its dtype;
- the tensors cover the data section contiguously, without holes, overlaps or
  trailing bytes, and the data section is really that long on disk.

Tensors are read only on request (`SafetensorsFile.get`), in chunks, with an
optional progress callback. Dtypes whose numpy spelling is unknown (e.g. FP4)
are listed but refused when read.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import ml_dtypes
import numpy as np

from .errors import ConversionError

__all__ = [
    "SAFETENSORS_DTYPES",
    "SafetensorsError",
    "SafetensorsFile",
    "TensorInfo",
    "load_file",
    "save_file",
]

#: safetensors dtype code -> numpy dtype (little-endian).
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_CODE_OF = {dt: code for code, dt in SAFETENSORS_DTYPES.items()}
# Codes the format defines whose numpy spelling we do not have (listed, refused when read).
_KNOWN_UNREADABLE = {"F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "C64"}

_MAX_HEADER = 100 * 1024 * 1024  # the reference library's limit
_CHUNK = 8 * 1024 * 1024


class SafetensorsError(ConversionError):
    """A truncated, corrupt or unsupported safetensors file."""


class TensorInfo:
    """One tensor's header entry: dtype code, shape and absolute byte range in the file."""

    __slots__ = ("name", "code", "shape", "begin", "end")

    def __init__(self, name: str, code: str, shape: tuple[int, ...], begin: int, end: int) -> None:
        self.name, self.code, self.shape, self.begin, self.end = name, code, shape, begin, end

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def dtype(self) -> np.dtype | None:
        """The numpy dtype, or None for a dtype this reader cannot represent."""
        return SAFETENSORS_DTYPES.get(self.code)

    @property
    def dtype_name(self) -> str:
        dt = self.dtype
        return dt.name if dt is not None else self.code

    def __repr__(self) -> str:
        return f"TensorInfo({self.name!r}, {self.code}, {self.shape}, [{self.begin}, {self.end}))"


def _fail(path: Path, msg: str) -> SafetensorsError:
    return SafetensorsError(f"{path}: not a valid safetensors file: {msg}")


def _parse_header(path: Path, raw: bytes, data_start: int, data_len: int) -> tuple[dict[str, TensorInfo], dict]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(path, f"header is not UTF-8 ({e})") from None
    if not text.lstrip().startswith("{"):
        raise _fail(path, "header does not start with '{' (corrupt or not a safetensors file)")
    try:
        header = json.loads(text)
    except json.JSONDecodeError as e:
        raise _fail(path, f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _fail(path, f"header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise _fail(path, "__metadata__ must be an object")
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        where = f"tensor {name!r}"
        if not isinstance(entry, dict):
            raise _fail(path, f"{where}: entry must be an object, got {type(entry).__name__}")
        code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(code, str):
            raise _fail(path, f"{where}: missing or non-string dtype")
        if code not in SAFETENSORS_DTYPES and code not in _KNOWN_UNREADABLE:
            raise _fail(path, f"{where}: unknown dtype {code!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise _fail(path, f"{where}: shape must be a list of non-negative ints, got {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise _fail(path, f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
        begin, end = offsets
        dt = SAFETENSORS_DTYPES.get(code)
        if dt is not None:
            want = math.prod(shape) * dt.itemsize
            if end - begin != want:
                raise _fail(
                    path,
                    f"{where}: {code}{tuple(shape)} needs {want} bytes but data_offsets span {end - begin}",
                )
        if end > data_len:
            raise _fail(
                path,
                f"{where} ends at byte {end} of the data section, but only {data_len} bytes are present "
                "(the file is truncated)",
            )
        infos[name] = TensorInfo(name, code, tuple(shape), data_start + begin, data_start + end)
    # Contiguous cover of the data section, as the reference library requires.
    pos = 0
    for info in sorted(infos.values(), key=lambda i: (i.begin, i.end)):
        begin = info.begin - data_start
        if begin != pos:
            what = "overlaps the previous tensor" if begin < pos else f"leaves a hole of {begin - pos} bytes"
            raise _fail(path, f"tensor {info.name!r} starts at data byte {begin}: it {what}")
        pos = info.end - data_start
    if pos != data_len:
        raise _fail(path, f"the tensors cover {pos} bytes of the data section, but it has {data_len} (trailing bytes)")
    return infos, metadata


class SafetensorsFile:
    """Header of one safetensors file, validated on open; tensors read on request."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise _fail(self.path, f"file is {size} bytes, too short for the 8-byte header length")
                (n,) = struct.unpack("<Q", head)
                if n == 0 or n > _MAX_HEADER:
                    raise _fail(self.path, f"header length {n} is out of range (1 .. {_MAX_HEADER})")
                if 8 + n > size:
                    raise _fail(self.path, f"header length {n} runs past the end of the {size}-byte file (truncated)")
                raw = f.read(n)
        except OSError as e:
            raise SafetensorsError(f"{self.path}: cannot read: {e}") from None
        if len(raw) != n:
            raise _fail(self.path, "short read in the header (the file changed while reading?)")
        self.size = size
        self.data_start = 8 + n
        self.tensors, self.metadata = _parse_header(self.path, raw, self.data_start, size - 8 - n)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def info(self, key: str) -> TensorInfo:
        return self.tensors[key]

    def get(self, key: str, progress: Callable[[int], None] | None = None) -> np.ndarray:
        """Read one tensor into a fresh numpy array; ``progress(nbytes)`` is called as chunks arrive."""
        info = self.tensors[key]
        dt = info.dtype
        if dt is None:
            raise SafetensorsError(f"{self.path}: tensor {key!r} has dtype {info.code}, which this reader cannot convert")
        out = np.empty(info.shape, dtype=dt)
        buf = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(b"")
        try:
            with open(self.path, "rb") as f:
                f.seek(info.begin)
                pos = 0
                while pos < info.nbytes:
                    got = f.readinto(buf[pos : min(pos + _CHUNK, info.nbytes)])
                    if not got:
                        raise _fail(self.path, f"tensor {key!r}: unexpected end of file (the file shrank while reading?)")
                    pos += got
                    if progress is not None:
                        progress(got)
        except OSError as e:
            raise SafetensorsError(f"{self.path}: cannot read tensor {key!r}: {e}") from None
        return out


def load_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as numpy arrays."""
    f = SafetensorsFile(path)
    return {k: f.get(k) for k in f.keys()}


def save_file(
    tensors: Mapping[str, Any],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write numpy-convertible arrays as a safetensors file (used by tests and tooling)."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    arrays = []
    pos = 0
    for name, t in tensors.items():
        a = np.ascontiguousarray(np.asarray(t))
        dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        code = _CODE_OF.get(np.dtype(dt))
        if code is None:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} has no safetensors code")
        a = a.astype(dt, copy=False)
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [pos, pos + a.nbytes]}
        arrays.append(a)
        pos += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
