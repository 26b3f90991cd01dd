"""safetensors without torch: parse headers, write files, copy tensor byte ranges.

The format (https://github.com/huggingface/safetensors, "Format" section of its README):
  8 bytes   little-endian u64 N, the header length
  N bytes   UTF-8 JSON: {"__metadata__": {str: str}, NAME: {"dtype": D, "shape": [...],
            "data_offsets": [BEGIN, END]}, ...}; offsets are relative to the end of the header;
            writers pad the header with spaces to a multiple of 8 bytes
  data      the tensors' raw little-endian bytes, back to back, no holes

Everything here moves bytes: a 5 GB shard is never loaded; memory stays at one copy buffer.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import struct
from pathlib import Path
from typing import Iterable, NamedTuple, Union

from onespark import shape as declared
from onespark.errors import UserError, at_path

# safetensors dtype string -> bytes per element (safetensors `Dtype` enum).
DTYPE_SIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}

# A real header is a few hundred KB (the 122B model's largest shard: ~0.3 MB); anything past this
# is corruption, and refusing it keeps a bad file from making us allocate gigabytes.
MAX_HEADER_BYTES = 100 * 1024 * 1024
COPY_CHUNK = 64 * 1024 * 1024  # buffer of the fallback copy
KERNEL_CHUNK = 1 << 30  # bytes per copy_file_range call (the kernel caps one call just under 2 GiB)


class TensorInfo(NamedTuple):  # a tuple, not a dataclass: the 122B model has ~150k of these
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int  # absolute file offset past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclasses.dataclass(frozen=True)
class Header:
    path: Path
    tensors: dict[str, TensorInfo]  # in file order
    metadata: dict[str, str]
    data_start: int  # 8 + header length
    file_size: int


def nbytes_of(dtype: str, shape: Iterable[int]) -> int:
    return DTYPE_SIZE[dtype] * math.prod(shape)


# The fix a message about a bad downloaded file ends with; a hybrid checkpoint's own files pass step 1's instead.
REDOWNLOAD = "delete it and download it again (step 0, `onespark download`, fetches only what is missing)"


# The header's declared shape (onespark.shape): what parse_header reads, checked before it reads it.
_OFFSET = declared.Int(0, 1 << 62, "a byte offset")
_ENTRY = declared.Obj({"dtype": declared.Str("a dtype name"),
                       "shape": declared.ListOf(declared.Int(0, 1 << 40, "a dimension"), "a list of dimensions"),
                       "data_offsets": declared.ListOf(_OFFSET, "[begin, end]", min_len=2)},
                      what="a tensor entry ({dtype, shape, data_offsets})")
_TOP = declared.Obj(optional={"__metadata__": declared.Nullable(declared.MapOf(str, "an object of strings"))},
                    what="a JSON object")


class _Entries(declared.Shape):
    """Every key but __metadata__ is a tensor entry; data_offsets exactly two."""
    want = _ENTRY.want

    def check(self, value, field):
        _TOP.check(value, field)
        for k, v in value.items():
            if k != "__metadata__":
                _ENTRY.check(v, f"{field}[{json.dumps(k)}]" if field else json.dumps(k))
                if len(v["data_offsets"]) != 2:
                    raise declared.Mismatch(f"{json.dumps(k)}.data_offsets", v["data_offsets"], "[begin, end]")


HEADER = _Entries()


def parse_header(raw: bytes, data_start: int, where: str, fix: str = REDOWNLOAD
                 ) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """Parse header JSON bytes. Returns (tensors in offset order, metadata, data end offset).
    `fix` ends the messages about a corrupt header (see read_header)."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: also a 5000-digit number
        raise UserError(f"{where}: safetensors header is not valid JSON ({e}): the file is corrupt; "
                        f"{fix}") from None
    declared.check(doc, HEADER, f"{where}: safetensors header", f"the file is corrupt; {fix}")
    metadata = doc.pop("__metadata__", None) or {}
    entries = []
    for name, info in doc.items():
        dtype, shape_, (b, e) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        if dtype not in DTYPE_SIZE:
            raise UserError(f"{where}: tensor {name!r} has unknown dtype {dtype!r}: {fix}")
        if not (isinstance(b, int) and isinstance(e, int) and 0 <= b <= e):
            raise UserError(f"{where}: tensor {name!r} has bad data_offsets {[b, e]}: the file is corrupt; {fix}")
        if e - b != nbytes_of(dtype, shape_):
            raise UserError(f"{where}: tensor {name!r} is {e - b} bytes but {dtype}{list(shape_)} needs "
                            f"{nbytes_of(dtype, shape_)}: the file is corrupt; {fix}")
        entries.append(TensorInfo(name, dtype, shape_, data_start + b, data_start + e))
    entries.sort(key=lambda t: t.begin)
    pos = data_start
    for t in entries:
        if t.begin != pos:
            raise UserError(f"{where}: tensor {t.name!r} starts at byte {t.begin - data_start}, expected "
                            f"{pos - data_start} (overlap or hole): the file is corrupt; {fix}")
        pos = t.end
    return {t.name: t for t in entries}, metadata, pos


