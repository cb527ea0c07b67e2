"""The disk tier's per-directory secret, which its files' MACs are keyed with: whoever can write files into the
cache directory but cannot read this one (mode 0600, this user's) cannot plant a checkpoint any tenant would
restore. Created once with the directory, atomically (written aside, then linked into place, so a concurrent
process never reads half a key), and read at start. A key file that is not this user's private regular file of
the right size may have been planted: it is replaced, and the files keyed with it are then refused."""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

log = logging.getLogger("hyserve.cache")

KEY_FILE = "hyserve-disk.key"
KEY_BYTES = 32


def directory_key(directory: Path) -> bytes:
    """The directory's secret, created if it has none (or an untrustworthy one)."""
    path = Path(directory) / KEY_FILE
    for _ in range(3):
        key = _read(path)
        if key is not None:
            return key
        _create(path)
    raise OSError(f"cannot create the disk tier's key {path}")


def _read(path: Path) -> bytes | None:
    """The key in `path`, or None when there is none; a key file that is not ours is deleted."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:  # a symlink (ELOOP), or another user's unreadable file
        return _untrusted(path, f"{type(exc).__name__}: {exc}")
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        key = f.read(KEY_BYTES + 1)
    if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077 or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
        return _untrusted(path, f"mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}")
    if len(key) != KEY_BYTES:
        return _untrusted(path, f"{len(key)} bytes, not {KEY_BYTES}")
    return key


def _untrusted(path: Path, why: str) -> None:
    log.warning(
        "the disk tier's key %s is not this user's private key (%s): replaced; files keyed with it will be refused",
        path,
        why,
    )
    path.unlink(missing_ok=True)
    return None


def _create(path: Path) -> None:
    """Write a fresh key aside (0600 from the start) and link it into place; a key another process linked
    first wins."""
    aside = path.with_name(f".{KEY_FILE}-{secrets.token_hex(8)}")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    finally:
        aside.unlink(missing_ok=True)
