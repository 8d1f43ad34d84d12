"""HLALM: a small language model whose attention layers are HLA."""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
import zipfile

import torch
from torch import nn

from ..nn import HLAttention, RMSNorm, SoftmaxAttention, SwiGLU
from ..nn.layers import decay_values
from ..runtime.paths import replacing

CHECKPOINT_FORMAT = "hla_tvm.HLALM/1"
# what token ids mean: None (the caller's own vocabulary) or "bytes" (id = byte value, 256 ids)
VOCAB_KINDS = (None, "bytes")


class Block(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); attn an HLAttention or a SoftmaxAttention."""

    def __init__(self, d_model, mlp_hidden, attn):
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = attn
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, mlp_hidden)

    def forward(self, x, state=None):
        h, state = self.attn(self.attn_norm(x), state)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), state


def _softmax_layers(layers, n_layers):
    """`layers` (indices of the softmax layers) as a sorted tuple, checked against n_layers."""
    if layers is None:
        return ()
    if isinstance(layers, (int, str)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ValueError(f"softmax_layers must be a sequence of layer indices, got {layers!r}")
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad or len(set(layers)) != len(layers):
        raise ValueError(f"softmax_layers must hold distinct layer indices in [0, {n_layers}), "
                         f"got {list(layers)}")
    return tuple(sorted(layers))


def _decay_config(decay):
    """The checkpoint's decay: None, one float, or a list of floats (one per key/value head),
    from a number, a 0-d or 1-d tensor, a numpy value or a sequence (`HLAttention` checks the
    values)."""
    if decay is None:
        return None
    values = decay_values(decay, torch.float64)
    return float(values) if values.dim() == 0 else [float(x) for x in values.flatten()]


def init_weights(model, std=0.02):
    """GPT-style initialization, which HLALM applies to itself: embeddings N(0, std) (tied
    logits start near uniform), every projection N(0, std), output projections
    N(0, std / sqrt(2 * layers)). (PyTorch's default, uniform +-1/sqrt(fan_in) with an N(0, 1)
    embedding, started the demo's training at a loss of 47 against ln 256 = 5.5.)"""
    layers = len(getattr(model, "blocks", ())) or 1
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            out_proj = name.endswith(("o_proj.weight", "down.weight"))
            nn.init.normal_(p, 0.0, std / math.sqrt(2 * layers) if out_proj else std)


class HLALM(nn.Module):
    """Token embedding, n_layers pre-norm blocks (RMSNorm -> HLAttention -> RMSNorm -> SwiGLU),
    final norm, tied or untied output head.

    forward(tokens [B, T] int64, state=None) -> (logits [B, T, vocab], state), state being a list
    with every layer's state dict (None: a fresh sequence). vocab="bytes" records that token
    ids are byte values (UTF-8 text; vocab_size 256), so tools turn text into tokens and back.

    A hybrid: the layers listed in `softmax_layers` (indices) are `SoftmaxAttention` instead,
    with rotary positions (`rope_theta`) and a fixed-size key/value cache of `max_len` tokens
    in their state (each query sees at most the last max_len tokens), the same heads, grouped
    key/value heads and head size as the HLA layers."""

    def __init__(self, vocab_size, d_model, n_layers, n_heads, *, order=2, asymmetric=False,
                 head_dim=None, n_kv_heads=None, decay=None, normalize=False, masked=True,
                 mlp_hidden=None, tie_embeddings=True, chunk_size=64, vocab=None,
                 softmax_layers=(), max_len=2048, rope_theta=10000.0):
        super().__init__()
        softmax_layers = _softmax_layers(softmax_layers, n_layers)
        if vocab not in VOCAB_KINDS:
            raise ValueError(f"vocab must be one of {VOCAB_KINDS}, got {vocab!r}")
        if vocab == "bytes" and vocab_size != 256:
            raise ValueError(f"vocab='bytes' needs vocab_size=256, got {vocab_size}")
        self.config = dict(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
                           n_heads=n_heads, order=order, asymmetric=asymmetric,
                           head_dim=head_dim, n_kv_heads=n_kv_heads,
                           decay=_decay_config(decay),
                           normalize=normalize, masked=masked, mlp_hidden=mlp_hidden,
                           tie_embeddings=tie_embeddings, chunk_size=chunk_size)
        if vocab is not None:   # (absent otherwise: older checkpoints keep their digest)
            self.config["vocab"] = vocab
        if softmax_layers:      # (likewise)
            self.config.update(softmax_layers=list(softmax_layers), max_len=max_len,
                               rope_theta=None if rope_theta is None else float(rope_theta))
        self.embed = nn.Embedding(vocab_size, d_model)

        def attention(i):
            if i in softmax_layers:
                return SoftmaxAttention(d_model, n_heads, max_len=max_len, head_dim=head_dim,
                                        n_kv_heads=n_kv_heads, rope_theta=rope_theta)
            return HLAttention(d_model, n_heads, head_dim=head_dim, n_kv_heads=n_kv_heads,
                               order=order, asymmetric=asymmetric, masked=masked, decay=decay,
                               normalize=normalize, chunk_size=chunk_size)

        self.blocks = nn.ModuleList(Block(d_model, mlp_hidden or 4 * d_model, attention(i))
                                    for i in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.head = None if tie_embeddings else nn.Linear(d_model, vocab_size, bias=False)
        init_weights(self)

    def init_state(self, batch, dtype=torch.float32, device="cpu"):
        return [b.attn.init_state(batch, dtype, device) for b in self.blocks]

    def forward(self, tokens, state=None):
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or \
                tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError("tokens must be an integer tensor [B, T], got "
                             f"{getattr(tokens, 'dtype', type(tokens).__name__)} "
                             f"{tuple(getattr(tokens, 'shape', ()))}")
        if tokens.shape[1] == 0:
            raise ValueError(f"tokens must hold T >= 1 tokens a sequence, got shape "
                             f"{tuple(tokens.shape)}")
        if state is not None and len(state) != len(self.blocks):
            raise ValueError(f"state must hold {len(self.blocks)} layer states, got {len(state)}")
        x = self.embed(tokens)
        new_state = []
        for i, block in enumerate(self.blocks):
            x, st = block(x, None if state is None else state[i])
            new_state.append(st)
        x = self.norm(x)
        logits = x @ self.embed.weight.T if self.head is None else self.head(x)
        return logits, new_state

    def save(self, path):
        """Config, weights and their digest (`weights_digest`) in torch's weights-only format
        (nothing arbitrary is pickled)."""
        weights = self.state_dict()
        with replacing(path) as f:   # (whole or not at all: `paths.replacing`)
            torch.save({"format": CHECKPOINT_FORMAT, "config": self.config, "weights": weights,
                        "digest": weights_digest(self.config, weights)}, f)

    @classmethod
    def load(cls, path):
        """A model saved with `save`. Refuses (ValueError naming the file and the key) files
        that are not such checkpoints, configs with missing or wrong-typed keys, and weights
        whose digest differs from the one recorded at save time."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no checkpoint at {path}")
        if not zipfile.is_zipfile(path):
            raise ValueError(f"{path}: not an HLALM checkpoint (not a torch.save zip archive)")
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise ValueError(f"{path}: not a readable HLALM checkpoint ({_torch_load_reason(err)})"
                             ) from None
        if not isinstance(blob, dict) or blob.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: not an HLALM checkpoint (format "
                             f"{blob.get('format') if isinstance(blob, dict) else None!r}, "
                             f"expected {CHECKPOINT_FORMAT!r})")
        config = check_config(blob.get("config"), path)
        weights = blob.get("weights")
        if not isinstance(weights, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()):
            raise ValueError(f"{path}: checkpoint key 'weights' must map names to tensors")
        digest = blob.get("digest")
        if digest is None:
            warnings.warn(f"{path}: checkpoint has no weights digest (written by an older "
                          "hla_tvm); it cannot be verified. Save it again to add one.")
        elif digest != weights_digest(config, weights):
            raise ValueError(f"{path}: checkpoint is corrupt: its config and weights do not match "
                             "the digest recorded when it was saved")
        try:
            model = cls(**config)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}: the config does not describe an HLALM: {err}") from None
        try:
            model.load_state_dict(weights)
        except RuntimeError as err:
            raise ValueError(f"{path}: the weights do not fit the config ("
                             f"{str(err).splitlines()[0]})") from None
        return model


# key: (accepted types, required)
CONFIG_KEYS = {
    "vocab_size": ((int,), True), "d_model": ((int,), True), "n_layers": ((int,), True),
    "n_heads": ((int,), True), "order": ((int,), False), "asymmetric": ((bool,), False),
    "head_dim": ((int, type(None)), False), "n_kv_heads": ((int, type(None)), False),
    "decay": ((float, int, list, type(None)), False), "normalize": ((bool,), False),
    "masked": ((bool,), False), "mlp_hidden": ((int, type(None)), False),
    "tie_embeddings": ((bool,), False), "chunk_size": ((int,), False),
    "vocab": ((str, type(None)), False), "softmax_layers": ((list,), False),
    "max_len": ((int,), False), "rope_theta": ((float, int, type(None)), False),
}


def check_config(config, source="config"):
    """`config` (an HLALM config dict) checked key by key; ValueError naming the key."""
    if not isinstance(config, dict):
        raise ValueError(f"{source}: checkpoint key 'config' must be a dict, got "
                         f"{type(config).__name__}")
    for key in config:
        if key not in CONFIG_KEYS:
            raise ValueError(f"{source}: unknown config key {key!r} (known: "
                             f"{', '.join(CONFIG_KEYS)})")
    for key, (types, required) in CONFIG_KEYS.items():
        if key not in config:
            if required:
                raise ValueError(f"{source}: config key {key!r} is missing")
            continue
        value = config[key]
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if ok and isinstance(value, list):
            ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
        if not ok or (isinstance(value, int) and not isinstance(value, bool)
                      and key not in ("decay",) and value < 1):
            names = " or ".join("None" if t is type(None) else t.__name__ for t in types)
            raise ValueError(f"{source}: config key {key!r} must be {names}"
                             f"{' (positive)' if int in types else ''}, got {value!r}")
    return config


def weights_digest(config, weights):
    """sha256 (hex) of the config (JSON) and every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name in sorted(weights):
        t = weights[name].detach().cpu().contiguous()
        h.update(f"{name}:{str(t.dtype)}:{list(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _torch_load_reason(err):
    """The part of torch.load's error that describes the file (not its advice to unpickle
    arbitrary code with weights_only=False)."""
    msg = str(err)
    found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", msg)
    if found:
        reason = found.group(1).split(". Please")[0].strip()
        return f"it holds something other than tensors and plain data: {reason}"
    first = msg.strip().splitlines()[0] if msg.strip() else type(err).__name__
    return first if "weights_only" not in first else type(err).__name__
