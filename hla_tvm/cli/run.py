"""`hla-tvm run`: generation with a compiled module and the TVM runtime alone; `--info`
describes a module without loading it."""
from __future__ import annotations

import sys

from .args import positive

DESCRIPTION = ("Prefill a prompt, then decode token by token: text prompts "
               "sampled (--temperature 0.9 --top-k 40 unless given) with a seeded "
               "generator, so the same --seed gives the same text; --prompt-ids "
               "greedy unless --temperature is given. Models with text (byte-level, "
               "as `hla-tvm train` and the demo make, or compiled with --tokenizer) "
               "take --prompt TEXT and stream text; others take --prompt-ids and "
               "print ids.")
MAX_PROMPT_BYTES = 64 << 20   # --prompt-file's default bound


def add_arguments(p):
    """The command's options."""
    p.add_argument("module", help="a library written by `hla-tvm compile`")
    p.add_argument("--prompt", "--text", dest="prompt", default=None, metavar="TEXT",
                   help="prompt text (models with text: byte-level, or compiled with "
                        "--tokenizer); --text is the spelling the bundle's generate.py and "
                        "the C++ app share")
    p.add_argument("--prompt-file", default=None, metavar="FILE",
                   help="prompt text read from FILE (UTF-8; - for standard input), for prompts "
                        "too long for the command line; echoed by its last 2000 characters "
                        "when longer")
    p.add_argument("--max-prompt-bytes", type=positive, default=MAX_PROMPT_BYTES, metavar="N",
                   help="the most bytes --prompt-file reads; a longer file (or a device such as "
                        "/dev/zero) is refused (default: 64 MiB, about 64 M tokens of a "
                        "byte-level model)")
    p.add_argument("--prompt-ids", default=None,
                   help="prompt token ids, e.g. 1,2,3 (the same flag in generate.py and the C++ "
                        "app)")
    p.add_argument("--info", action="store_true",
                   help="print the module's metadata (model, device, state layout, which "
                        "kernels use tuned records) and exit; read from the library without "
                        "loading it, so modules compiled for a GPU or another CPU are described "
                        "here too")
    p.add_argument("--tokens", "--steps", dest="tokens", type=positive, default=16,
                   help="tokens to generate (both spellings here, in generate.py and in the "
                        "C++ app)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (0: greedy; default: 0.9 for --prompt TEXT, as "
                        "the demo samples, 0 for --prompt-ids)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample from the k most likely tokens (0: all; default: 40 for "
                        "--prompt TEXT, else 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    p.add_argument("--threads", type=positive, default=None,
                   help="CPU threads for the kernels (default: $TVM_NUM_THREADS, else for each "
                        "kind of call the count that runs it fastest at the time, up to one per "
                        "physical core, chosen by timing the calls)")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda|cuda:N",
                   help="where the module runs: cpu, or the GPU for a module compiled with "
                        "--target cuda")


def _prompt_ids(text):
    try:
        prompt = [int(x) for x in text.split(",")]
    except ValueError:
        shown = text if len(text) <= 60 else text[:60] + "..."
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {shown!r}") from None
    return prompt


def _prompt_file(path, limit=MAX_PROMPT_BYTES):
    """The text of --prompt-file `path` ("-": standard input), UTF-8, of at most `limit`
    bytes: ValueError naming the file beyond (read no further: /dev/zero never ends)."""
    try:
        if path == "-":
            data = sys.stdin.buffer.read(limit + 1)
        else:
            with open(path, "rb") as f:
                data = f.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"--prompt-file {path} holds more than {limit} bytes "
                             "(--max-prompt-bytes)")
        return data.decode("utf-8")
    except UnicodeError as err:
        raise ValueError(f"--prompt-file {path} is not valid UTF-8 text ({err.reason})") from None
    except OSError as err:
        raise ValueError(f"--prompt-file {path}: {err.strerror}") from None


ECHO_CHARS = 2000


