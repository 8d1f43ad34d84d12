"""Sealed shared libraries: the one place that knows how a compiled module file is checked.

Every library this package writes (a compiled model, a cached kernel module) ends with a
trailer of 80 bytes after the ELF image, and may hold a note between the two:

    [note  its length (8 bytes, little-endian)  b"HLATVMNT"]
    b"HLATVMSL"  tag (32 bytes)  sha256 of every byte before the trailer (32 bytes)  b"HLATVMEN"

`tag` is what the file must be: the sha256 of a cache entry's spec, or zeros for a model. A
compiled model's note is its metadata, read by `note` without loading the library (so a module
for a GPU or for another CPU architecture is described on any machine).
The dynamic loader ignores bytes past the ELF image, so a sealed file loads as any other.
`check` runs before the loader sees a file: a truncated library would otherwise be mapped past
its end and kill the process with SIGBUS on first use, and flipped bytes would load and compute
wrong answers. It needs only the standard library (the runtime-only path uses it)."""
from __future__ import annotations

import errno
import functools
import hashlib
import math
import os
import shutil
import stat
import struct
import sys
import tempfile
import threading

HEAD, TAIL = b"HLATVMSL", b"HLATVMEN"
NOTE = b"HLATVMNT"
TRAILER = len(HEAD) + 32 + 32 + len(TAIL)
NO_TAG = bytes(32)
_ELF_MAGIC = b"\x7fELF"


# ELF e_machine -> architecture name (as `uname -m` prints it)
ELF_MACHINES = {62: "x86_64", 183: "aarch64", 40: "arm", 243: "riscv64"}


def elf_machine_code(path):
    """The ELF e_machine code of the file at `path`; ValueError for files that are not ELF."""
    with open(path, "rb") as f:
        head = f.read(20)
    if len(head) < 20 or head[:4] != _ELF_MAGIC:
        raise ValueError(f"{path}: not a shared library (no ELF header)")
    return int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")


def machine_name(code):
    """The architecture of ELF e_machine `code`, as `uname -m` names it."""
    return ELF_MACHINES.get(code, f"machine {code}")


def elf_machine(path):
    """The architecture an ELF shared library at `path` is built for (`machine_name`);
    ValueError for files that are not ELF."""
    return machine_name(elf_machine_code(path))


@functools.lru_cache(maxsize=None)
def host_machine_code():
    """The ELF e_machine code of this process's own executable (what a library must be built
    for to load here), or None where it cannot be read."""
    for exe in ("/proc/self/exe", os.path.realpath(sys.executable)):
        try:
            return elf_machine_code(exe)
        except (OSError, ValueError):
            continue
    return None


def tag_of(text: str) -> bytes:
    """The 32-byte tag for `text` (sha256)."""
    return hashlib.sha256(text.encode()).digest()


def _digest(f, size):
    """sha256 of the first `size` bytes of the open file `f`."""
    h = hashlib.sha256()
    f.seek(0)
    left = size
    while left:
        block = f.read(min(left, 1 << 20))
        if not block:
            break
        h.update(block)
        left -= len(block)
    return h.digest()


def seal(path, tag: bytes = NO_TAG):
    """Append the trailer (tag and checksum) to the library at `path`, in place."""
    if len(tag) != 32:
        raise ValueError("tag must be 32 bytes")
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        digest = _digest(f, size)
        f.seek(size)
        f.write(HEAD + tag + digest + TAIL)


def export(exe, path, tag: bytes = NO_TAG, cc=None, note: bytes | None = None):
    """Write the library of `exe` (a TVM executable or module) to `path`, sealed with `tag`
    (and holding `note`, when given): into a temporary file beside it, then renamed over `path`
    (never rewritten in place, which would kill processes that have the old file mapped).
    cc: the C compiler command that links it (None: the host's; a cross compiler for another
    architecture). The object files go to a temporary folder beside `path` (one filesystem to
    hold everything; removed after, and swept when a process was killed meanwhile), after a
    check that it has room for them: LLVM ends the process (exit 1, no exception) when it
    cannot write an object file. A full disk is an OSError (ENOSPC) naming `path`."""
    # what writing a library (paths) and TVM need is imported where used: `import hla_tvm.runtime`
    # stays light and loads no TVM library
    from .paths import finishing, replacing_path, temporary_folder

    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        with replacing_path(path, suffix=".so", executable=True) as tmp, \
                temporary_folder(path) as work:
            _room(exe, folder, path)
            try:
                with finishing():   # (SIGTERM waits for the linker: see `paths.finishing`)
                    _export_library(exe, tmp, cc, work)
            except RuntimeError as err:   # (the linker's output, in TVM's error)
                full = next((e for e, text in _FULL.items() if text in str(err)), None)
                if full is None:
                    raise
                raise OSError(full, os.strerror(full)) from None
            if note is not None:
                with open(tmp, "ab") as f:
                    f.write(bytes(note) + struct.pack("<Q", len(note)) + NOTE)
            seal(tmp, tag)
    except OSError as err:
        if err.errno not in _FULL or err.filename == path:   # (not full; or said already)
            raise
        free = _free(folder)
        raise OSError(err.errno, f"{os.strerror(err.errno)} writing the compiled module"
                      + ("" if free is None else f" ({free / 1e6:.1f} MB free in {folder})"),
                      path) from None
    return path


