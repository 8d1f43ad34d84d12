"""Training (`hla-tvm train`): a byte-level language model trained on the Python standard library's source.

The corpus is every .py file under this interpreter's standard library (site-packages left
out), read as bytes; a file goes to validation when crc32(its relative path) % 20 == 0 (about
5%), so the split does not depend on file order. Training minimizes next-byte cross entropy
on random windows, AdamW with linear warmup and cosine decay, the HLA layers running the
differentiable PyTorch path. Losses are reported in bits per byte (nats / ln 2)."""
from __future__ import annotations

import json
import math
import os
import sys
import sysconfig
import time
import zlib

import torch
from torch.nn import functional as F
from tqdm import tqdm

from . import validate
from .models import HLALM
from .models.hlalm import init_weights
from .models.softmax_baseline import softmax_baseline
from .runtime.paths import replacing

VAL_MODULUS = 20
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_corpus(root=None):
    """(train bytes, validation bytes) as uint8 tensors: the .py files under `root` (default
    this interpreter's standard library) in sorted path order, each followed by a newline."""
    root = root or sysconfig.get_paths()["stdlib"]
    parts = {False: [], True: []}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                with open(path, "rb") as f:
                    parts[zlib.crc32(rel.encode()) % VAL_MODULUS == 0].append(f.read() + b"\n")
    if not parts[False] or not parts[True]:
        raise ValueError(f"{root}: too few .py files for a training and a validation split")
    return tuple(torch.frombuffer(bytearray(b"".join(parts[v])), dtype=torch.uint8)
                 for v in (False, True))


def windows(data, batch, seq_len, generator):
    """`batch` random windows of seq_len + 1 bytes from `data`: (inputs, targets) int64 [B, T]."""
    if data.numel() < seq_len + 2:
        raise ValueError(f"seq_len {seq_len} needs more than {data.numel()} bytes of text")
    starts = torch.randint(0, data.numel() - seq_len, (batch,), generator=generator)
    rows = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def loss_of(model, inputs, targets):
    """Mean next-token cross entropy (nats) of `model` on one batch."""
    logits, _ = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate(model, batches):
    """Mean loss over fixed validation batches, in bits per byte."""
    was = model.training
    model.eval()
    total = sum(float(loss_of(model, x, y)) for x, y in batches) / len(batches)
    model.train(was)
    return total / math.log(2)


