"""The choices of one completion, gathered from the engine's events (`engine` docstring) of
its requests (one per prompt of the request's list, `n` choices each): choice `p * n + c` is
choice c of prompt p, as OpenAI numbers them.

    gather = Choices(n, echo_texts, logprobs=k, token_text=model.text.token_text)
    deltas = gather.add(prompt_index, event)   # [(index, text, ids, entries, reason)]
    gather.choice(index)                       # OpenAI's choice object (the whole answer)

An echo (`echo_texts[p]`: the prompt's text, or None without echo) begins each of the prompt's
choices, with its log-probabilities first in theirs (`logprobs.legacy`)."""
from __future__ import annotations

import time
import uuid

from .logprobs import chat, legacy


class Choices:
    def __init__(self, n, echo_texts, *, logprobs=None, token_text=str):
        self.n, self.echo_texts, self.k, self.token_text = n, echo_texts, logprobs, token_text
        count = n * len(echo_texts)
        self.texts = [[] for _ in range(count)]
        self.ids = [[] for _ in range(count)]
        self.entries = [[] for _ in range(count)]
        self.offsets = [0] * count
        self.reasons = [None] * count
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                      "prompt_tokens_details": {"cached_tokens": 0}}
        self.left = count

    def add(self, prompt, event):
        """Take the engine's `event` of the request of prompt `prompt`; the deltas it makes,
        [(index, text, ids, log-probability entries, finish reason)]."""
        kind = event["type"]
        if kind == "echo":
            out = []
            for index in range(prompt * self.n, (prompt + 1) * self.n):
                text = self.echo_texts[prompt]
                self.texts[index].append(text)
                self.entries[index] += event["logprobs"]
                out.append((index, text, [], event["logprobs"], None))
            return out
        index = prompt * self.n + event.get("choice", 0)
        if kind == "text":
            entries = event.get("logprobs", [])
            self.texts[index].append(event["text"])
            self.ids[index] += event["ids"]
            self.entries[index] += entries
            return [(index, event["text"], event["ids"], entries, None)]
        if kind == "done":
            self.reasons[index] = event["finish_reason"]
            self.left -= 1
            usage = event["usage"]
            if event.get("choice", 0) == 0:   # (the prompt counts once for its n choices)
                self.usage["prompt_tokens"] += usage["prompt_tokens"]
                self.usage["prompt_tokens_details"]["cached_tokens"] += \
                    usage["prompt_tokens_details"]["cached_tokens"]
            self.usage["completion_tokens"] += usage["completion_tokens"]
            self.usage["total_tokens"] = self.usage["prompt_tokens"] + \
                self.usage["completion_tokens"]
            return [(index, "", [], [], event["finish_reason"])]
        return []

    def done(self):
        return self.left == 0

    def logprobs_of(self, index, entries):
        """OpenAI's legacy logprobs object of `entries` of choice `index`, their text offsets
        following the choice's earlier ones (None where the request asked for none)."""
        if self.k is None:
            return None
        out, self.offsets[index] = legacy(entries, self.token_text, self.offsets[index])
        return out

    def choice(self, index):
        """The whole choice `index`, as a non-streamed answer gives it."""
        self.offsets[index] = 0
        return {"text": "".join(self.texts[index]), "index": index,
                "logprobs": self.logprobs_of(index, self.entries[index]),
                "finish_reason": self.reasons[index], "token_ids": self.ids[index]}


class TextFormat:
    """OpenAI's `text_completion` objects of the choices `gather` (each choice also carries
    `token_ids`, its generated tokens)."""

    def __init__(self, gather, model):
        self.gather, self.model = gather, model
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def _object(self, choices):
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices}

    def chunk(self, deltas):
        """A streamed chunk of `deltas` [(index, text, ids, entries, finish reason)]."""
        return self._object([{"text": text, "index": index,
                              "logprobs": self.gather.logprobs_of(index, entries),
                              "finish_reason": reason, "token_ids": list(ids)}
                             for index, text, ids, entries, reason in deltas])

    def whole(self):
        out = self._object([self.gather.choice(i) for i in range(len(self.gather.texts))])
        out["usage"] = self.gather.usage
        return out


class ChatFormat(TextFormat):
    """OpenAI's `chat.completion` and `chat.completion.chunk` objects of the choices `gather`:
    the assistant's message (streamed: its role in each choice's first delta), log-probabilities
    in the chat form (`logprobs.chat`)."""

    def __init__(self, gather, model):
        super().__init__(gather, model)
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.started = set()

    def _object(self, choices, kind="chat.completion.chunk"):
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}

    def _logprobs(self, entries):
        return None if self.gather.k is None else chat(entries, self.gather.token_text)

    def chunk(self, deltas):
        out = []
        for index, text, _, entries, reason in deltas:
            delta = {"content": text} if text or reason is None else {}
            if index not in self.started:
                self.started.add(index)
                delta = {"role": "assistant", **delta}
            out.append({"index": index, "delta": delta, "logprobs": self._logprobs(entries),
                        "finish_reason": reason})
        return self._object(out)

    def whole(self):
        g = self.gather
        out = self._object([{"index": i, "message": {"role": "assistant",
                                                      "content": "".join(g.texts[i])},
                             "logprobs": self._logprobs(g.entries[i]),
                             "finish_reason": g.reasons[i]} for i in range(len(g.texts))],
                           "chat.completion")
        out["usage"] = g.usage
        return out
