"""One folder of a run (final/, a checkpoint, an export) as a tar stream: each member's header and
bytes are produced as they are read, so a model of many gigabytes is never held in memory, and
nothing outside the run directory is read through a link."""

from __future__ import annotations

import os
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path

CHUNK = 1 << 20  # bytes read and sent at a time


def _inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


def members(folder: Path, run_dir: Path) -> list[tuple[str, Path]]:
    """(name in the archive, file to read) of every file under `folder`, sorted. Folders are walked
    without following links; a link to a file is read as that file only where its target stays in
    `run_dir` (a link out of the run, or to a folder, is left out)."""
    root = Path(os.path.realpath(run_dir))
    out: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        here = Path(dirpath)
        names = filenames + [d for d in dirnames if (here / d).is_symlink()]  # os.walk lists a linked folder as one
        for name in names:
            p = here / name
            real = Path(os.path.realpath(p))
            if not _inside(real, root) or not real.is_file():
                continue
            out.append((str(p.relative_to(folder.parent)), real))
    return sorted(out)


def tar_stream(entries: list[tuple[str, Path]]) -> Iterator[bytes]:
    """A POSIX (pax) tar of `entries` ((name, file)), chunk by chunk. A file that shrinks while it is
    read is padded with zeros to the size its header gave (the archive stays readable); one that
    grows is cut at that size."""
    for name, path in entries:
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below, after its last chunk is sent
        except OSError:
            continue  # removed since the listing (keep_last): left out
        with f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                continue
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = st.st_size, int(st.st_mtime), 0o644
            yield info.tobuf(format=tarfile.PAX_FORMAT)
            left = st.st_size
            while left > 0:
                chunk = f.read(min(CHUNK, left))
                if not chunk:
                    chunk = b"\0" * min(CHUNK, left)
                left -= len(chunk)
                yield chunk
            pad = -st.st_size % tarfile.BLOCKSIZE
            if pad:
                yield b"\0" * pad
    yield b"\0" * (2 * tarfile.BLOCKSIZE)  # the end-of-archive marker
