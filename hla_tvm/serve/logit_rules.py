"""What a request asks done to its logits before a token is drawn (OpenAI's and vLLM's fields),
per stream, on float64 copies of the module's logits:

    l[v] += logit_bias[v]                                         (-100..100)
    l[v] -= frequency_penalty * c[v] + presence_penalty * [c[v] > 0]   (-2..2; c[v]: how often
                                                                  v was generated so far)
    l[v] = l[v] / r  if l[v] > 0  else  l[v] * r                  (repetition_penalty r > 0,
                                                                  for v in the prompt or
                                                                  generated, as HF and vLLM)

in that order. Reported log-probabilities (`logprobs`) stay those of the raw logits."""
from __future__ import annotations

import numpy as np

MAX_BIAS = 1024   # entries of one request's logit_bias


def check(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
          logit_bias=None, vocab=None):
    """ValueError naming the field for a value outside its range (`logit_bias`: {token id:
    value})."""
    for name, value in (("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty)):
        if not -2 <= value <= 2:
            raise ValueError(f"{name} must lie in [-2, 2], got {value}")
    if not 0 < repetition_penalty <= 10:
        raise ValueError(f"repetition_penalty must lie in (0, 10], got {repetition_penalty}")
    if logit_bias:
        if len(logit_bias) > MAX_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_BIAS} tokens, got "
                             f"{len(logit_bias)}")
        for tok, value in logit_bias.items():
            if not 0 <= tok < (vocab or 2 ** 63):
                raise ValueError(f"logit_bias token ids must lie in [0, {vocab}), got {tok}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must lie in [-100, 100], got {value}")


class LogitRules:
    """One stream's rules over a vocabulary of `vocab` tokens after `prompt` (token ids)."""

    def __init__(self, vocab, prompt, *, presence_penalty=0.0, frequency_penalty=0.0,
                 repetition_penalty=1.0, logit_bias=None):
        check(presence_penalty, frequency_penalty, repetition_penalty, logit_bias, vocab)
        self.presence, self.frequency, self.repetition = \
            presence_penalty, frequency_penalty, repetition_penalty
        self.bias = None
        if logit_bias:
            self.bias = np.zeros(vocab)
            for tok, value in logit_bias.items():
                self.bias[tok] = value
        self.counts = np.zeros(vocab, np.int64) if presence_penalty or frequency_penalty \
            else None
        self.seen = None
        if repetition_penalty != 1:
            self.seen = np.zeros(vocab, bool)
            self.seen[np.asarray(prompt, np.int64)] = True

    @staticmethod
    def wanted(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
               logit_bias=None):
        """Whether any rule changes the logits."""
        return bool(presence_penalty or frequency_penalty or repetition_penalty != 1 or
                    logit_bias)

    def copy(self):
        out = object.__new__(LogitRules)
        out.__dict__.update({k: v.copy() if isinstance(v, np.ndarray) else v
                             for k, v in self.__dict__.items()})
        return out

    def took(self, token):
        """Count a generated token."""
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True

    def apply(self, row):
        """The logits `row` [vocab] under the rules (a float64 copy)."""
        out = np.array(row, np.float64)
        if self.bias is not None:
            out += self.bias
        if self.counts is not None:
            out -= self.frequency * self.counts + self.presence * (self.counts > 0)
        if self.seen is not None:
            hit = out[self.seen]
            out[self.seen] = np.where(hit > 0, hit / self.repetition, hit * self.repetition)
        return out


def adjusted(logits, rules):
    """`logits` [n, vocab] with row i under `rules[i]` (None: as it is); the same array where
    no row has rules."""
    if all(r is None for r in rules):
        return logits
    out = np.array(logits, np.float64)
    for i, r in enumerate(rules):
        if r is not None:
            out[i] = r.apply(out[i])
    return out
