"""A read-only seekable file whose bytes come from a function of (offset, count): for readers (torch.load,
tarfile, pyarrow) that want a file object where the bytes are fetched in ranges (an object store's
ranged GETs) or only partly known (a checkpoint item's head and tail)."""

from __future__ import annotations

import io


class ByteRangeFile(io.RawIOBase):
    """A raw file of `size` bytes; a subclass gives `read_at(offset, count)` (at most `count` bytes)."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.pos = size, 0

    def read_at(self, offset: int, count: int) -> bytes:
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer) -> int:
        want = min(len(buffer), self.size - self.pos)
        if want <= 0:
            return 0
        data = self.read_at(self.pos, want)
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)