def _export_library(exe, tmp, cc, work):
    if cc is None:
        exe.export_library(tmp, workspace_dir=work)
    else:
        from tvm.support import cc as tvm_cc

        exe.export_library(tmp, fcompile=tvm_cc.cross_compiler(cc), workspace_dir=work)


# errno -> the text a linker prints for it
_FULL = {errno.ENOSPC: os.strerror(errno.ENOSPC), errno.EDQUOT: os.strerror(errno.EDQUOT)}


def _free(folder):
    """Bytes this user may still write in `folder`'s filesystem (None where unknown)."""
    try:
        st = os.statvfs(folder)
        return st.f_bavail * st.f_frsize
    except OSError:
        return None


def _room(exe, folder, path):
    """OSError (ENOSPC) naming `path` unless `folder` has room for the object files of `exe`
    (what LLVM writes; a linker that finds no room fails with an error): a third of its LLVM
    IR's text (measured 3.4 to 3.7 times the object file) and its packed imports (the module's
    constants and device code)."""
    import tvm

    mod = getattr(exe, "mod", exe)
    need = 1 << 18
    try:
        for lib in mod._collect_dso_modules():
            if lib.kind == "llvm":
                need += len(lib.inspect_source("ll")) // 3
        pack = tvm.get_global_func("runtime.ModulePackImportsToTensor", allow_missing=True)
        if pack is not None and mod.imports:
            need += math.prod(pack(mod).shape)
    except Exception:  # noqa: BLE001 - an estimate: none where TVM cannot say
        return
    free = _free(folder)
    if free is not None and free < need:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} for the compiled module: "
                      f"{free / 1e6:.1f} MB free in {folder}, about {need / 1e6:.1f} MB needed",
                      path)


def check(path, tag: bytes | None = None, what="compiled module"):
    """Raise ValueError naming `path` unless it is a whole, unmodified sealed ELF library
    (with `tag`, when given). Returns the sha256 of its image (bytes)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            return _checked(f, path, tag, what)[0]
    except OSError as err:
        raise ValueError(f"{path}: cannot read the {what} ({err.strerror or err})") from None


def _checked(f, path, tag, what):
    """`check` of the library open as `f`: (sha256 of its image, bytes before the trailer, end
    of its ELF content)."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(64)
    f.seek(max(0, size - TRAILER))
    trailer = f.read(TRAILER)
    if len(head) < 4 or head[:4] != _ELF_MAGIC:
        kind = "a PyTorch checkpoint" if head[:2] == b"PK" and str(path).endswith(
            (".pt", ".pth")) else "an ONNX model" if str(path).endswith(".onnx") else None
        hint = f"; {kind}: `hla-tvm compile` makes a module of it" if kind else ""
        raise ValueError(f"{path}: not a {what} (no ELF shared-library header){hint}")
    if size < 64 + TRAILER or trailer[:len(HEAD)] != HEAD or trailer[-len(TAIL):] != TAIL:
        _check_elf(f, path, head, size, what)
        raise ValueError(f"{path}: the {what} has no hla_tvm checksum trailer (truncated, or not "
                         f"written by this version of hla_tvm; {size} bytes); compile it again")
    image = size - TRAILER
    elf_end = _check_elf(f, path, head, image, what)
    got_tag = trailer[len(HEAD):len(HEAD) + 32]
    want_sum = trailer[len(HEAD) + 32:len(HEAD) + 64]
    if _digest(f, image) != want_sum:
        raise ValueError(f"{path}: the {what} is corrupt (its sha256 does not match the checksum "
                         "recorded when it was written); compile it again")
    if tag is not None and got_tag != tag:
        raise ValueError(f"{path}: the {what} was built for other options than its name says "
                         "(spec digest mismatch)")
    return want_sum, image, elf_end


