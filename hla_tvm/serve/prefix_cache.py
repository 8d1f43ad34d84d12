"""States of token prefixes served before, so that a prompt starting with one resumes there and
prefills only the rest: a recurrent state is a few hundred kilobytes at any length, so a state
can be kept at any token position (not only at block boundaries).

    cache = PrefixCache(max_bytes)
    cache.put(ids, state, logits)      # the batch-1 state after the tokens `ids` (copied), and
                                       # the logits [vocab] of their last position (or None)
    hit = cache.longest(ids, need_logits=True)   # (length, state copy, logits) or None

An entry is found by the length of its prefix and a digest of its tokens (BLAKE2b of the int32
ids), then checked token by token: a hit is exact. The longest cached prefix of `ids` wins; one
as long as `ids` itself only with its logits (they choose the next token). The least recently
used entries go first when the bytes (states, logits and ids) pass `max_bytes`."""
from __future__ import annotations

import collections
import hashlib
import threading

import numpy as np


def _key(ids):
    arr = np.asarray(ids, np.int32)
    return len(arr), hashlib.blake2b(arr.tobytes(), digest_size=16).digest()


class PrefixCache:
    def __init__(self, max_bytes):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries = collections.OrderedDict()   # key -> (ids, state, logits, bytes)
        self.lengths = collections.Counter()       # prefix lengths cached, with their counts
        self.hits = self.misses = self.tokens_saved = 0
        self._lock = threading.Lock()

    def __len__(self):
        return len(self.entries)

    def put(self, ids, state, logits=None):
        """Keep copies of `state` (batch-1 arrays) and `logits` after the tokens `ids`."""
        if not len(ids):
            return
        ids = np.asarray(ids, np.int32)
        state = [np.array(x, copy=True) for x in state]
        logits = None if logits is None else np.array(logits, np.float32, copy=True)
        size = sum(x.nbytes for x in state) + ids.nbytes + \
            (0 if logits is None else logits.nbytes)
        if size > self.max_bytes:
            return
        key = _key(ids)
        with self._lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self.bytes -= old[3]
                self.lengths[key[0]] -= 1
                if logits is None:   # (keep the logits an entry had)
                    logits = old[2]
            self.entries[key] = (ids, state, logits, size)
            self.lengths[key[0]] += 1
            self.bytes += size
            while self.bytes > self.max_bytes:
                gone, (_, _, _, n) = self.entries.popitem(last=False)
                self.bytes -= n
                self.lengths[gone[0]] -= 1
                if not self.lengths[gone[0]]:
                    del self.lengths[gone[0]]

    def longest(self, ids, need_logits=True):
        """(length, copy of the state, logits or None) of the longest cached prefix of `ids`
        (all of `ids` only where its logits are kept, when `need_logits`), or None."""
        ids = np.asarray(ids, np.int32)
        with self._lock:
            for length in sorted((n for n in self.lengths if n <= len(ids)), reverse=True):
                entry = self.entries.get(_key(ids[:length]))
                if entry is None or not np.array_equal(entry[0], ids[:length]):
                    continue
                if length == len(ids) and need_logits and entry[2] is None:
                    continue
                self.entries.move_to_end(_key(ids[:length]))
                self.hits += 1
                self.tokens_saved += length
                return length, [x.copy() for x in entry[1]], entry[2]
            self.misses += 1
        return None
