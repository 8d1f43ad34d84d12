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

import base64
import binascii
import hashlib
import json
import lzma
import os
import signal
import subprocess
import sys
import threading
import warnings

import tvm
import tvm_ffi
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.schedule import InstructionKind
from tvm_ffi import core

from ...runtime import cache
from ...runtime.paths import replacing
from .. import TUNED, register_intrinsics
from ..common import named_as
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
        except (ValueError, IndexError, TypeError, AttributeError, RecursionError):
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
    line when it is truncated or corrupt, when meta_schedule cannot read it (another TVM), or
    when it would crash meta_schedule's reader (`_read_apart`); read once per process and
    digest."""
    key = (os.path.abspath(path), digest(path))
    with _LOCK:
        if key in _DATABASES:
            return _DATABASES[key]
    files = [stored(path, name) for name in FILES]
    data = [_contents(f) for f in files]
    workloads, records = _parsed(files, data)
    _read_apart(files, data)
    db = _database(files, workloads, records)
    with _LOCK:
        _DATABASES[key] = db
    return db


def _parsed(files, data):
    """(workloads, records): the lines of the records files `files` (contents `data`), each
    checked (`_check_lines`)."""
    workloads = _check_lines(files[0], _check_workload, data[0])
    return workloads, _check_lines(files[1], lambda x: _check_record(x, len(workloads)), data[1])


def _database(files, workloads, records, at=None):
    """A meta_schedule MemoryDatabase of the checked `workloads` and `records` (read from
    `files`); at(file, line) is called before each line is given to meta_schedule."""
    register_intrinsics()   # traces that tensorize name them
    db = ms.database.MemoryDatabase()

    def commit(file, values, add):
        for n, value in enumerate(values, 1):
            if at is not None:
                at(file, n)
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
    return db


# --- reading records apart: meta_schedule's reader in a child process ---------------------------
# The checks below refuse what is known to crash TVM's reader (a null where it expects an
# object, a module node that contains itself, nesting deeper than its recursion survives), but
# they cannot follow every instruction's and every IR node's fields: a folder's records are
# first read by meta_schedule in a child process, so that a record that would still crash it
# kills the child (a one-line ValueError naming the file and line here) and not this process.
# The verdict is kept per content and TVM version: in memory, and for records read without
# fault as an empty file named by that digest in the cache's CHECKED folder (`runtime.cache`).
CHECKED = "checked"
READ_TIMEOUT = 600   # seconds the child may take (seen: 3 s for the 20 records of a folder)
_VERDICTS: dict = {}


def _read_apart(files, data):
    """Read the records files `files` (contents `data`) as `load` does in a child process,
    once per content (`_VERDICTS`, the cache's CHECKED folder): ValueError naming the file and
    line when meta_schedule refuses a line there or crashes on it."""
    h = hashlib.sha256()
    for part in (tvm.__version__, tvm_ffi.__version__, sys.version, *files, *data):
        part = part.encode() if isinstance(part, str) else part
        h.update(len(part).to_bytes(8, "little") + part)
    key = h.hexdigest()
    with _LOCK:
        verdict = _VERDICTS.get(key, False)
    if verdict is False:
        marker = _marker(key)
        verdict = None if marker and os.path.isfile(marker) else _read_in_child(files, data)
        with _LOCK:
            _VERDICTS[key] = verdict
        if verdict is None and marker:
            try:
                with replacing(marker):
                    pass
            except OSError:   # (a read-only cache: checked again by the next process)
                pass
    if verdict is not None:
        raise ValueError(verdict)


def _marker(key):
    """The file in the cache that records that the records of digest `key` were read without
    fault, or None where the cache folder cannot be used."""
    try:
        return os.path.join(cache.folder(CHECKED), key)
    except (OSError, ValueError):
        return None


def _read_in_child(files, data):
    """None when a child process reads the records (`_child`) without fault, else the error
    (one line naming the file and line)."""
    here = os.path.dirname(os.path.abspath(__file__))   # hla_tvm/schedule/tuning
    top = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    # (this very package, wherever it was imported from; its folder off the path once found)
    code = (f"import sys; sys.path.insert(0, {top!r}); import hla_tvm; del sys.path[0]; "
            "from hla_tvm.schedule.tuning import records; records._child()")
    payload = json.dumps({"files": files, "sizes": [len(d) for d in data]}).encode() + b"\n" + \
        b"".join(data)
    folder = os.path.dirname(files[0]) or "."
    try:
        run = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True,
                             timeout=READ_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        return (f"{folder}: meta_schedule took more than {READ_TIMEOUT} s to read these "
                "records; delete the folder or tune again")
    except OSError as err:
        raise RuntimeError(f"{folder}: cannot start a child process to read its records "
                           f"({err})") from None
    lines = run.stdout.decode("utf-8", "replace").splitlines()
    at = [x[3:] for x in lines if x.startswith("at ")]
    if run.returncode == 0 and lines and lines[-1] == "ok":
        return None
    if run.returncode == 2 and lines and lines[-1].startswith("error "):
        return lines[-1][len("error "):]
    sig = -run.returncode if run.returncode < 0 else run.returncode - 128 \
        if run.returncode > 128 else None
    if sig is not None:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return (f"{at[-1] if at else files[0]}: meta_schedule's reader crashes on this record "
                f"({name}); delete the folder or tune again")
    err = run.stderr.decode("utf-8", "replace").strip().splitlines()
    why = f"exit {run.returncode}: {err[-1] if err else 'no message'}"
    if at:   # (a Python error while meta_schedule read a line, MemoryError say)
        return f"{at[-1]}: meta_schedule's reader fails on this record ({why}); delete the " \
            "folder or tune again"
    raise RuntimeError(f"{folder}: reading the records in a child process failed ({why})")


def _child():
    """The child process of `_read_in_child`: the files' names and contents from standard
    input, read as `load` reads them; "at FILE:LINE" before each line goes to meta_schedule,
    then "ok" (exit 0), or "error MESSAGE" (exit 2) when a line is refused."""
    head = json.loads(sys.stdin.buffer.readline())
    files, data = head["files"], [sys.stdin.buffer.read(n) for n in head["sizes"]]

    def say(text):
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    try:
        _database(files, *_parsed(files, data), at=lambda f, n: say(f"at {f}:{n}"))
    except ValueError as err:
        say("error " + " ".join(str(err).split()))
        raise SystemExit(2) from None
    say("ok")


# --- checks of each line -------------------------------------------------------------------------
MAX_DEPTH = 32   # nesting of a records line and of a workload's module graph (seen: 7 and 4)


def _check_lines(file, check, data=None):
    """The records in `file` (one JSON value per line, plain or packed; its contents `data`
    where read already), each passed to check(), which returns a reason when it is malformed;
    ValueError naming the file and line otherwise (meta_schedule's reader would crash the
    process on some malformed records, and on a blank line in the tuning records)."""
    values = []
    for n, line in enumerate((_contents(file) if data is None else data)
                             .splitlines(keepends=True), 1):
        try:
            text = line.decode("utf-8")
            value = _json(text) if text.strip() else None
            reason = "a blank line" if not text.strip() else check(value)
        except UnicodeDecodeError as err:
            reason = f"not UTF-8 text: {err.reason}"
        except ValueError as err:
            reason = str(err)
        if reason:
            raise ValueError(f"{file}:{n}: not a meta_schedule record ({reason}); delete "
                             "the folder or tune again")
        values.append(value)
    return values


def _json(text):
    """The JSON value `text` holds; ValueError when it is not JSON or nests lists and objects
    more than MAX_DEPTH deep (Python's parser would raise RecursionError, TVM's would crash)."""
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
    else:
        stack = [(value, 1)]
        while stack:
            x, depth = stack.pop()
            if isinstance(x, (list, dict)) and depth <= MAX_DEPTH:
                stack.extend((y, depth + 1) for y in (x.values() if isinstance(x, dict)
                                                      else x))
            elif isinstance(x, (list, dict)):
                break
        else:
            return value
    raise ValueError(f"lists or objects nested more than {MAX_DEPTH} deep")


def _check_workload(x):
    if not (isinstance(x, list) and len(x) == 2 and all(isinstance(y, str) for y in x)
            and x[0].isdigit()):
        return "a workload is [structural hash, module]"
    try:
        raw = base64.b64decode(x[1], validate=True)
    except binascii.Error as err:
        return f"its module is not base64: {err}"
    # (meta_schedule's base64 stream: the length of the text, 8 bytes little-endian, the text)
    if len(raw) < 8 or int.from_bytes(raw[:8], "little") != len(raw) - 8:
        return "its module's length does not match its text"
    try:
        return _check_graph(_json(raw[8:].decode("utf-8")), "its module")
    except UnicodeDecodeError as err:
        return f"its module is not UTF-8 text: {err.reason}"
    except ValueError as err:
        return f"its module: {err}"


# the type indices of tvm_ffi's values whose serialized data holds no node index
_POD = {0: None, 1: int, 2: bool, 3: (int, float), 5: str}   # None, int, bool, float, DataType
_NAMESPACES = ("ir.", "prim.", "tirx.", "s_tir.", "relax.", "target.", "ffi.")
# error, function, tensor, module, Python object: never in a workload (a tensor's or a
# module's data is a blob TVM unpacks: a size it allocates, a library it loads)
_OPAQUE = (67, 68, 70, 73, 74)


def _check_graph(g, what):
    """None when `g` is a TVM object graph (`tvm.ir.save_json`'s form) that TVM's reader
    (tvm_ffi's FromJSONGraph) can follow: nodes of known IR types, each reference a node of
    the graph, no node containing itself; else the reason."""
    if not hasattr(core, "_lookup_or_register_type_info_from_type_key"):
        return None   # (another tvm_ffi: the child process's reading stands alone)
    if not (isinstance(g, dict) and type(g.get("root_index")) is int
            and isinstance(g.get("nodes"), list) and g["nodes"]):
        return f"{what} is not a TVM object graph"
    nodes, root = g["nodes"], g["root_index"]
    children = []
    for i, node in enumerate(nodes):
        kind = node.get("type") if isinstance(node, dict) else None
        index = core._object_type_key_to_index(kind) if isinstance(kind, str) else None
        if index is None:
            return f"{what}'s node {i} is of no known type ({kind!r})"
        data, kids = node.get("data"), []
        if index in _POD:
            ok = index == 0 or (isinstance(data, _POD[index]) and (index == 2) ==
                                isinstance(data, bool))
        elif index == 6:   # a device: [type, id]
            ok = isinstance(data, list) and len(data) == 2 and all(
                type(v) is int for v in data)
        elif index in (65, 66):   # string, bytes
            ok = isinstance(data, str)
        elif index == 69:   # shape: its numbers
            ok = isinstance(data, list) and all(type(v) is int for v in data)
        elif index in (71, 72, 75, 76):   # array, map, list, dict: node indices
            ok = isinstance(data, list) and (index in (71, 75) or len(data) % 2 == 0)
            kids = data
        elif index < 64:   # (pointers and the like)
            return f"{what}'s node {i} is of a type no workload holds ({kind})"
        else:
            info = core._lookup_or_register_type_info_from_type_key(kind)
            if index in _OPAQUE or set(_OPAQUE) & set(info.type_ancestors) or \
                    not kind.startswith(_NAMESPACES):
                return f"{what}'s node {i} is of a type no workload holds ({kind})"
            ok = True
            if isinstance(data, dict):   # fields: a node index, or a value of a POD field
                while info is not None:
                    for field in info.fields or ():
                        if field.name not in data:
                            continue
                        pod = _POD.get(field.field_static_type_index, False)
                        value = data[field.name]
                        if pod is False:
                            kids.append(value)
                        elif pod is not None and not isinstance(value, pod):
                            ok = False
                    info = info.parent_type_info
        if not ok:
            return f"{what}'s node {i} ({kind}) holds malformed data"
        for k in kids:
            if type(k) is not int or not 0 <= k < len(nodes):
                return f"{what}'s node {i} refers to node {k!r}, not one of its {len(nodes)}"
        children.append(kids)
    if not 0 <= root < len(nodes):
        return f"{what}'s root {root} is not one of its {len(nodes)} nodes"
    # (TVM's reader follows the references from the root recursively: a cycle never ends)
    state = [0] * len(nodes)   # 0 unseen, 1 on the path, 2 done
    stack = [(root, iter(children[root]))]
    state[root] = 1
    while stack:
        node, it = stack[-1]
        k = next(it, None)
        if k is None:
            state[node] = 2
            stack.pop()
        elif state[k] == 1:
            return f"{what}'s node {k} contains itself"
        elif state[k] == 0:
            state[k] = 1
            stack.append((k, iter(children[k])))
    return None


def _check_record(x, workloads):
    if not (isinstance(x, list) and len(x) == 2 and type(x[0]) is int
            and isinstance(x[1], list) and len(x[1]) == 4):
        return "a record is [workload index, [trace, run seconds, target, arguments]]"
    trace, secs, target, args = x[1]
    if not 0 <= x[0] < workloads:
        return f"workload index {x[0]} of {workloads} workloads"
    if not (isinstance(trace, list) and isinstance(secs, list) and isinstance(target, dict)
            and isinstance(args, list) and isinstance(target.get("kind"), str)
            and all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in secs)):
        return "a record is [workload index, [trace, run seconds, target, arguments]]"
    return _check_trace(trace)


def _check_trace(trace):
    """None when `trace` (a record's) has the form meta_schedule's reader (`Trace::
    ApplyJSONToSchedule`) expects, else the reason: [instructions, decisions], an
    instruction [kind, inputs, attributes, outputs] of a registered kind, no null among its
    inputs and attributes (but a TransformLayout's pad value), an index map (a string "{...}":
    a TVM object graph) that `_check_graph` passes, its outputs names; a decision [index of
    an instruction, value]."""
    if not (len(trace) == 2 and all(isinstance(t, list) for t in trace)):
        return "a trace is [instructions, decisions]"
    insts, decisions = trace

    def values(x):   # (every value in x, lists and objects opened)
        stack = [x]
        while stack:
            v = stack.pop()
            yield v
            if isinstance(v, list):
                stack.extend(v)
            elif isinstance(v, dict):
                stack.extend(v.values())

    kinds = {}
    for i, inst in enumerate(insts):
        if not (isinstance(inst, list) and len(inst) == 4 and isinstance(inst[0], str)
                and all(isinstance(t, list) for t in inst[1:])
                and all(isinstance(t, str) for t in inst[3])):
            return (f"instruction {i} is not [kind, inputs, attributes, outputs] with "
                    "outputs named")
        kind, inputs, attrs, _ = inst
        if kind not in kinds:
            try:
                InstructionKind.get(kind)
                kinds[kind] = True
            except Exception:   # noqa: BLE001  (TVM's error for an unregistered kind)
                kinds[kind] = False
        if not kinds[kind]:
            return f"instruction {i}: {kind!r} is no instruction of this TVM"
        optional = (2,) if kind == "TransformLayout" else ()   # (its pad value)
        attrs = [a for j, a in enumerate(attrs) if a is not None or j not in optional]
        for what, given in (("inputs", inputs), ("attributes", attrs)):
            for v in values(given):
                if v is None:
                    return f"instruction {i} ({kind}) has a null among its {what}"
                if isinstance(v, str) and v.startswith("{") and v.endswith("}"):
                    reason = _check_graph(_json(v), f"instruction {i}'s index map")
                    if reason:
                        return reason
    for d in decisions:
        if not (isinstance(d, list) and len(d) == 2 and type(d[0]) is int
                and 0 <= d[0] < len(insts)):
            return (f"a decision is [index of one of the {len(insts)} instructions, value], "
                    f"got {json.dumps(d)[:60]}")
        if d[1] is not None and not (type(d[1]) is int or (isinstance(d[1], list) and all(
                type(v) is int for v in d[1]))):
            return f"the decision of instruction {d[0]} is not an integer or integers"
    return None


def workload(func, shapes):
    """The meta_schedule workload module of a kernel: specialized, its function named main and
    marked noalias, as tune_tir normalizes a task (records are found by structural hash), without
the Relax fusion attribute a model's copy carries."""
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
    def apply(plain):
        sch = s_tir.Schedule(tvm.IRModule({"main": plain}))
        trace.apply_to_schedule(sch, remove_postproc=False)
        return sch.mod["main"]

    return named_as(func, apply)