def _module_info(path, meta):
    """The metadata of a compiled module, a few lines for people."""
    lines = [f"{path}: hla_tvm module, format {meta.get('format')}"]
    cfg = meta.get("config") or {}
    if cfg:
        lines.append("model: " + ", ".join(f"{k} {v}" for k, v in cfg.items()))
    # the runtime (numpy) is imported once the arguments are parsed: `hla-tvm run --help` (and
    # `hla-tvm --help`) import this module
    from ..bundle import elf_machine
    from ..runtime.model import state_bytes, weights_summary

    host = elf_machine(path)
    lines.append("runs on: " + (f"an NVIDIA GPU, from an {host} host (load with device='cuda', "
                                "hla-tvm run --device cuda)" if meta.get("device") == "cuda"
                                else f"an {host} CPU"))
    if meta.get("cpu_features"):
        lines.append("CPU features: " + " ".join(meta["cpu_features"]))
    lines.append(f"entries: {', '.join(meta.get('entries', ('prefill', 'decode')))}; "
                 f"max batch: {meta.get('max_batch') or 'any'}")
    spec = meta.get("state", [])
    lines.append(f"state: {state_bytes(spec) / 1e3:.1f} KB a stream in {len(spec)} entries, "
                 + ", ".join(f"{n} {'x'.join(map(str, s))}" for n, s, _ in spec[:4])
                 + (" ..." if len(spec) > 4 else ""))
    from ..runtime.text import TOKENIZER

    lines.append("text: " + ("a tokenizer (tokenizer.json kept in the module)"
                             if meta.get(TOKENIZER) else "UTF-8 bytes" if cfg.get("vocab") ==
                             "bytes" else "none (token ids)"))
    for key in ("weights_sha256", "onnx_sha256"):
        if meta.get(key):
            lines.append(f"{key}: {meta[key]}")
    lines.append(f"weights: {weights_summary(meta)}")
    sched = meta.get("schedules")
    if sched is None:
        lines.append("schedules: default (compiled before tuned records were recorded)")
    else:
        where = sched.get("records") or "none (default schedules)"
        lines.append(f"schedules for {sched.get('target')}: records {where}"
                     + (f" (sha256 {sched['records_sha256']})" if sched.get("records_sha256")
                        else ""))
        for kind, label in (("from_records", "from records"), ("default", "default")):
            names = sched.get(kind, [])
            lines.append(f"  {label}: {len(names)} kernel(s)" +
                         (": " + ", ".join(names) if names else ""))
    return "\n".join(lines)


def main(args):
    from ..runtime import load, read_meta
    from ..runtime.generate import generate

    if args.info:   # read from the library without loading it where it holds the metadata
        meta = read_meta(args.module)
        print(_module_info(args.module, meta))
        return 0
    given = [o for o, x in (("--prompt", args.prompt), ("--prompt-file", args.prompt_file),
                            ("--prompt-ids", args.prompt_ids)) if x is not None]
    if len(given) > 1:
        raise ValueError(f"give one of --prompt TEXT, --prompt-file FILE or --prompt-ids 1,2,3, "
                         f"not {' and '.join(given)}")
    if not given:
        raise ValueError("give --prompt TEXT or --prompt-file FILE (models with text) or "
                         "--prompt-ids 1,2,3 (or --info to describe the module)")
    from ..runtime.generate import check_sampling

    try:   # (before the prompt is echoed)
        check_sampling(args.temperature or 0.0, args.top_k or 0, args.seed)
    except ValueError as err:
        raise ValueError(f"--{str(err).replace('_', '-')}") from None
    if args.prompt_file is not None:
        args.prompt = _prompt_file(args.prompt_file, args.max_prompt_bytes)
        if not args.prompt:
            raise ValueError(f"--prompt-file {args.prompt_file} is empty")
    prompt = _prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    m = load(args.module, args.device, threads=args.threads)
    if args.prompt is not None and m.text is None:
        raise ValueError(f"{args.module}: {given[0]} needs a model with text (byte-level, or "
                         "compiled with --tokenizer); this one takes token ids: give "
                         "--prompt-ids")
    if args.prompt is not None:   # (text: through the module's codec)
        try:
            prompt = m.text.encode(args.prompt)
        except UnicodeError as err:
            raise ValueError(f"--prompt is not valid text ({err.reason})") from None
    if not prompt:
        raise ValueError("prompt must not be empty")
    if args.prompt is not None:
        decode = m.text.decoder()
        skipped = len(args.prompt) - ECHO_CHARS
        sys.stdout.write(args.prompt if skipped <= 0 else
                         f"[... {skipped} characters of the prompt ...]" + args.prompt[skipped:])
        on_token = lambda tok: (sys.stdout.write(decode([tok])), sys.stdout.flush())  # noqa: E731
    else:
        on_token = None
    from ..runtime.generate import sampling

    temperature, top_k = sampling(args.prompt is not None, args.temperature, args.top_k)
    tokens, info = generate(m, prompt, args.tokens, temperature=temperature,
                            top_k=top_k, seed=args.seed, on_token=on_token)
    print(decode([], final=True)) if args.prompt is not None else \
        print(" ".join(map(str, tokens)))
    rate = f"{info['decode_steps'] / info['decode_s']:.1f} tokens/s" \
        if info["decode_steps"] and info["decode_s"] > 0 else "no decode steps (--tokens 1)"
    print(f"prefill {len(prompt)} token{'' if len(prompt) == 1 else 's'}: "
          f"{info['prefill_s'] * 1e3:.2f} ms; decode: {rate}",
          file=sys.stderr)
    return 0
