"""The package's imports point one way: no import circle, no module reaching into another's
private names, and no layer importing one above it (every import counts, those inside functions
too). The layers, lowest first:

    version, runtime          what runs a compiled model without torch or TVM's compiler
    ops, quant                the operators: reference math, fast PyTorch forms, kernels, chains;
                              weight quantization schemes and dequantizing kernels
    target, validate, options targets, argument checks, the options of a call
    schedule                  default rules (schedule.rules) and tuning (schedule.tuning)
    build                     compiling and caching kernel modules
    backend, decode, api      running the kernels from PyTorch: hla(), decode_()
    nn, models                PyTorch layers and models
    compiler, onnx, bundle,   deployable modules, the ONNX op, bundles, the server (which
    serve                     imports the runtime alone)
    demo, train, evaluate,    the programs behind the commands: the demo and its module cache,
    bench                     training, evaluation, the benchmark cases
    cli, tools                the commands and the programs; the CUDA emulator"""
import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hla_tvm")

LAYERS = [("hla_tvm.version", "hla_tvm.progress", "hla_tvm.runtime"), ("hla_tvm.ops", "hla_tvm.quant"),
          ("hla_tvm.target", "hla_tvm.validate", "hla_tvm.options"), ("hla_tvm.schedule",),
          ("hla_tvm.build",),
          ("hla_tvm.backend", "hla_tvm.decode", "hla_tvm.api"),
          ("hla_tvm.nn", "hla_tvm.models"),
          ("hla_tvm.compiler", "hla_tvm.onnx", "hla_tvm.bundle", "hla_tvm.serve"),
          ("hla_tvm.demo", "hla_tvm.train", "hla_tvm.evaluate", "hla_tvm.bench"),
          ("hla_tvm.cli", "hla_tvm.tools", "hla_tvm.__main__", "hla_tvm")]
# imports that are allowed across the order: none


def _modules():
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, os.path.dirname(ROOT))[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(module):
    """[(imported module, names, line)] of every `from X import ...` of the package in
    `module`."""
    path = MODULES[module]
    pkg = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "hla_tvm" or target.startswith("hla_tvm."):
                out.append((target, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names
                    if a.name.startswith("hla_tvm")]
    return out


def _resolve(name):
    """The module `name` is, or lies in."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _graph():
    edges = {}
    for m in MODULES:
        for target, names, _ in _imports(m):
            for t in [f"{target}.{n}" if f"{target}.{n}" in MODULES else target
                      for n in (names or [""])]:
                t = _resolve(t)
                if t != m:
                    edges.setdefault(m, set()).add(t)
    return edges


def _layer(module):
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes if p != "hla_tvm"):
            return i
    return len(LAYERS) - 1   # the package itself: its public names


def test_no_import_circle():
    edges = _graph()
    index, low, stack, on, cycles, count = {}, {}, [], set(), [], [0]

    def visit(v):   # Tarjan's strongly connected components
        index[v] = low[v] = count[0]
        count[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in MODULES:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_no_layer_imports_one_above_it():
    upward = [(m, t) for m, ts in _graph().items() for t in ts if _layer(t) > _layer(m)]
    assert not upward, upward


def test_schedule_rules_do_not_import_tuning():
    """The default rules stand alone: tuning builds on them, never the other way round."""
    crossing = [(m, t) for m, ts in _graph().items() for t in ts
                if m.startswith("hla_tvm.schedule.rules") and
                t.startswith("hla_tvm.schedule.tuning")]
    assert not crossing, crossing


def test_no_module_imports_another_modules_private_names():
    private = [(m, target, n, line) for m in MODULES for target, names, line in _imports(m)
               for n in names if n.startswith("_") and not n.startswith("__")
               and _resolve(target) != m]
    assert not private, private


def test_each_rules_module_holds_one_rule_class():
    """`schedule/rules/{cpu,cuda}/`: one dlight rule class a module (its helpers beside it as
    functions); the rules' steps live in `schedule/steps/`, and no step imports a rule."""
    for m, path in MODULES.items():
        if m.startswith("hla_tvm.schedule.rules.") and m.count(".") == 4:
            classes = [n.name for n in ast.parse(open(path).read()).body
                       if isinstance(n, ast.ClassDef)]
            assert len(classes) == 1, (m, classes)
    upward = [(m, t) for m, ts in _graph().items() for t in ts
              if m.startswith("hla_tvm.schedule.steps") and
              t.startswith("hla_tvm.schedule.rules")]
    assert not upward, upward


def test_the_command_line_is_imported_by_no_library_module_or_benchmark():
    """`cli/` holds each command's arguments and a call into the library: nothing in the
    package outside it (but `__main__`) nor in `benchmarks/` imports it."""
    inward = [(m, t) for m, ts in _graph().items() for t in ts
              if t.startswith("hla_tvm.cli") and not m.startswith("hla_tvm.cli")
              and m != "hla_tvm.__main__"]
    assert not inward, inward
    bench_root = os.path.join(os.path.dirname(ROOT), "benchmarks")
    for folder, _, files in os.walk(bench_root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                for node in ast.walk(ast.parse(open(path).read())):
                    mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                        [a.name for a in node.names] if isinstance(node, ast.Import) else []
                    assert not any(m == "hla_tvm.cli" or m.startswith("hla_tvm.cli.")
                                   for m in mods), (path, node.lineno)
