"""sysfs behind a tiny interface with an injectable root, so tests build a tree under tmp_path.

This is the real kernel's interface only: a fake tree's writes are answered by hostagent.host.fakekernel, which the
composition (adapters.open_kernel, `host.kernel = "fake"`) or a test passes in where a Sysfs is expected."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from hostagent.domain.errors import HostError


class Sysfs:
    """Read and write sysfs attributes under `root` (default /sys). Paths are relative to root."""

    def __init__(self, root: str | os.PathLike[str] = "/sys") -> None:
        self.root = Path(root)

    def path(self, rel: str) -> Path:
        """Absolute path of a sysfs-relative path."""
        return self.root / rel.lstrip("/")

    def exists(self, rel: str) -> bool:
        """True when the attribute or directory exists."""
        return os.path.lexists(self.path(rel))

    def read_str(self, rel: str) -> str | None:
        """Attribute text stripped of whitespace, or None when absent or unreadable."""
        try:
            return self.path(rel).read_text(errors="replace").strip()
        except OSError:
            return None

    def read_int(self, rel: str, base: int = 10) -> int | None:
        """Attribute as int (hex when base=16, '0x' prefix allowed), or None."""
        text = self.read_str(rel)
        if text is None or text == "":
            return None
        try:
            return int(text, base)
        except ValueError:
            return None

    def read_link(self, rel: str) -> str | None:
        """Basename of a symlink's target (e.g. the driver name), or None when there is no link."""
        try:
            return os.path.basename(os.readlink(self.path(rel)))
        except OSError:
            return None

    def resolve(self, rel: str) -> Path | None:
        """Fully resolved path of a link, or None."""
        p = self.path(rel)
        if not os.path.lexists(p):
            return None
        return p.resolve()

    def listdir(self, rel: str) -> list[str]:
        """Sorted entries of a directory, empty when absent."""
        try:
            return sorted(os.listdir(self.path(rel)))
        except OSError:
            return []

    def write(self, rel: str, value: str) -> None:
        """Write an attribute as the kernel expects (one write call); raise HostError with the errno."""
        p = self.path(rel)
        try:
            fd = os.open(p, os.O_WRONLY)
            try:
                os.write(fd, value.encode())
            finally:
                os.close(fd)
        except OSError as exc:
            raise HostError(
                f"writing {value.strip()!r} to {p} failed: {errno.errorcode.get(exc.errno or 0, exc.errno)} {exc.strerror}",
                path=str(p),
                errno=exc.errno,
            ) from exc
