"""Named stream states kept between requests: a folder of state files (`CompiledModel.save_state`:
the state's entries, the digest of the model they belong to, and the token the stream chose last
but has not fed yet), checked when read (`load_state`: names, shapes, finite values, the model;
each entry's header before its data, the batch 1),
with a count and a size limit and least-recently-used eviction. Several servers (replicas) may
share one folder: each file is written whole through a temporary name and renamed. The
temporaries of saves that were interrupted (a server killed mid-save) are swept when the store
opens and at each save (`paths.sweep`: this user's, unlocked, untouched for a few minutes),
and those of saves in progress count towards the size limit."""
from __future__ import annotations

import os
import re
import threading

from ..runtime import paths

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SUFFIX = ".state.npz"


class UnknownSession(KeyError):
    """No session of that name (evicted, or never saved)."""

    def __str__(self):
        return str(self.args[0])


def check_name(name, what="session"):
    """`name` when it is a session name (letters, digits, '.', '_', '-'; 1 to 128 characters,
    starting with a letter or digit); ValueError otherwise."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{what} must be a name of 1 to 128 letters, digits, '.', '_' or '-' "
                         f"(starting with a letter or digit), got {name!r}")
    return name


class SessionStore:
    """Session files of `model` in `folder` (created if missing): at most `max_count` of them
    and `max_bytes` in all (None: no limit); the least recently saved or loaded go first."""

    def __init__(self, folder, model, max_count=1000, max_bytes=None):
        for what, value in (("max_count", max_count), ("max_bytes", max_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{what} must be a positive int or None, got {value!r}")
        self.folder = os.path.abspath(os.fspath(folder))
        os.makedirs(self.folder, exist_ok=True)
        if not os.path.isdir(self.folder):
            raise ValueError(f"sessions folder {self.folder} is not a folder")
        self.model, self.max_count, self.max_bytes = model, max_count, max_bytes
        self._lock = threading.Lock()
        paths.sweep(self.folder)   # (what saves killed midway left)

    def path(self, name):
        return os.path.join(self.folder, check_name(name) + SUFFIX)

    def save(self, name, state, pending=()):
        """Keep the batch-1 `state` (and the `pending` token ids) under `name`, replacing an
        earlier one; then evict beyond the limits (never the one just saved)."""
        path = self.path(name)
        self.model.save_state(state, path, pending=pending)
        with self._lock:
            self._evict(keep=path)

    def load(self, name):
        """(state, pending token ids) of session `name`; UnknownSession when there is none,
        ValueError when its file is not a valid state of this model."""
        path = self.path(name)
        if not os.path.isfile(path):
            raise UnknownSession(f"no session named {name!r}")
        try:
            state = self.model.load_state(path, batch=1)   # (headers checked before data)
            pending = self.model.pending_tokens(path)
        except ValueError as err:
            raise ValueError(f"session {name!r} is not usable: "
                             f"{str(err).replace(path + ': ', '')}") from None
        try:
            os.utime(path)   # (recently used: evicted last)
        except OSError:
            pass
        return state, pending

    def names(self):
        """The stored session names, most recently used first."""
        return [os.path.basename(p)[:-len(SUFFIX)] for p, _, _ in self._files()]

    def _files(self):
        out = []
        with os.scandir(self.folder) as it:
            for e in it:
                if e.name.endswith(SUFFIX) and NAME.fullmatch(e.name[:-len(SUFFIX)]):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    out.append((e.path, st.st_mtime, st.st_size))
        return sorted(out, key=lambda f: -f[1])

    def _evict(self, keep):
        paths.sweep(self.folder)
        files = self._files()
        # (the temporaries of saves in progress, here or in another replica, take room too)
        total = sum(f[2] for f in files) + sum(size for _, size, _, _ in
                                               paths.temporaries(self.folder))
        for i in range(len(files) - 1, -1, -1):
            over = (self.max_count is not None and i >= self.max_count) or \
                (self.max_bytes is not None and total > self.max_bytes)
            if not over:
                break
            path, _, size = files[i]
            if path == keep:
                continue
            try:
                os.remove(path)
                total -= size
            except OSError:
                pass
