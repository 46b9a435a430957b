"""Training and held-out parts of one file or folder, by bytes (``kc data prepare PATH --heldout H``, issue 39).

The rule: each data file (``.txt``/``.text``/``.jsonl``; parquet is refused) is cut once. Its held-out part starts at
the first line that begins at or after byte ``floor(size * (1 - H))`` and runs to the end of the file; everything
before is its training part. The two parts joined are the file, byte for byte: nothing is dropped or repeated. A
``.txt`` file with no line start in its last share is cut at that byte instead (moved back to the start of a UTF-8
character); a ``.jsonl`` file keeps whole lines, so such a file stays wholly in training.

The parts are written to ``OUT/train/<name>`` and ``OUT/heldout/<name>`` (``<name>``: the file's path under the
folder given, or its name), each atomically (a temporary file renamed into place).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from kuangchao_core.data.files import resolve_files
from kuangchao_core.errors import DataError

_CHUNK = 1 << 20


@dataclass
class SplitReport:
    """What :func:`split_heldout` wrote: the two folders, the files and the bytes on each side."""

    train_dir: Path
    heldout_dir: Path
    files: list[str] = field(default_factory=list)
    train_bytes: int = 0
    heldout_bytes: int = 0


def _char_start(f, at: int) -> int:
    """``at`` moved back (at most 3 bytes) to the start of the UTF-8 character that covers it."""
    f.seek(max(0, at - 3))
    before = f.read(at - max(0, at - 3) + 1)
    cut = at
    i = len(before) - 1
    while cut > 0 and i > 0 and (before[i] & 0xC0) == 0x80:
        cut, i = cut - 1, i - 1
    return cut


def split_point(path: Path, heldout: float, kind: str) -> int:
    """The byte where ``path``'s held-out part starts (the module's rule); ``size`` when it has none."""
    size = path.stat().st_size
    target = math.floor(size * (1.0 - heldout))
    if target <= 0:
        return 0
    with open(path, "rb") as f:
        pos = target - 1  # a line begins at ``target`` when the byte before it is a newline
        f.seek(pos)
        while chunk := f.read(_CHUNK):
            found = chunk.find(b"\n")
            if found >= 0:
                return pos + found + 1
            pos += len(chunk)
        return size if kind == "jsonl" else _char_start(f, target)


def _copy_range(src: Path, start: int, end: int, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    with open(src, "rb") as f, open(tmp, "wb") as out:
        f.seek(start)
        left = end - start
        while left > 0:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                break
            out.write(chunk)
            left -= len(chunk)
    os.replace(tmp, dest)


def split_heldout(source: str | Path, out_dir: str | Path, heldout: float, fmt: str = "auto") -> SplitReport:
    """Cut every data file under ``source`` (of format ``fmt``, ``auto``: by extension) into ``out_dir/train`` and
    ``out_dir/heldout`` by the module's rule; raises DataError for a share outside (0, 1), a parquet file, or no
    held-out bytes at all."""
    if not 0.0 < heldout < 1.0:
        raise DataError(f"--heldout: {heldout} is not a share between 0 and 1 (e.g. 0.05 for the last 5 %)")
    source, out = Path(source), Path(out_dir)
    if source.is_dir() and out.resolve().is_relative_to(source.resolve()):
        raise DataError(f"--out: {out} is inside {source}, whose files it would split again; write it elsewhere")
    report = SplitReport(out / "train", out / "heldout")
    for f, kind in resolve_files(source, fmt):
        if kind == "parquet":
            raise DataError(f"{f}: parquet files cannot be split by bytes; give .txt or .jsonl files")
        name = f.relative_to(source) if source.is_dir() else Path(f.name)
        size = f.stat().st_size
        cut = split_point(f, heldout, kind)
        _copy_range(f, 0, cut, report.train_dir / name)
        _copy_range(f, cut, size, report.heldout_dir / name)
        report.files.append(str(name))
        report.train_bytes += cut
        report.heldout_bytes += size - cut
    if report.heldout_bytes == 0:
        raise DataError(f"{source}: no held-out bytes at --heldout {heldout} (files too short); raise --heldout")
    return report
