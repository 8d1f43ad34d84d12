"""Tuned schedule records: where they live, reading them, and applying one to a kernel.

A records folder is a meta_schedule JSON database (`database_workload.json`,
`database_tuning_record.json`, each plain or xz-compressed as `<name>.xz`: the shipped folders
keep them compressed, about 30x smaller) holding, per kernel, its best tuned schedule where
that beat the default by `tune.MARGIN`, else its default schedule. A workload is the kernel
specialized to the tuning shape (`TUNE_SHAPE`: the shapes a prefill or decode of that size
calls it with, `chain_shapes`; a model's projections at batch 1 and that length,
`model.matmuls`); the record's trace replays on the kernel with symbolic batch, heads and
length, so one record serves every shape. Folders are per target (`target_folder`): the shipped
`schedules/<target>/` (`package_root`) and the user's `~/.cache/hla_tvm/schedules/<target>/`
(`hla-tvm tune` writes there by default).

schedules= on the API and the CLI: "auto" (the records for the target where they exist, else
the default schedules), "default", or the path of a records folder."""
from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings

from .. import register_intrinsics
from ..shapes import TUNE_SHAPE, chain_shapes, specialize, tuning_kernels  # noqa: F401  (shapes.py)

SHAPES_ATTR = "hla_tvm.tune_shapes"   # a model's kernel: its argument shapes at TUNE_SHAPE (JSON)
FILES = ("database_workload.json", "database_tuning_record.json")
PACKED = ".xz"   # a file of FILES stored xz-compressed (`pack`); the plain one wins where both are


def stored(path, name):
    """The file that holds `name` (one of FILES) in the records folder `path`: the plain file,
    else its packed form, else None."""
    for candidate in (name, name + PACKED):
        file = os.path.join(path, candidate)
        if os.path.isfile(file):
            return file
    return None


def _contents(file):
    """The bytes of a records file, decompressed where it is packed; ValueError naming it when
    its compression is damaged."""
    import lzma

    with open(file, "rb") as f:
        data = f.read()
    if not file.endswith(PACKED):
        return data
    try:
        return lzma.decompress(data)
    except lzma.LZMAError as err:
        raise ValueError(f"{file}: not a readable xz file ({err}); delete the folder or tune "
                         "again") from None


def pack(path):
    """Store the records folder `path`'s files xz-compressed (`<name>.xz`, the plain ones
    removed), as the shipped folders keep them."""
    import lzma

    from ...runtime.paths import replacing

    for name in FILES:
        plain = os.path.join(path, name)
        if os.path.isfile(plain):
            with open(plain, "rb") as f:
                data = lzma.compress(f.read(), preset=9 | lzma.PRESET_EXTREME)
            with replacing(plain + PACKED, "wb") as f:
                f.write(data)
            os.remove(plain)


def unpack(path):
    """Write the plain file of each of FILES that `path` holds packed only (meta_schedule's
    JSONDatabase, which `hla-tvm tune` adds its records to, reads plain files): the folder's
    records are kept when tuning writes into it."""
    from ...runtime.paths import replacing

    for name in FILES:
        plain = os.path.join(path, name)
        if not os.path.isfile(plain) and os.path.isfile(plain + PACKED):
            data = _contents(plain + PACKED)
            with replacing(plain, "wb") as f:
                f.write(data)


def target_folder(target):
    """The records folder name of `target`: kind, CPU model and cores, e.g. llvm-znver3-2c."""
    parts = [target.kind.name]
    for key, fmt in (("mcpu", "{}"), ("arch", "{}"), ("num-cores", "{}c")):
        value = target.attrs.get(key)
        if value:
            parts.append(fmt.format(value))
    return "-".join(str(p) for p in parts)


def user_root():
    """~/.cache/hla_tvm/schedules (under $HLA_TVM_CACHE_DIR when set)."""
    from ...runtime import cache

    return os.path.join(cache.root(), cache.RECORDS)


def package_root():
    """The shipped records: `hla_tvm/_schedules/` in an installed wheel (setup.py copies the
    checkout's folder there), else the checkout's top-level `schedules/` folder."""
    here = os.path.abspath(__file__)   # hla_tvm/schedule/tuning/records.py
    pkg = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    wheel = os.path.join(pkg, "_schedules")
    return wheel if os.path.isdir(wheel) else os.path.join(os.path.dirname(pkg), "schedules")


