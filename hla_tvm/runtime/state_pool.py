"""Many streams advanced together by one compiled module: `StatePool` keeps the states of the
active streams as the leading rows of one batch state of `capacity` rows, so a decode step is the
module's decode entry over views of rows 0..n-1, advanced in place (no state is copied). A stream
that joins is copied into row n; one that leaves takes the last row's state into its row (one
stream's state copied), so the active rows stay a prefix:

    pool = StatePool(model, capacity)
    row = pool.add(state)           # a one-sequence state (batch 1, from prefill) -> its row
    logits = pool.decode(tokens)    # tokens [n]: row i advanced by tokens[i]; logits [n, vocab]
    state = pool.get(row)           # a batch-1 copy of a row's state (to save it)
    moved = pool.remove(row)        # the row whose stream now lives in `row`, or None

A row's results do not depend on the other rows: the kernels compute each batch row alone, so a
stream decodes the same tokens alone or among others (`tests/test_serve_engine.py` checks it).
One thread drives a pool (the serving engine's)."""
from __future__ import annotations

import numpy as np

from .model import leading_rows


class StatePool:
    """States of up to `capacity` streams of the CPU module `model` (`runtime.load`)."""

    def __init__(self, model, capacity):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if model.on_gpu:
            raise NotImplementedError("a state pool runs modules on a CPU; this one was loaded "
                                      "on a GPU")
        self.model, self.capacity, self.n = model, capacity, 0
        self.rows = model.init_state(capacity)   # (checks max_batch against the capacity)
        self._views = None   # what the last step returned: passed again, it is checked already

    def add(self, state):
        """Copy the batch-1 `state` into the next free row; returns the row."""
        if self.n >= self.capacity:
            raise ValueError(f"the pool is full ({self.capacity} streams)")
        for (name, shape, _), pool, x in zip(self.model.state_spec, self.rows, state):
            x = np.asarray(x)
            if x.shape != (1, *shape):
                raise ValueError(f"state entry {name} must have shape [1, "
                                 f"{', '.join(map(str, shape))}], got {list(x.shape)}")
            pool[self.n] = x[0]
        self.n += 1
        return self.n - 1

    def get(self, row):
        """A batch-1 copy of the state in `row`."""
        self._check_row(row)
        return [np.ascontiguousarray(x[row:row + 1]) for x in self.rows]

    def remove(self, row):
        """Free `row`: the last active row's state moves into it. Returns the row that moved
        (now `row`), or None when `row` was the last."""
        self._check_row(row)
        last = self.n - 1
        if row != last:
            for x in self.rows:
                x[row] = x[last]
        self.n -= 1
        return last if row != last else None

    def decode(self, tokens):
        """Advance rows 0..n-1 by one token each (`tokens` [n] int); their logits [n, vocab]."""
        tokens = np.asarray(tokens)
        if tokens.shape != (self.n,):
            raise ValueError(f"tokens must have shape [{self.n}] (one per active row), got "
                             f"{list(tokens.shape)}")
        views = self._views if self._views is not None and len(self._views[0]) == self.n \
            else leading_rows(self.rows, self.n)
        logits, new = self.model.decode(tokens, views)
        for view, x in zip(views, new):   # entries a kernel returned as new arrays
            if x is not view:
                view[...] = x
        self._views = new if all(x is v for x, v in zip(new, views)) else None
        return logits

    def _check_row(self, row):
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or \
                not 0 <= row < self.n:
            raise ValueError(f"row must be an active row in [0, {self.n}), got {row!r}")