def note(path, what="compiled module"):
    """The note of the library at `path` (bytes), or None for one written without a note;
    ValueError, as `check`, for a file that is not a whole, unmodified sealed library. The
    file is checked and read through one open handle (a library replaced meanwhile is read
    whole, old or new)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            _, image, elf_end = _checked(f, path, None, what)
            f.seek(max(0, image - 16))
            tail = f.read(16)
            if len(tail) < 16 or tail[8:] != NOTE:
                return None
            (size,) = struct.unpack("<Q", tail[:8])
            if image - 16 - size < elf_end:   # (not a note: it would overlap the ELF content)
                raise ValueError(f"{path}: the {what}'s note is malformed ({size} bytes "
                                 "recorded)")
            f.seek(image - 16 - size)
            return f.read(size)
    except OSError as err:
        raise ValueError(f"{path}: cannot read the {what} ({err.strerror or err})") from None


def trusted_folder(path, what="compiled module"):
    """ValueError when any user could have put the library at `path` there: the file writable
    by everyone, or its folder writable by everyone without the sticky bit (with it, as in
    /tmp, only a file's owner may replace it: the file must then be this user's or root's).
    The checks of `check` cover damage, not a file written on purpose by someone who may write
    the folder; this one refuses the folders where anyone may."""
    real = os.path.realpath(path)
    st, folder = os.stat(real), os.path.dirname(real)
    dst = os.stat(folder)
    mine = st.st_uid in (os.getuid(), 0)
    if st.st_mode & stat.S_IWOTH:
        why = f"the file is writable by every user (mode {stat.S_IMODE(st.st_mode):o})"
    elif dst.st_mode & stat.S_IWOTH and not (dst.st_mode & stat.S_ISVTX and mine):
        why = (f"its folder {folder} is writable by every user (mode "
               f"{stat.S_IMODE(dst.st_mode):o})" + (", and the file is another user's"
                                                   if dst.st_mode & stat.S_ISVTX else ""))
    else:
        return path
    raise ValueError(f"{path}: refusing to load this {what}: {why}, so anyone could have put "
                     "it there and its code would run in this process; move it to a folder of "
                     "your own")


_LOADED: dict = {}
_LOADED_LOCK = threading.Lock()


def load(path, tag: bytes | None = None, what="compiled module"):
    """`tvm.runtime.load_module` of the checked library at `path` (`check`, `trusted_folder`).

    The dynamic loader hands back the library already loaded under a path, even after the file
    was replaced: a module compiled again to the same path would silently run the old code. A
    path whose content changed since this process loaded it, or whose name does not end in .so,
    is loaded under another name (a hard link beside it, else a copy; TVM resolves symbolic
    links), removed once mapped."""
    import tvm

    digest = check(path, tag, what)
    trusted_folder(path, what)
    code, host = elf_machine_code(path), host_machine_code()
    if host is not None and code != host:
        raise ValueError(f"{path}: built for {machine_name(code)}, not for this machine's "
                         "architecture: run it there (`hla-tvm bundle` packs it with that "
                         "architecture's runtime)")
    real = os.path.realpath(path)
    with _LOADED_LOCK:
        seen = _LOADED.get(real)
        alias = None
        if (seen is not None and seen != digest) or not real.endswith(".so"):
            alias = _alias(real, digest)   # (TVM picks its loader by the name's ending)
        try:
            lib = tvm.runtime.load_module(alias or real)
        except Exception as err:
            raise ValueError(f"{path}: not a loadable TVM module ({err})") from None
        finally:
            if alias:   # the mapping outlives the name
                os.remove(alias)
                if os.path.dirname(alias) != os.path.dirname(real):
                    os.rmdir(os.path.dirname(alias))
        _LOADED[real] = digest
    return lib


def _alias(real, digest):
    """A new name for the file `real`: a hard link in its folder, else a copy in a temp folder."""
    name = f".{os.path.basename(real)}.{digest.hex()[:16]}.{os.getpid()}.so"
    alias = os.path.join(os.path.dirname(real), name)
    try:
        if os.path.lexists(alias):
            os.remove(alias)
        os.link(real, alias)
        return alias
    except OSError:
        alias = os.path.join(tempfile.mkdtemp(prefix="hla_tvm_lib_"), name)
        shutil.copyfile(real, alias)
        return alias


def _check_elf(f, path, head, image, what):
    """The ELF header, program headers and section table (of the library open as `f`) must lie
    within the image; returns where the last of them, or of the segments, ends."""
    if len(head) < 64 or head[4] not in (1, 2) or head[5] not in (1, 2):
        raise ValueError(f"{path}: not a {what} (malformed ELF header)")
    end = "<" if head[5] == 1 else ">"
    if head[4] == 2:   # 64-bit
        phoff, shoff = struct.unpack_from(end + "QQ", head, 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(end + "HHHH", head, 54)
        ph_fmt, ph_off, ph_fsz = end + "IIQQQQQQ", 2, 5
    else:
        phoff, shoff = struct.unpack_from(end + "II", head, 28)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(end + "HHHH", head, 42)
        ph_fmt, ph_off, ph_fsz = end + "IIIIIIII", 1, 4
    if phoff + phentsize * phnum > image or shoff + shentsize * shnum > image:
        raise ValueError(f"{path}: the {what} is truncated (its ELF tables end past the "
                         f"{image}-byte image)")
    if phentsize < struct.calcsize(ph_fmt):
        raise ValueError(f"{path}: not a {what} (malformed ELF program headers)")
    f.seek(phoff)
    table = f.read(phentsize * phnum)
    last = max(64, phoff + phentsize * phnum, shoff + shentsize * shnum)
    for i in range(phnum):
        fields = struct.unpack_from(ph_fmt, table, i * phentsize)
        if fields[ph_off] + fields[ph_fsz] > image:
            raise ValueError(f"{path}: the {what} is truncated (segment {i} ends past the "
                             f"{image}-byte image)")
        last = max(last, fields[ph_off] + fields[ph_fsz])
    return last