def resolve(schedules, target):
    """The records folder `schedules` names for `target`, or None for the default schedules.
    "auto": the user's folder for the target, else the package's, else None; "default": None;
    a path: that folder (ValueError when it holds no database)."""
    if schedules is None or schedules == "default":
        return None
    if not isinstance(schedules, (str, os.PathLike)):
        raise TypeError(f"schedules must be 'auto', 'default' or a path, got "
                        f"{type(schedules).__name__}")
    if schedules == "auto":
        for root in (user_root(), package_root()):
            path = os.path.join(root, target_folder(target))
            if all(stored(path, f) for f in FILES):
                return path
        return None
    path = os.fspath(schedules)
    missing = [f for f in FILES if not stored(path, f)]
    if missing:
        raise ValueError(f"schedules={path!r} is not a records folder: it lacks "
                         f"{', '.join(missing)} (write one with hla-tvm tune -o {path})")
    return path


_DATABASES: dict = {}
_FOUND: dict = {}
_LOCK = threading.Lock()


def find(schedules, target):
    """(records folder or None, its digest or None) for schedules= and `target` (`resolve`),
    remembered per process: records written later are seen after `forget()` or a restart."""
    key = (schedules if isinstance(schedules, str) else repr(schedules), str(target))
    hit = _FOUND.get(key)
    if hit is None:
        path = resolve(schedules, target)
        hit = (path, None if path is None else digest(path))
        if path is not None:
            _notice_foreign(path, target)
        with _LOCK:
            _FOUND[key] = hit
    return hit


def _notice_foreign(path, target):
    """A one-line warning when `path` holds records for other CPUs only (they still give
    correct kernels, tuned for another machine)."""
    mine = (target.kind.name, str(target.attrs.get("mcpu", "") or ""))
    seen = set()
    for line in _contents(stored(path, FILES[1])).splitlines():
        try:
            t = json.loads(line)[1][2]
            seen.add((t.get("kind"), str(t.get("mcpu", "") or "")))
        except (ValueError, IndexError, TypeError, AttributeError):
            continue
    if seen and mine not in seen:
        names = ", ".join(sorted("-".join(x for x in t if x) for t in seen))
        warnings.warn(f"hla_tvm: the records in {path} were tuned for {names}, not for this "
                      f"target ({'-'.join(x for x in mine if x)}); they may be slow here")


def display(path):
    """How metadata names a records folder: "shipped:<target>" for the package's own, the path
    under "~" for the user's, else the path as given (None stays None)."""
    if path is None:
        return None
    shipped = os.path.join(package_root(), "")
    if os.path.abspath(path).startswith(shipped):
        return "shipped:" + os.path.relpath(os.path.abspath(path), shipped)
    home = os.path.join(os.path.expanduser("~"), "")
    return "~/" + os.path.relpath(path, home) if os.path.abspath(path).startswith(home) \
        else os.fspath(path)


def forget():
    """Look records folders up again on the next `find` (after tuning wrote new ones)."""
    with _LOCK:
        _FOUND.clear()


