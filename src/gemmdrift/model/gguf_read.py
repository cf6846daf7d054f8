"""A direct GGUF reader: metadata as Python values, tensors as numpy views of the file.

gguf-py's ``GGUFReader`` builds several numpy memmap views per metadata value;
the Gemma 3 vocabulary has 262,144 strings, so opening the embedded GGUF took
20-70 s of this machine's CPU, 80% of a fresh conversion (issue 25, item 7).
This reader walks the same GGUF v2/v3 layout with ``struct`` and decodes each
string once. Tensor data are the same arrays ``GGUFReader`` gives (same dtype,
same shape, the same bytes of the file), so ``gguf.quants.dequantize`` and
everything after it compute exactly what they computed before; a test compares
the two readers field by field and tensor by tensor.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUFValueType -> struct format (little-endian file).
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# GGML types stored plain (one element per item), as GGUFReader reads them; the others are byte blocks.
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class Tensor:
    """One tensor: its GGUF name, ``gguf.GGMLQuantizationType`` and data (GGUFReader's dtype and shape)."""

    name: str
    tensor_type: Any
    data: np.ndarray


class GGUFFile:
    """A little-endian GGUF v2/v3 file, read once.

    Attributes:
        fields: metadata key -> value (str, int, float, bool, or a list of them for arrays).
        types: metadata key -> GGUF value type number (8 string, 9 array, ...).
        tensors: :class:`Tensor` in file order.

    Raises ValueError, struct.error, IndexError or UnicodeDecodeError on a truncated or corrupt file.
    """

    def __init__(self, path: str | Path):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.path = Path(path)
        # Read-only memmap: tensor data stay in the file until used, as with GGUFReader.
        self._data = np.memmap(self.path, mode="r")
        # Metadata are parsed from a memoryview: slicing a memmap makes a numpy view per slice (GGUFReader's cost).
        self._mv = memoryview(self._data)
        buf = self._data
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("GGUF magic invalid")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not 2 or 3 (or the file is big-endian)")
        self.version = version
        self._pos = 24
        self.fields: dict[str, Any] = {}
        self.types: dict[str, int] = {}
        for _ in range(n_kv):
            key = self._string()
            kind = self._take("I")
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key}")
            self.types[key] = kind
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._take("Q") for _ in range(self._take("I"))]
            infos.append((name, dims, self._take("I"), self._take("Q")))
        alignment = int(self.fields.get("general.alignment", 32))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid alignment {alignment}: must be a non-zero power of two")
        start = -(-self._pos // alignment) * alignment
        self.tensors: list[Tensor] = []
        seen = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise ValueError(f"duplicated tensor {name}")
            seen.add(name)
            qtype = GGMLQuantizationType(raw_type)
            n = int(np.prod(dims))
            shape = tuple(reversed(dims))
            if qtype.name in _PLAIN:
                dtype, count = _PLAIN[qtype.name], n
            else:
                block, size = GGML_QUANT_SIZES[qtype]
                dtype, count, shape = np.uint8, n * size // block, quant_shape_to_byte_shape(shape, qtype)
            at = start + offset
            nbytes = count * np.dtype(dtype).itemsize
            if at + nbytes > len(buf):
                raise ValueError(f"tensor {name} runs past the end of the file")
            self.tensors.append(Tensor(name, qtype, buf[at:at + nbytes].view(dtype).reshape(shape)))

    def _take(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self._mv, self._pos)
        self._pos += struct.calcsize("<" + fmt)
        return value

    def _string(self) -> str:
        n = self._take("Q")
        end = self._pos + n
        if end > len(self._mv):
            raise ValueError("a string runs past the end of the file")
        s = bytes(self._mv[self._pos:end]).decode("utf-8")
        self._pos = end
        return s

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            elem, count = self._take("I"), self._take("Q")
            if elem in _NUMPY:  # one frombuffer for the whole array, not one view per element
                nbytes = count * np.dtype(_NUMPY[elem]).itemsize
                if self._pos + nbytes > len(self._mv):
                    raise ValueError("an array runs past the end of the file")
                values = np.frombuffer(self._mv, dtype=np.dtype(_NUMPY[elem]).newbyteorder("<"), count=count,
                                       offset=self._pos).tolist()
                self._pos += nbytes
                return values
            if elem == _STRING:
                return self._strings(count)
            return [self._value(elem) for _ in range(count)]
        if kind in _SCALAR:
            return self._take(_SCALAR[kind])
        raise ValueError(f"unknown GGUF value type {kind}")

    def _strings(self, count: int) -> list[str]:
        """``count`` strings in a row (the vocabulary), decoded as gemmdrift decodes token pieces."""
        out = []
        buf, pos, size = self._mv, self._pos, len(self._mv)
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > size:
                raise ValueError("a string runs past the end of the file")
            out.append(bytes(buf[pos:pos + n]).decode("utf-8", errors="replace"))
            pos += n
        self._pos = pos
        return out
