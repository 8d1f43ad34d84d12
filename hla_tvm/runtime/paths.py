"""The file paths the package writes: checks before any work, and the one way every file is
written (`replacing`, `replacing_path`). Torch-free (the runtime-only path uses it).

Every write goes to a new temporary file in the target's folder, created exclusively under a
random name (`tempfile.mkstemp`: O_CREAT | O_EXCL, mode 0600, never through a link planted at a
predictable name), and is renamed over the target once whole (`os.replace`: a link at the
target itself is replaced, its destination never written). A reader sees the old file or the
new one, never a part; a failed write leaves the old one.

A write in progress holds a lock on its temporary file (or folder: `temporary_folder`); a
process killed mid-write (SIGKILL, power loss) leaves its temporary behind, unlocked. `sweep`
removes those, once they are this user's and untouched for `STALE_S` seconds: `replacing_path`
sweeps the folder it writes in (at most once a minute per folder and process), the sessions
store its folder when opened and at each save. A command stopped by SIGTERM removes its own
(`stop_on_sigterm`: the signal raises `Stopped` in the main thread, so every `with` on the way
out cleans up; `finishing` holds it back while a child process writes a file)."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import tempfile
import threading
import time

TMP_PREFIX = ".hla_tvm-tmp-"   # temporary files of an unfinished write (`replacing`)
STALE_S = 300   # an unlocked temporary untouched this long is an interrupted write's (`sweep`)
SWEEP_EVERY_S = 60   # `replacing_path` sweeps a folder at most this often per process


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


def _lock(fd):
    """Hold an exclusive lock on the open file or folder `fd` (released when it is closed or
    the process dies): `sweep` leaves locked temporaries alone."""
    try:
        # fcntl: POSIX only (no locks elsewhere)
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (ImportError, OSError):
        pass


def _in_use(path, is_dir):
    """Whether a running write holds the temporary file or folder at `path` (`_lock`)."""
    try:
        import fcntl
    except ImportError:
        return False
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | \
        (getattr(os, "O_DIRECTORY", 0) if is_dir else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return True   # (gone, or not ours to open: left alone)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _tree_size(path):
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def temporaries(folder):
    """[(path, bytes, seconds since last modified, whether a running write holds it)] of the
    temporary files and folders of writes (`TMP_PREFIX`) in `folder` that are this user's."""
    found = []
    now, uid = time.time(), os.getuid()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return found
    for e in entries:
        if not e.name.startswith(TMP_PREFIX):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        is_dir = stat.S_ISDIR(st.st_mode)
        if st.st_uid != uid or not (is_dir or stat.S_ISREG(st.st_mode)):
            continue
        size = _tree_size(e.path) if is_dir else st.st_size
        found.append((e.path, size, now - st.st_mtime, _in_use(e.path, is_dir)))
    return found


def sweep(folder, age=STALE_S):
    """Remove from `folder` the temporaries that interrupted writes left (`temporaries`: this
    user's, named TMP_PREFIX...) untouched for `age` seconds and held by no running write.
    Never raises. Returns [(path, bytes)] of what was removed."""
    removed = []
    for path, size, idle, held in temporaries(folder):
        if held or idle < age:
            continue
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        except OSError:
            continue
        removed.append((path, size))
    return removed


_SWEPT: dict = {}   # folder -> time.monotonic() of this process's last sweep of it
_SWEPT_LOCK = threading.Lock()


def sweep_now_and_then(folder):
    """`sweep` of `folder` unless this process swept it in the last SWEEP_EVERY_S seconds."""
    now = time.monotonic()
    with _SWEPT_LOCK:
        last = _SWEPT.get(folder)
        if last is not None and now - last < SWEEP_EVERY_S:
            return []
        _SWEPT[folder] = now
    return sweep(folder)


@contextlib.contextmanager
def temporary_folder(beside):
    """Yields a new private folder (TMP_PREFIX...) in the folder of the path `beside`, locked
    while the block runs (see `sweep`) and removed with its content when it ends, with or
    without error: room for a writer's intermediate files on the filesystem of its output."""
    where = tempfile.mkdtemp(prefix=TMP_PREFIX, dir=os.path.dirname(os.path.abspath(beside)))
    fd = os.open(where, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        _lock(fd)
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)
        os.close(fd)


@contextlib.contextmanager
def replacing_path(path, suffix="", executable=False):
    """Yields the name of a new, empty temporary file beside `path` (created exclusively, see
    the module docstring) for a writer that needs a name; once the block ends without error the
    file gets the usual mode and is renamed over `path`; otherwise it is removed. Stale
    temporaries of interrupted writes in that folder are swept first (`sweep_now_and_then`)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    sweep_now_and_then(folder)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=suffix, dir=folder)
    try:
        _lock(fd)   # (held until the file is renamed or removed)
        yield tmp
        os.chmod(tmp, _file_mode(executable))
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        os.close(fd)


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


class Stopped(BaseException):
    """SIGTERM, raised in the main thread (`stop_on_sigterm`): not an Exception, so that no
    `except Exception` takes it for an error on its way out."""


_HOLD = {"depth": 0, "pending": None}   # `finishing` blocks open in the main thread; a signal


def _main_thread():
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def stop_on_sigterm(stopped, wanted=True):
    """While the block runs in the main thread (and `wanted`), SIGTERM raises `Stopped` there
    (once; the signal appended to the list `stopped`), so that the `with` blocks on the way out
    remove the temporary files they made; inside `finishing` it is raised when that block ends.
    The handler before is restored after. Python runs the handler between bytecodes: a long
    call into compiled code (a TVM pass, LLVM's code generation) finishes first."""
    before = None
    if wanted and _main_thread():
        def handler(signum, frame):
            if stopped:   # (a second one: the clean-up under way goes on)
                return
            stopped.append(signum)
            if _HOLD["depth"]:
                _HOLD["pending"] = signum
                return
            raise Stopped(f"stopped by signal {signum}")

        with contextlib.suppress(ValueError, OSError):
            before = signal.signal(signal.SIGTERM, handler) or signal.SIG_DFL
    try:
        yield
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)
            _HOLD["pending"] = None


@contextlib.contextmanager
def finishing():
    """A block `stop_on_sigterm`'s SIGTERM does not interrupt (a child process writing a file,
    which would otherwise go on writing it after its temporary was removed): the signal is
    raised as `Stopped` when the block ends."""
    if not _main_thread():
        yield
        return
    _HOLD["depth"] += 1
    try:
        yield
    finally:
        _HOLD["depth"] -= 1
    if not _HOLD["depth"] and _HOLD["pending"] is not None:
        signum, _HOLD["pending"] = _HOLD["pending"], None
        raise Stopped(f"stopped by signal {signum}")
