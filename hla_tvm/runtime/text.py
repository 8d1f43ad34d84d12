"""Text in and out of a compiled model (`codec`): byte-level models read and write UTF-8 bytes
(token id = byte); a model compiled with a tokenizer (`hla_tvm.compile(..., tokenizer=
"tokenizer.json")`: the Hugging Face `tokenizers` library's file, kept in the module's metadata)
uses it; other models have no text, only token ids.

    c = codec(model.meta)            # None: token ids only
    ids = c.encode("some text")
    c.token_text(ids[0])             # one token's text (as logprobs name it)
    decode = c.decoder()             # incremental: decode([id, ...]) -> the text they complete,
    text = decode(ids) + decode([], final=True)   # final=True flushes what is held back

A tokenizer_config.json beside the tokenizer.json gives the module its chat template
(`read_chat`, kept under CHAT), which `hla-tvm serve` renders chat messages with. The
`tokenizers` package is needed only for modules compiled with a tokenizer."""
from __future__ import annotations

import json
import os

from .generate import text_decoder

TOKENIZER = "tokenizer"   # the metadata key holding the tokenizer.json text
CHAT = "chat"             # ... and {"template", "bos_token", "eos_token"} of its chat template


class ByteText:
    """UTF-8 bytes: token id = byte value (vocabulary of 256)."""

    kind = "bytes"

    def encode(self, text):
        if not isinstance(text, str):
            raise TypeError(f"prompt must be a string, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decoder(self):
        return text_decoder()

    def token_text(self, token):
        """One token's text: its character, or "bytes:\\xNN" for a byte that is part of a
        longer UTF-8 character (as OpenAI writes such tokens)."""
        return chr(token) if token < 128 else f"bytes:\\x{token:02x}"


class TokenizerText:
    """A Hugging Face `tokenizers` tokenizer (from its tokenizer.json text)."""

    kind = "tokenizer"

    def __init__(self, text):
        try:
            # tokenizers (the serve extra) only for modules compiled with --tokenizer
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError("this module was compiled with a tokenizer: its text needs the "
                             "`tokenizers` package (pip install tokenizers)") from None
        self.tokenizer = Tokenizer.from_str(text)

    def encode(self, text):
        if not isinstance(text, str):
            raise TypeError(f"prompt must be a string, got {type(text).__name__}")
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decoder(self):
        from tokenizers.decoders import DecodeStream

        stream, tok = DecodeStream(skip_special_tokens=False), self.tokenizer

        def decode(ids, final=False):
            return "".join(piece for piece in (stream.step(tok, int(i)) for i in ids) if piece)
        return decode

    def token_text(self, token):
        """One token's text, decoded alone."""
        return self.tokenizer.decode([int(token)], skip_special_tokens=False)


def codec(meta):
    """The text codec of a module with metadata `meta`, or None (token ids only)."""
    if meta.get(TOKENIZER):
        text = TokenizerText(meta[TOKENIZER])
        try:   # (a module compiled before the ids were checked)
            check_ids(text.tokenizer, meta.get("vocab_size"))
        except ValueError as err:
            raise ValueError(f"the tokenizer kept in this module {err}; compile it again with "
                             "a tokenizer that fits") from None
        return text
    if (meta.get("config") or {}).get("vocab") == "bytes":
        return ByteText()
    return None


def read_tokenizer(path, vocab_size):
    """The text of the tokenizer.json at `path`, checked: a file the `tokenizers` library
    reads, whose vocabulary (with its added tokens) fits the model's `vocab_size`; ValueError
    naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        json.loads(text)
    except OSError as err:
        raise ValueError(f"tokenizer {path}: {err.strerror}") from None
    except ValueError as err:
        raise ValueError(f"tokenizer {path} is not a tokenizer.json (not JSON: {err})") from None
    try:
        tok = TokenizerText(text).tokenizer
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - the library's own error types
        raise ValueError(f"tokenizer {path} is not a tokenizer.json the `tokenizers` library "
                         f"reads ({err})") from None
    try:
        check_ids(tok, vocab_size)
    except ValueError as err:
        raise ValueError(f"tokenizer {path} {err}") from None
    return text


def read_chat(tokenizer_path):
    """{"template", "bos_token", "eos_token"} from the Hugging Face tokenizer_config.json
    beside the tokenizer.json at `tokenizer_path` (its `chat_template`: a string, or the one
    named "default" of a list of {"name", "template"}), or None where there is none; ValueError
    naming the file where it is not such a file."""
    path = os.path.join(os.path.dirname(os.path.abspath(tokenizer_path)),
                        "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a tokenizer_config.json ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a tokenizer_config.json (not a JSON object)")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None:
        return None
    if not isinstance(template, str):
        raise ValueError(f"{path}: chat_template must be a string (or a list of named "
                         "templates with a 'default')")

    def token(key):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        return value if isinstance(value, str) else None
    return {"template": template, "bos_token": token("bos_token"),
            "eos_token": token("eos_token")}


def check_ids(tok, vocab_size):
    """ValueError ("has ...") unless every id the `tokenizers` tokenizer `tok` gives (its
    vocabulary's and its added tokens') lies in a model vocabulary of `vocab_size` (None: no
    check): the count of its entries says nothing of the largest id."""
    if vocab_size is None:
        return
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ValueError(f"has {size} tokens; the model's vocabulary has {vocab_size}")
    ids = tok.get_vocab(with_added_tokens=True)
    largest = max(ids.items(), key=lambda item: item[1], default=None)
    if largest is not None and not 0 <= largest[1] < vocab_size:
        raise ValueError(f"gives token {largest[0]!r} the id {largest[1]}, beyond the model's "
                         f"vocabulary of {vocab_size} ids (0 to {vocab_size - 1})")
