"""`models` (on the GPU machine, TVM's runtime alone): the bundle's compiled models against
their checkpoints in PyTorch (`model_worker` runs them in a process without torch), then each
model's `hla-tvm bundle` made there (`bundle_check`)."""
import json
import os
import subprocess
import sys
import time

from . import HERE
from .entries import MODELS, checkpoint_file, reference_model

BUNDLE_PROMPT = [5, 9, 2, 33, 7, 1, 0, 12]   # token ids below every model's vocabulary


def _torch_greedy(model, prompt, steps):
    """`steps` greedy token ids after `prompt` from `model` in float64 on the CPU."""
    import torch

    with torch.no_grad():
        m = model.double().cpu()
        logits, state = m(torch.tensor([prompt]), None)
        out = []
        for _ in range(steps):
            out.append(int(logits[0, -1].argmax()))
            logits, state = m(torch.tensor([[out[-1]]]), state)
    return out


def bundle_check(bundle_dir, name, model, steps=12):
    """`hla-tvm bundle` of the compiled model `name`, made here on the GPU machine, and its two
    programs run here: generate.py (numpy, tvm-ffi and the bundle's runtime) and the C++ app
    `prepare` built (the bundle's runtime on LD_LIBRARY_PATH), their greedy tokens against
    PyTorch's (float64). A dict for the report."""
    import tempfile

    from hla_tvm.bundle import bundle

    row = {"bundle": name}
    want = _torch_greedy(model, BUNDLE_PROMPT, steps)
    with tempfile.TemporaryDirectory() as tmp:
        dest = os.path.join(tmp, name)
        try:
            info = bundle(os.path.join(bundle_dir, "models", f"{name}.so"), dest)
            row["cudart_in_bundle"] = info.get("cudart")
        except Exception as err:   # (reported, not raised: the other checks go on)
            row["error"] = f"bundle: {type(err).__name__}: {err}"[-1500:]
            return row
        args = [os.path.join(dest, "model.so"), "--prompt", ",".join(map(str, BUNDLE_PROMPT)),
                "--steps", str(steps)]
        lib_path = os.pathsep.join(os.path.join(dest, "runtime", p, "lib")
                                   for p in ("tvm", "tvm_ffi"))
        app = os.path.join(bundle_dir, "app", "hla_tvm_app")
        runs = {"script": [sys.executable, os.path.join(dest, "generate.py"), *args]}
        if os.path.isfile(app):
            runs["app"] = [app, *args]
        else:
            row["app"] = f"not run: no {app} (`prepare` builds it where cmake is installed)"
        env = dict(os.environ, LD_LIBRARY_PATH=lib_path + os.pathsep +
                   os.environ.get("LD_LIBRARY_PATH", ""))
        for what, cmd in runs.items():
            try:
                run_ = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                                      cwd=dest)
            except subprocess.TimeoutExpired:
                row[what] = {"tokens_equal": False, "error": "timed out after 300 s"}
                continue
            got = run_.stdout.split()
            row[what] = {"tokens_equal": got == [str(t) for t in want], "rc": run_.returncode,
                         "tokens": " ".join(got), "stderr": run_.stderr.strip()[-800:]}
    row["want"] = " ".join(map(str, want))
    return row


def model_worker(args):
    """(no torch in this process: TVM's runtime alone) prefill, decode steps and decode speed
    of a compiled model on the GPU; arrays to args.result (.npz)."""
    import numpy as np

    from hla_tvm.runtime import load

    assert "torch" not in sys.modules
    m = load(args.module, device=args.device)
    tokens = np.load(args.tokens)
    t0 = args.prompt
    st = m.init_state(tokens.shape[0])
    prefill, st = m.prefill(tokens[:, :t0], st)
    steps = []
    for t in range(t0, tokens.shape[1]):
        logits, st = m.decode(tokens[:, t], st)
        steps.append(logits)
    one = m.init_state(1)
    for i in range(10):
        _, one = m.decode(np.array([i % 7]), one)
    n, start = 300, time.perf_counter()
    for i in range(n):
        _, one = m.decode(np.array([i % 7]), one)
    tokps = n / (time.perf_counter() - start)
    np.savez(args.result, prefill=prefill, decode=np.stack(steps, 1), tokps=tokps)


def _eager_decode(model):
    """Tokens per second of `model` (float32, PyTorch eager on the GPU) decoding one sequence."""
    import torch

    model = model.float().cuda()
    with torch.no_grad():
        st = [{n: x.cuda() for n, x in layer.items()} for layer in model.init_state(1)]
        tok = torch.zeros(1, 1, dtype=torch.int64, device="cuda")
        for _ in range(10):
            _, st = model(tok, st)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(300):
            _, st = model(tok.fill_(i % 7), st)
        torch.cuda.synchronize()
    return 300 / (time.perf_counter() - start)


def models(args):
    """Each compiled model of the bundle, run by `hla_tvm.runtime.load(device="cuda")` in a
    process without torch, against its checkpoint in PyTorch (float64, CPU; a quantized module
    against the model with its dequantized weights, `entries.reference_model`); decode speed
    beside PyTorch eager on the same GPU; on a GPU, each model's bundle too (`bundle_check`)."""
    import numpy as np
    import torch

    from hla_tvm.models import HLALM

    rows = []
    for name, (_, quantize) in MODELS.items():
        so = os.path.join(args.bundle, "models", f"{name}.so")
        model = reference_model(
            HLALM.load(os.path.join(args.bundle, "models", checkpoint_file(name))).eval(),
            quantize)
        vocab = model.config["vocab_size"]
        tokens = np.random.default_rng(0).integers(0, vocab, size=(2, 40))
        tok_path = os.path.join(args.out, f"{name}-tokens.npy")
        result = os.path.join(args.out, f"{name}-gpu.npz")
        os.makedirs(args.out, exist_ok=True)
        np.save(tok_path, tokens)
        run_ = subprocess.run([sys.executable, HERE, "model-worker", "--module", so,
                               "--tokens", tok_path, "--prompt", "30", "--result", result,
                               "--device", args.device],
                              capture_output=True, text=True, timeout=300)
        if run_.returncode:
            rows.append({"model": name, "pass": False, "error": run_.stderr.strip()[-1500:]})
            print(json.dumps(rows[-1]), flush=True)
            if args.device == "cuda":
                rows.append(bundle_check(args.bundle, name, model))
                print(json.dumps(rows[-1]), flush=True)
            continue
        got = np.load(result)
        with torch.no_grad():
            ref = model.double()(torch.from_numpy(tokens), None)[0].numpy()
        eager = None
        if args.device == "cuda":
            eager = _eager_decode(model)
        scale = np.abs(ref).max()
        err = max(np.abs(got["prefill"] - ref[:, :30]).max(), np.abs(got["decode"] -
                                                                    ref[:, 30:]).max()) / scale
        rows.append({"model": name, "rel_err": float(err), "pass": bool(err < 1e-3),
                     "decode_tok_s": float(got["tokps"]), "eager_gpu_tok_s": eager})
        print(json.dumps(rows[-1]), flush=True)
        if args.device == "cuda":
            rows.append(bundle_check(args.bundle, name, model))
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "models.json"), "w") as f:
        json.dump(rows, f, indent=1)