def learning_rate(step, progress, peak, warmup):
    """Linear warmup to `peak` over `warmup` steps, then cosine decay to peak / 10 as
    `progress` (the fraction of the run done) goes from 0 to 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def fit(model, train, val, *, steps, batch=16, seq_len=256, lr=3e-3, warmup=30, seed=0,
        eval_every=50, eval_batches=16, seconds=None, progress=True):
    """Train `model` in place; returns the history {"steps": [...], "train_bpb": [...],
    "val": [[step, bpb], ...], "seconds", "tokens"}. With `seconds`, the run stops at that wall
    time and the learning rate decays over it (then it is not reproducible step for step)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    val_gen = torch.Generator().manual_seed(seed + 1)
    val_batches = [windows(val, batch, seq_len, val_gen) for _ in range(eval_batches)]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    hist = {"steps": [], "train_bpb": [], "val": [], "seconds": 0.0, "tokens": 0,
            "max_steps": steps, "seconds_budget": seconds}
    model.train()
    t0 = time.perf_counter()
    bar = tqdm(total=None if seconds is not None else steps, disable=not progress,
               unit="step", dynamic_ncols=True, file=sys.stderr)
    for step in range(steps):
        if step % eval_every == 0:
            hist["val"].append([step, evaluate(model, val_batches)])
        done = step / steps if seconds is None else (time.perf_counter() - t0) / seconds
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, done, lr, warmup)
        x, y = windows(train, batch, seq_len, gen)
        loss = loss_of(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        hist["steps"].append(step)
        hist["train_bpb"].append(float(loss.detach()) / math.log(2))
        hist["tokens"] += x.numel()
        elapsed = time.perf_counter() - t0
        bar.update(1)
        bar.set_postfix(loss=f"{hist['train_bpb'][-1]:.3f} bpb",
                        val=f"{hist['val'][-1][1]:.3f}", tok_s=f"{hist['tokens'] / elapsed:.0f}")
        if seconds is not None and elapsed >= seconds:
            break
    bar.close()
    hist["val"].append([len(hist["steps"]), evaluate(model, val_batches)])
    hist["seconds"] = time.perf_counter() - t0
    return hist


def write_curve(hist, path, label):
    """The training curve as JSON at `path` + ".json" and, where matplotlib is installed, a plot
    at `path` + ".png" (bits/byte against steps: training smoothed, held-out points; axes,
    ticks, legend). Returns the files written."""
    with replacing(path + ".json", "w") as f:
        json.dump({"label": label, **hist}, f, indent=1)
    try:
        # matplotlib: the bench extra (optional; no plot without it)
        import matplotlib

        matplotlib.use("Agg")   # (no display needed)
        from matplotlib import pyplot as plt
    except ImportError:
        return [path + ".json"]
    smooth, acc = [], None
    for v in hist["train_bpb"]:
        acc = v if acc is None else 0.9 * acc + 0.1 * v
        smooth.append(acc)
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    ax.plot(range(1, len(smooth) + 1), smooth, color="tab:blue",
            label="training (smoothed)")
    if hist["val"]:
        ax.plot(*zip(*hist["val"]), "o-", color="tab:red", label="held out")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_title(f"{label}: {hist.get('params', 0) / 1e6:.2f} M parameters")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with replacing(path + ".png") as f:
        fig.savefig(f, format="png")
    plt.close(fig)
    return [path + ".json", path + ".png"]


# the shipped model's shape: second order, head size 64 (the shipped records' shapes), ~1.1 M
# parameters (4.3 MB of float32 weights), one decay per head: a short and a long memory
# (measured, bits/byte held out after 200 steps: 3.19 with this decay, 3.25 with 0.9/0.99,
# 3.56 with 0.95/0.995; after 250 steps 4.17 without decay)
SHIPPED_CONFIG = dict(vocab_size=256, d_model=128, n_layers=4, n_heads=2, order=2,
                      decay=[0.8, 0.98], chunk_size=64, vocab="bytes")

_GIVEN = object()


def spread_decay(n_heads, short=0.8, long=0.98):
    """One decay per head from `short` to `long`, evenly spaced in log(1 - decay) (the memory
    lengths 1 / (1 - decay) grow geometrically): the shipped model's pair for 2 heads, their
    middle (0.937) for one."""
    if n_heads == 1:
        return [round(1 - ((1 - short) * (1 - long)) ** 0.5, 4)]
    return [round(1 - (1 - short) * ((1 - long) / (1 - short)) ** (i / (n_heads - 1)), 4)
            for i in range(n_heads)]


def run(out, *, steps=600, batch=16, seq_len=256, lr=3e-3, seed=0, attention="hla",
        seconds=None, d_model=None, n_layers=None, n_heads=None, decay=_GIVEN, progress=True):
    """Train a byte-level model (SHIPPED_CONFIG with the given overrides; decay=None: no decay)
    on the standard library and write `out` (an HLALM checkpoint; not for attention="softmax",
    the baseline, which has no decay) and its curve `out` minus ".pt" + ".json"/".png".
    Returns the history."""
    if attention not in ("hla", "softmax"):
        raise ValueError(f"attention must be 'hla' or 'softmax', got {attention!r}")
    for name, value in (("steps", steps), ("batch", batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value in (("lr", lr), ("seconds", seconds)):
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)
                                      and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    out = validate.output_path("output", out)
    config = dict(SHIPPED_CONFIG)
    for key, value in (("d_model", d_model), ("n_layers", n_layers), ("n_heads", n_heads)):
        if value is not None:
            config[key] = value
    if config["d_model"] % config["n_heads"]:
        raise ValueError(f"--heads {config['n_heads']} must divide --d-model {config['d_model']}")
    config["decay"] = spread_decay(config["n_heads"]) if decay is _GIVEN else decay
    if isinstance(config["decay"], list) and len(config["decay"]) not in (1, config["n_heads"]):
        raise ValueError(f"--decay needs one value or one per head ({config['n_heads']}), got "
                         f"{config['decay']}")
    if attention == "softmax":
        config.pop("decay")
    train, val = stdlib_corpus()
    torch.manual_seed(seed)
    if attention == "hla":
        model = HLALM(**config)   # (it initialises itself: `models.hlalm.init_weights`)
    else:
        model = softmax_baseline(config)
        init_weights(model)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"training a {attention} byte-level model ({n_params / 1e6:.2f} M parameters) on the "
          f"standard library's source: {train.numel() / 1e6:.1f} MB for training, "
          f"{val.numel() / 1e6:.1f} MB held out; {steps} steps of {batch} x {seq_len} bytes, "
          f"seed {seed}, {torch.get_num_threads()} threads", flush=True)
    hist = fit(model, train, val, steps=steps, batch=batch, seq_len=seq_len, lr=lr, seed=seed,
               seconds=seconds, progress=progress)
    hist.update(config=config, attention=attention, params=n_params, seed=seed, batch=batch,
                seq_len=seq_len, lr=lr, python=sys.version.split()[0],
                torch=torch.__version__, threads=torch.get_num_threads())
    stem = out[:-3] if out.endswith(".pt") else out
    if attention == "hla":   # (through a temporary file, renamed over `out` once whole)
        model.save(out)
    curve = write_curve(hist, stem, attention)
    print(f"validation: {hist['val'][-1][1]:.3f} bits/byte after {len(hist['steps'])} steps, "
          f"{hist['seconds']:.0f} s ({hist['tokens'] / hist['seconds']:.0f} tokens/s)")
    print("wrote " + ", ".join(([out] if attention == "hla" else []) + curve)
          + ("" if len(curve) == 2 else " (pip install matplotlib for the curve's plot)"))
    return hist
