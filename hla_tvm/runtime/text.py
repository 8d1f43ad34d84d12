"""Text in and out of a compiled model (`codec`): byte-level models read and write UTF-8 bytes
(token id = byte); a model compiled with a tokenizer (`hla_tvm.compile(..., tokenizer=
"tokenizer.json")`: the Hugging Face `tokenizers` library's file, kept in the module's metadata)
uses it; other models have no text, only token ids.

    c = codec(model.meta)            # None: token ids only
    ids = c.encode("some text")
    decode = c.decoder()             # incremental: decode([id, ...]) -> the text they complete,
    text = decode(ids) + decode([], final=True)   # final=True flushes what is held back

The `tokenizers` package is needed only for modules compiled with a tokenizer."""
from __future__ import annotations

import json

TOKENIZER = "tokenizer"   # the metadata key holding the tokenizer.json text


class ByteText:
    """UTF-8 bytes: token id = byte value (vocabulary of 256)."""

    kind = "bytes"

    def encode(self, text):
        if not isinstance(text, str):
            raise TypeError(f"prompt must be a string, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decoder(self):
        from .generate import text_decoder

        return text_decoder()


class TokenizerText:
    """A Hugging Face `tokenizers` tokenizer (from its tokenizer.json text)."""

    kind = "tokenizer"

    def __init__(self, text):
        try:
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


def codec(meta):
    """The text codec of a module with metadata `meta`, or None (token ids only)."""
    if meta.get(TOKENIZER):
        return TokenizerText(meta[TOKENIZER])
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
    size = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and size > vocab_size:
        raise ValueError(f"tokenizer {path} has {size} tokens; the model's vocabulary has "
                         f"{vocab_size}")
    return text
