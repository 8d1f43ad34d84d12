"""`run` (on the GPU machine): the checks in a worker process per family, then the timings
in one; the report as JSON and Markdown."""
import json
import os
import subprocess
import sys
import time

from . import HERE
from .entries import CHECKS
from .report import markdown


def run(args):
    """Checks in parallel processes, then the timings in one; tables and JSON to --out."""
    manifest = json.load(open(os.path.join(args.bundle, "manifest.json")))
    os.makedirs(args.out, exist_ok=True)
    import torch

    gpu = torch.cuda.get_device_name(0)
    print(f"# gpu_check on {gpu}, torch {torch.__version__}, kernels for {manifest['arch']} "
          f"(TVM {manifest['tvm']})", flush=True)
    groups = {}
    for fam, dtype, d, group, normalize in [] if args.skip_checks else CHECKS:
        groups.setdefault(fam, []).append(f"{fam},{dtype},{d},{group},{int(normalize)}")
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PYTHONUNBUFFERED="1")
    procs = {}
    t0 = time.time()
    for fam, specs in groups.items():
        result = os.path.join(args.out, f"checks-{fam}.json")
        cmd = [sys.executable, HERE, "worker-checks", "--bundle", args.bundle,
               "--checks", ";".join(specs), "--result", result]
        procs[fam] = (subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True), result)
    checks = []
    for fam, (p, result) in procs.items():
        try:
            log, _ = p.communicate(timeout=max(10, args.check_seconds - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            log, _ = p.communicate()
            log += "\n(timed out)"
        if os.path.exists(result):
            checks += json.load(open(result))
        else:
            checks.append({"entry": fam, "pass": False, "error": log.strip()[-1500:]})
        if p.returncode:
            print(f"## {fam} worker exit {p.returncode}\n{log.strip()[-3000:]}", flush=True)
    print(f"checks: {time.time() - t0:.0f} s", flush=True)
    result = os.path.join(args.out, "timing.json")
    cmd = [sys.executable, HERE, "worker-timing", "--bundle", args.bundle, "--result", result,
           "--deadline", str(time.time() + args.timing_seconds - 60),
           "--prefill-tokens", str(args.prefill_tokens),
           "--prefill-families", args.prefill_families] + \
        (["--compile-all"] if args.compile_all else [])
    p = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = p.communicate(timeout=args.timing_seconds)
    except subprocess.TimeoutExpired:
        p.kill()
        log, _ = p.communicate()
        log += "\n(timed out)"
    timing = json.load(open(result)) if os.path.exists(result) else []
    if p.returncode:
        print(f"## timing worker exit {p.returncode}\n{log.strip()[-3000:]}", flush=True)
    report = {"gpu": gpu, "torch": torch.__version__, "arch": manifest["arch"],
              "tvm": manifest["tvm"], "checks": checks, "timing": timing}
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    md = markdown(report)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(md)
    print(md, flush=True)