def read_header(path: Union[str, Path], fix: str = REDOWNLOAD) -> Header:
    """Read and validate a local file's header; checks the file size against it (truncation).

    `fix` ends every message: what to do, naming the step that makes this file (step 0 for a download,
    step 1 for a hybrid checkpoint's shards)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: missing: {fix.removeprefix('delete it and ')}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: only {size} bytes, too short for a safetensors file: it is truncated; {fix}")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise UserError(f"{path}: header length {n} does not fit the file ({size} bytes): the file is "
                            f"truncated or not safetensors; {fix}")
        raw = f.read(n)
    tensors, metadata, end = parse_header(raw, 8 + n, str(path), fix)
    if end != size:
        what = "truncated" if size < end else "longer than its header says"
        raise UserError(f"{path}: {what} ({size} bytes on disk, header says {end}): {fix}")
    return Header(path, tensors, metadata, 8 + n, size)


def encode_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None) -> bytes:
    """Header bytes (length prefix included) for tensors laid out back to back in this order."""
    doc: dict = {}
    if metadata:
        doc["__metadata__"] = metadata
    pos = 0
    for name, dtype, shape in entries:
        n = nbytes_of(dtype, shape)
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads to 8 bytes so the data is aligned
    return struct.pack("<Q", len(raw)) + raw


@dataclasses.dataclass(frozen=True)
class Range:
    """Bytes [offset, offset+length) of a file on disk: the source of a copied tensor."""
    path: Path
    offset: int
    length: int


Source = Union[bytes, memoryview, Range]


def copy_range(src_fd: int, dst_fd: int, offset: int, length: int) -> None:
    """Append src[offset:offset+length] to dst at its current position.

    os.copy_file_range keeps the bytes in the kernel (and is a reflink on XFS/btrfs);
    where the kernel or filesystem refuses it, a buffered copy of COPY_CHUNK at a time.
    """
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            while done < length:
                n = os.copy_file_range(src_fd, dst_fd, min(length - done, KERNEL_CHUNK), offset + done)
                if n == 0:
                    raise UserError(f"source ended {length - done} bytes early while copying: it is truncated")
                done += n
            return
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                raise
    while done < length:
        buf = os.pread(src_fd, min(length - done, COPY_CHUNK), offset + done)
        if not buf:
            raise UserError(f"source ended {length - done} bytes early while copying: it is truncated")
        view = memoryview(buf)
        while view:
            view = view[os.write(dst_fd, view):]
        done += len(buf)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def coalesce(sources: list[Source]) -> list[Source]:
    """Merge neighbouring Ranges of one file into one: the copy becomes a few large kernel calls
    instead of one per tensor (62k tensors of ~85 KB: 500 MB/s -> disk speed on ext4, 2-vCPU VM)."""
    out: list[Source] = []
    for src in sources:
        prev = out[-1] if out else None
        if isinstance(src, Range) and isinstance(prev, Range) and prev.path == src.path \
                and prev.offset + prev.length == src.offset:
            out[-1] = Range(src.path, prev.offset, prev.length + src.length)
        else:
            out.append(src)
    return out


def write_safetensors(path: Union[str, Path], tensors: list[tuple[str, str, tuple[int, ...], Source]],
                      metadata: dict[str, str] | None = None, header: bytes | None = None) -> int:
    """Write a safetensors file atomically (temp name, fsync, rename). Returns its size.

    Each tensor is (name, dtype, shape, source); source is bytes or a Range of an existing file,
    which is copied with copy_file_range. Tensors are written in the order given. `header`, when
    given, is encode_header(...) of these tensors computed earlier (it is not recomputed).
    """
    tmp, size = write_safetensors_tmp(path, tensors, metadata, header)
    finalize(tmp, path)
    return size


def finalize(tmp: Union[str, Path], path: Union[str, Path]) -> None:
    """fsync a file written by write_safetensors_tmp, then rename it to its final name."""
    with at_path(path, tmp):
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # ENOSPC can surface here (delayed allocation): reported as `path`'s
        finally:
            os.close(fd)
        os.replace(tmp, path)


def write_safetensors_tmp(path: Union[str, Path], tensors: list[tuple[str, str, tuple[int, ...], Source]],
                          metadata: dict[str, str] | None = None, header: bytes | None = None) -> tuple[Path, int]:
    """The first half of write_safetensors: the file under its temp name, not yet synced or renamed
    (so a caller can overlap one file's fsync with the next file's copy). Returns (temp path, size)."""
    path = Path(path)
    for name, dtype, shape, src in tensors:
        have = src.length if isinstance(src, Range) else len(src)
        if have != nbytes_of(dtype, shape):
            raise ValueError(f"{name}: {have} bytes for {dtype}{list(shape)}")
    if header is None:
        header = encode_header([(name, dtype, tuple(shape)) for name, dtype, shape, _ in tensors], metadata)
    tmp = _tmp_name(path)
    fds: dict[Path, int] = {}
    ok = False
    try:
        with at_path(path, tmp), open(tmp, "wb") as out:
            out.write(header)
            out.flush()
            dst = out.fileno()
            for src in coalesce([t[3] for t in tensors]):
                if isinstance(src, Range):
                    if src.path not in fds:
                        fds[src.path] = os.open(src.path, os.O_RDONLY)
                    copy_range(fds[src.path], dst, src.offset, src.length)
                else:
                    view = memoryview(src).cast("B")
                    while view:
                        view = view[os.write(dst, view):]
            size = os.fstat(dst).st_size
        ok = True
    finally:
        for fd in fds.values():
            os.close(fd)
        if not ok and tmp.exists():
            tmp.unlink()
    return tmp, size


def write_json_atomic(path: Union[str, Path], obj) -> None:
    """json.dump to a temp name, fsync, rename: readers see the old file or the new one, never half."""
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        with at_path(path, tmp), open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        with at_path(path, tmp):
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def copy_file_atomic(src: Union[str, Path], dst: Union[str, Path]) -> int:
    """Whole-file copy through copy_range, temp name + fsync + rename. Returns the size."""
    tmp, size = copy_file_tmp(src, dst)
    finalize(tmp, dst)
    return size


def copy_file_tmp(src: Union[str, Path], dst: Union[str, Path]) -> tuple[Path, int]:
    """Whole-file copy to dst's temp name, not yet synced or renamed (see write_safetensors_tmp)."""
    src, dst = Path(src), Path(dst)
    tmp = _tmp_name(dst)
    ok = False
    try:
        size = src.stat().st_size
        with open(src, "rb") as fi, at_path(dst, tmp), open(tmp, "wb") as fo:
            copy_range(fi.fileno(), fo.fileno(), 0, size)
        ok = True
    finally:
        if not ok and tmp.exists():
            tmp.unlink()
    return tmp, size