def digest(path):
    """sha256 (16 hex digits) of a records folder's files: part of a compiled kernel's cache
    key, so that new records never find a module built with the old ones."""
    h = hashlib.sha256()
    for name in FILES:
        with open(stored(path, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def load(path):
    """The records in `path` as a meta_schedule database (in memory: what its JSONDatabase
    would read from the plain files), each line checked first: ValueError naming the file and
    line when it is truncated or corrupt, or when meta_schedule cannot read it (another TVM);
    read once per process and digest."""
    from tvm.s_tir import meta_schedule as ms

    key = (os.path.abspath(path), digest(path))
    with _LOCK:
        if key in _DATABASES:
            return _DATABASES[key]
    files = [stored(path, name) for name in FILES]
    workloads = _check_lines(files[0], _check_workload)
    records = _check_lines(files[1], lambda x: _check_record(x, len(workloads)))
    register_intrinsics()   # traces that tensorize name them
    db = ms.database.MemoryDatabase()

    def commit(file, values, add):
        for n, value in enumerate(values, 1):
            try:
                add(value)
            except Exception as err:   # records of another TVM version or another layout
                reason = str(err).strip().splitlines()[-1] if str(err).strip() else \
                    type(err).__name__
                raise ValueError(f"{file}:{n}: meta_schedule cannot read this record "
                                 f"({reason}); delete the folder or tune again with this "
                                 "TVM") from None

    found = []
    commit(files[0], workloads, lambda x: found.append(
        db.commit_workload(ms.database.Workload.from_json(x).mod)))
    commit(files[1], records, lambda x: db.commit_tuning_record(
        ms.database.TuningRecord.from_json(x[1], found[x[0]])))
    with _LOCK:
        _DATABASES[key] = db
    return db


def _check_lines(file, check):
    """The records in `file` (one JSON value per line, plain or packed), each passed to
    check(), which returns a reason when it is malformed; ValueError naming the file and line
    otherwise (meta_schedule's reader would crash the process on some malformed records, and on
    a blank line in the tuning records)."""
    values = []
    for n, line in enumerate(_contents(file).splitlines(keepends=True), 1):
        try:
            text = line.decode("utf-8")
            value = json.loads(text) if text.strip() else None
            reason = "a blank line" if not text.strip() else check(value)
        except UnicodeDecodeError as err:
            reason = f"not UTF-8 text: {err.reason}"
        except json.JSONDecodeError as err:
            reason = str(err)
        if reason:
            raise ValueError(f"{file}:{n}: not a meta_schedule record ({reason}); delete "
                             "the folder or tune again")
        values.append(value)
    return values


def _check_workload(x):
    import base64
    import binascii

    if not (isinstance(x, list) and len(x) == 2 and all(isinstance(y, str) for y in x)
            and x[0].isdigit()):
        return "a workload is [structural hash, module]"
    try:
        base64.b64decode(x[1], validate=True)
    except binascii.Error as err:
        return f"its module is not base64: {err}"
    return None


def _check_record(x, workloads):
    if not (isinstance(x, list) and len(x) == 2 and isinstance(x[0], int)
            and isinstance(x[1], list) and len(x[1]) == 4):
        return "a record is [workload index, [trace, run seconds, target, arguments]]"
    trace, secs, target, args = x[1]
    if not 0 <= x[0] < workloads:
        return f"workload index {x[0]} of {workloads} workloads"
    if not (isinstance(trace, list) and isinstance(secs, list) and isinstance(target, dict)
            and isinstance(args, list) and "kind" in target
            and all(isinstance(t, (int, float)) for t in secs)):
        return "a record is [workload index, [trace, run seconds, target, arguments]]"
    return None


def workload(func, shapes):
    """The meta_schedule workload module of a kernel: specialized, its function named main and
    marked noalias, as tune_tir normalizes a task (records are found by structural hash), without
the Relax fusion attribute a model's copy carries."""
    import tvm

    func = specialize(func, shapes).with_attr("global_symbol", "main")
    if func.attrs and "op_pattern" in func.attrs:   # set on a model's functions by legalize
        func = func.without_attr("op_pattern")
    return tvm.IRModule({"main": func.with_attr("tirx.noalias", True)})


def pick(kernels, db, target, *, quiet=(), path=None):
    """{name: PrimFunc} for kernels {name: (PrimFunc, argument shapes at TUNE_SHAPE)}: each one
    scheduled from its record in `db` and marked `schedule.TUNED`, or as given (for the default
    rules) where db is None or holds no record for it; a one-line notice names the kernels
    (but those in `quiet`) left to the default schedules when db, read from the folder `path`,
    holds records, unless the folder is the package's own (shipped records cover the shapes
    they were tuned at; any other shape's default schedule is what the user asked for)."""
    from .. import TUNED

    out, missing = {}, []
    for name, (func, shapes) in kernels.items():
        t = None if db is None else tuned(func, shapes, db, target)
        out[name] = func if t is None else t.with_attr(TUNED, True)
        if t is None and name not in quiet:
            missing.append(name)
    shipped = path is not None and display(path).startswith("shipped:")
    if db is not None and missing and not shipped:
        names = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        where = "" if path is None else f" in {path}"
        warnings.warn(f"hla_tvm: {len(missing)} kernel(s) without a tuned record{where} use the "
                      f"default schedule: {names} (hla-tvm tune writes records)", stacklevel=2)
    return out


def tuned(func, shapes, db, target):
    """`func` scheduled by its record in `db` (the trace replayed on the symbolic kernel), or
    None when `db` holds none for it."""
    rec = db.query_tuning_record(workload(func, shapes), target, "main")
    if rec is None:
        return None
    try:
        return replay(func, rec.trace)
    except Exception as err:   # a record that does not fit this kernel: the default instead
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        name = func.attrs["global_symbol"] if func.attrs and "global_symbol" in func.attrs \
            else "a kernel"
        warnings.warn(f"hla_tvm: the tuned record of {name} does not apply ({reason}); using "
                      "the default schedule")
        return None


def replay(func, trace):
    """`func`, the kernel with symbolic batch, heads and length, scheduled by `trace` (a
    record's, made on the kernel specialized to the tuning shape): the program a record gives
    at run time. Its speed can differ from the specialized program's that the search timed (a
    tile that divides the tuning length evenly meets a symbolic one), so the tuner compares
    these. `func` itself is left as it was (`common.named_as`). Raises what the trace's replay
    raises where it does not fit."""
    import tvm
    from tvm import s_tir

    from ..common import named_as

    def apply(plain):
        sch = s_tir.Schedule(tvm.IRModule({"main": plain}))
        trace.apply_to_schedule(sch, remove_postproc=False)
        return sch.mod["main"]

    return named_as(func, apply)


