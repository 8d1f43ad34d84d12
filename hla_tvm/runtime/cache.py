"""The cache folder: where it is, what in it is the cache's own, and who may write it.

    ~/.cache/hla_tvm/   ($HLA_TVM_CACHE_DIR, else $XDG_CACHE_HOME/hla_tvm)
      <kind>-<24 hex>.so          compiled kernel modules (`build.load_or_build`)
      models/demo-<20 hex>.so     the demo's compiled model (`demo.compiled_module`)
      device/<sha256>-<sm>.fatbin CUDA device code and its .sha256 (`device_code.store`)
      emulator/<24 hex>.so        emulated CUDA kernels (`tools.cuda_emulator`)
      runtime/<arch>-tvm...       TVM runtimes of other architectures (`bundle`)
      checked/<sha256>            records files read without fault (`records.CHECKED`)
      schedules/<target>/         the user's tuned records (`hla-tvm tune`): not a cache

Libraries in the cache are loaded into the process, so the folder is created private (mode
0700) and refused (`private`) when another user could write it: a library planted there would
run its code in every process that uses the cache. `clear` removes the cache's own files only,
never another file in the folder, and keeps the tuned records unless told. Torch-free."""
from __future__ import annotations

import os
import re
import shutil
import stat

from .paths import TMP_PREFIX

RECORDS = "schedules"
_TMP = re.escape(TMP_PREFIX) + r".+"
# the cache's own names: {folder ("" for the top): (pattern of files, pattern of folders)};
# temporaries of writes (`paths`): a library's files and the folder of its object files
_OWN = {
    "": (rf"[A-Za-z0-9_]+-[0-9a-f]{{24}}\.so|\..+\.[0-9a-f]{{16}}\.[0-9]+\.so|{_TMP}", _TMP),
    "models": (rf"demo-[0-9a-f]{{20}}\.so|\..+\.[0-9a-f]{{16}}\.[0-9]+\.so|{_TMP}", _TMP),
    "device": (rf"[0-9a-f]{{64}}-[A-Za-z0-9_-]+\.fatbin(\.sha256)?|{_TMP}", None),
    "emulator": (rf"[0-9a-f]{{24}}\.so|{_TMP}", None),
    "runtime": (None, r"[A-Za-z0-9_]+-tvm.+-ffi.+|tmp[A-Za-z0-9_]+"),
    "checked": (rf"[0-9a-f]{{64}}|{_TMP}", None),
}


def root():
    """$HLA_TVM_CACHE_DIR, else $XDG_CACHE_HOME/hla_tvm, else ~/.cache/hla_tvm; ValueError
    naming the variable when $HLA_TVM_CACHE_DIR is a file."""
    env = os.environ.get("HLA_TVM_CACHE_DIR")
    if env:
        if os.path.exists(env) and not os.path.isdir(env):
            raise ValueError(f"HLA_TVM_CACHE_DIR={env} is a file, not a folder")
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hla_tvm")


def others_may_write(path):
    """Why another user could replace files in the folder `path` (a few words), or None: it is
    owned by another user (not root), or writable by its group or by everyone."""
    st = os.stat(path)
    if st.st_uid not in (os.getuid(), 0):
        return f"it belongs to another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"its group or everyone may write it (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def private(path, what="the cache folder"):
    """`path` (a folder that exists) unless another user may write it (`others_may_write`):
    ValueError naming it and the fix."""
    why = others_may_write(path)
    if why:
        raise ValueError(f"{what} {path} is not private: {why}; its libraries are loaded into "
                         f"this process, so a file planted there would run here. Make it "
                         f"yours alone (chmod 700 {path}) or point HLA_TVM_CACHE_DIR at "
                         "another folder")
    return path


def folder(sub=None):
    """The cache folder (or its subfolder `sub`), created with mode 0700 when missing and
    checked private (`private`)."""
    top = root()
    path = top if sub is None else os.path.join(top, sub)
    if not os.path.isdir(path):
        for where in (top, path):   # (makedirs gives only the last folder the mode)
            os.makedirs(where, mode=0o700, exist_ok=True)
    private(top)
    if path != top:
        private(path)
    return path


def _own(kind, name, is_dir):
    files, dirs = _OWN.get(kind, (None, None))
    pattern = dirs if is_dir else files
    return pattern is not None and re.fullmatch(pattern, name) is not None


def _scan(top):
    """(path, kind, whether it is the cache's own) of every entry in the cache folder `top`
    and in its own subfolders (the subfolders themselves and the records folder aside; links
    to folders are not followed)."""
    for kind in _OWN:
        where = os.path.join(top, kind) if kind else top
        if not os.path.isdir(where) or (kind and os.path.islink(where)):
            continue
        for name in sorted(os.listdir(where)):
            if not kind and (name in _OWN or name == RECORDS):
                continue
            full = os.path.join(where, name)
            is_dir = os.path.isdir(full) and not os.path.islink(full)
            yield full, kind or "kernels", _own(kind, name, is_dir)


def entries(records=False):
    """[(path, kind)] of the cache's own files and folders: kind is "kernels", "models",
    "device", "emulator", "runtime", or (with `records`) "records" for the user's tuned
    records folders; nothing else in the folder is listed."""
    top = root()
    if not os.path.isdir(top):
        return []
    found = [(path, kind) for path, kind, own in _scan(top) if own]
    rec = os.path.join(top, RECORDS)
    if records and os.path.isdir(rec) and not os.path.islink(rec):
        found += [(os.path.join(rec, name), "records") for name in sorted(os.listdir(rec))]
    return found


def others():
    """Paths in the cache folder that are not the cache's own (`entries`, the records folder
    included): left alone by `clear`."""
    top = root()
    return [path for path, _, own in _scan(top) if not own] if os.path.isdir(top) else []


def size(path):
    """Bytes of a file, or of the files in a folder; 0 for a file gone meanwhile (another
    process's write in progress, or its load link, removed right after use)."""
    if not os.path.isdir(path) or os.path.islink(path):
        return _lstat_size(path)
    return sum(_lstat_size(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _lstat_size(path):
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


def clear(records=False):
    """Remove the cache's own files and folders (`entries`), and with `records` the user's
    tuned records too; other files in the folder stay, and so do the subfolders that still
    hold some. Returns [(path, kind)] of what was removed."""
    removed = []
    for path, kind in entries(records=records):
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        except FileNotFoundError:   # (another process removed it first)
            continue
        removed.append((path, kind))
    top = root()
    for kind in [k for k in _OWN if k] + ([RECORDS] if records else []):
        sub = os.path.join(top, kind)
        if os.path.isdir(sub) and not os.path.islink(sub) and not os.listdir(sub):
            os.rmdir(sub)
    return removed
