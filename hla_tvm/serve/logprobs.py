"""Log-probabilities of tokens, as OpenAI's completions report them (`logprobs: k`, `echo`):

    logprob(t | row) = row[t] - log sum_v exp(row[v])     (float64, from the module's float32
                                                           logits `row`, before temperature)

`scores(rows, tokens, k)` gives each token's log-probability under its row and the k most
likely tokens' ({id: logprob}); `legacy(entries, token_text, offset)` writes them as OpenAI's
legacy `logprobs` object: tokens (their text), token_logprobs, top_logprobs and text_offset
(characters of the token texts before each, from `offset`). An echoed prompt's first token has
no row before it: its entry is (id, None, None), null in both lists."""
from __future__ import annotations

import numpy as np

MAX_TOP = 5   # the most top_logprobs a request may ask (OpenAI's bound)


def scores(rows, tokens, k):
    """[(token, logprob, {id: logprob of the k most likely})] for each `tokens[i]` under
    `rows[i]` ([n, vocab] logits)."""
    rows = np.asarray(rows, dtype=np.float64)
    if not len(rows):
        return []
    top = rows.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
    out = []
    if k:
        best = np.argpartition(-rows, min(k, rows.shape[1]) - 1, axis=1)[:, :k]
    for i, tok in enumerate(tokens):
        lp = float(rows[i, tok] - lse[i])
        chosen = {}
        if k:
            ids = sorted(best[i].tolist(), key=lambda j: -rows[i, j])
            chosen = {int(j): float(rows[i, j] - lse[i]) for j in ids}
        out.append((int(tok), lp, chosen))
    return out


def legacy(entries, token_text, offset=0):
    """OpenAI's legacy `logprobs` object of `entries` [(id, logprob or None, {id: logprob} or
    None)], the token texts given by `token_text(id)`; text offsets count from `offset`. Returns
    (object, the offset after the last token)."""
    tokens, lps, tops, offsets = [], [], [], []
    for tok, lp, top in entries:
        text = token_text(tok)
        tokens.append(text)
        lps.append(lp)
        tops.append(None if top is None else {token_text(t): v for t, v in top.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}, offset


def chat(entries, token_text):
    """The chat completions' `logprobs` object of `entries`: {"content": [{"token", "logprob",
    "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}."""
    def item(tok, lp):
        text = token_text(tok)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    return {"content": [dict(item(tok, lp), top_logprobs=[item(t, v) for t, v in
                                                          (top or {}).items()])
                        for tok, lp, top in entries]}
