"""The file paths the package writes: checks before any work, and the one way every file is
written (`replacing`, `replacing_path`). Torch-free (the runtime-only path uses it).

Every write goes to a new temporary file in the target's folder, created exclusively under a
random name (`tempfile.mkstemp`: O_CREAT | O_EXCL, mode 0600, never through a link planted at a
predictable name), and is renamed over the target once whole (`os.replace`: a link at the
target itself is replaced, its destination never written). A reader sees the old file or the
new one, never a part; a failed write leaves the old one."""
from __future__ import annotations

import contextlib
import os
import tempfile

TMP_PREFIX = ".hla_tvm-tmp-"   # temporary files of an unfinished write (`replacing`)


def output_path(name, path):
    """`path` as a str: a file to write, checked before any work: not a folder, in a folder
    that exists and is writable."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a file path, got {type(path).__name__}")
    path = os.fspath(path)
    if isinstance(path, bytes):
        raise TypeError(f"{name} must be a str or path, got bytes")
    if not path:
        raise ValueError(f"{name} must not be empty: give a file path")
    if os.path.isdir(path) or path.endswith(os.sep) or not os.path.basename(path):
        raise ValueError(f"{name} {path!r} is a folder: give a file path in it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"{name} {path}: the folder {folder} does not exist or is not writable")
    return path


def not_an_input(name, path, *inputs):
    """ValueError when the output `path` (argument `name`) is one of the files `inputs` (the
    same file by another name or link included): writing it would destroy the input."""
    for given in inputs:
        if given is None or not os.path.exists(given) or not os.path.exists(path):
            continue
        if os.path.samefile(path, given):
            raise ValueError(f"{name} {path} is the input {given}: writing it would replace "
                             "the input; give another output path")


_UMASK = []


def _file_mode(executable=False):
    """The mode a file created by a plain open() gets under this process's umask
    (read from /proc, which does not change it for other threads; 022 where unknown)."""
    if not _UMASK:
        umask = 0o022
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("Umask:"):
                        umask = int(line.split()[1], 8)
        except (OSError, ValueError):
            pass
        _UMASK.append(umask)
    return (0o777 if executable else 0o666) & ~_UMASK[0]


@contextlib.contextmanager
def replacing_path(path, suffix="", executable=False):
    """Yields the name of a new, empty temporary file beside `path` (created exclusively, see
    the module docstring) for a writer that needs a name; once the block ends without error the
    file gets the usual mode and is renamed over `path`; otherwise it is removed."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=suffix,
                               dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, _file_mode(executable))
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


@contextlib.contextmanager
def replacing(path, mode="wb", executable=False, **kwargs):
    """Yields a file object open for writing (`mode` "wb" or "w"; kwargs go to `open`) on a new
    temporary file beside `path`, renamed over `path` once the block ends without error
    (`replacing_path`)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"mode must be 'wb' or 'w', got {mode!r}")
    def no_follow(name, flags):   # (the name mkstemp made: refused if swapped for a link)
        return os.open(name, flags | getattr(os, "O_NOFOLLOW", 0), 0o600)

    with replacing_path(path, executable=executable) as tmp:
        with open(tmp, mode, opener=no_follow, **kwargs) as f:
            yield f
