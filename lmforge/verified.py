"""Verified reads: a file's bytes checked against the size and sha256 its manifest lists.

Every reader of an artifact (stages, training data loaders, eval) goes through these, so a file modified or damaged
after it was published is reported with the artifact, the file and the fix, never used. `read_verified` checks
before anyone reads; `VerifyingReader` checks at the end, for streams whose consumer acts on bytes as they come.
"""
from __future__ import annotations

import hashlib
import io
import tempfile
from typing import IO, Callable

from lmforge.errors import ArtifactError

SPOOL_BYTES = 64 * 2**20  # a verified copy stays in memory up to this size, then spills to a temporary file


def mismatch_error(artifact: str, file: str, location: str, got: tuple[int, str] | None, want: tuple[int, str],
                   stage: str | None = None) -> ArtifactError:
    """The error for a file whose bytes are not what its manifest lists: which artifact, which file, and the fix.
    `got` is (bytes, sha256) as read, None when the file is missing."""
    if got is None:
        what = f"is missing ({location}); the manifest lists {want[0]} bytes, sha256 {want[1][:12]}…"
    else:
        what = (f"content does not match its manifest (read {got[0]} bytes, sha256 {got[1][:12]}…; the manifest says "
                f"{want[0]} bytes, {want[1][:12]}…) at {location}")
    rerun = (f"rerun stage '{stage}' with --force (`lmforge run <config> --force {stage}`)" if stage
             else "rerun the stage that produced it with --force")
    return ArtifactError(f"artifact {artifact}, file {file}: {what}. The artifact was modified or damaged after it "
                         f"was published; {rerun}.")


class VerifyingReader(io.RawIOBase):
    """Raw reader that hashes what passes through and checks byte count and sha256 when it reaches EOF (or at
    `finish`). For streams whose consumer may act on bytes before the end; `read_verified` checks first."""

    def __init__(self, f: IO[bytes], size: int, sha256: str, mismatch: Callable[[int, str], Exception]):
        super().__init__()
        self._f, self._size, self._sha, self._mismatch = f, size, sha256, mismatch
        self._h = hashlib.sha256()
        self._n = 0
        self._checked = False

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        b = self._f.read(len(buf))
        n = len(b)
        buf[:n] = b
        self._h.update(b)
        self._n += n
        if n == 0 and not self._checked:
            self._check()
        return n

    def finish(self) -> None:
        """Read what the consumer left, and check."""
        while self.read(1 << 20):
            pass
        if not self._checked:
            self._check()

    def _check(self) -> None:
        self._checked = True
        if self._n != self._size or self._h.hexdigest() != self._sha:
            raise self._mismatch(self._n, self._h.hexdigest())

    def close(self) -> None:
        self._f.close()
        super().close()


def read_verified(f: IO[bytes], size: int, sha256: str, mismatch: Callable[[int, str], Exception]) -> IO[bytes]:
    """A copy of the stream `f`, checked against (size, sha256) before anyone reads it: one pass that hashes the
    bytes as they are copied, in memory up to SPOOL_BYTES, then in a temporary file. Returned at position 0."""
    buf = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)
    h, n = hashlib.sha256(), 0
    try:
        while b := f.read(1 << 20):
            h.update(b)
            n += len(b)
            buf.write(b)
        if n != size or h.hexdigest() != sha256:
            raise mismatch(n, h.hexdigest())
    except BaseException:
        buf.close()
        raise
    buf.seek(0)
    return buf
