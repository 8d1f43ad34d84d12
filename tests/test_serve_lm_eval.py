"""lm-evaluation-harness against `hla-tvm serve`, as its users run it: the `local-completions`
model with the server's own tokenizer (`tokenizer_backend=remote`: /tokenizer_info, /tokenize,
/detokenize) on a multiple-choice task read from a local YAML and JSON file (no hub). Every
choice's loglikelihood lm-eval reports is the module's: float64 log-softmax of its logits over
the continuation's tokens, within 1e-4."""
import json

import numpy as np
import pytest

from test_serve_api import start_server, stop_server
from test_serve_choices import log_softmax

pytest.importorskip("httpx")
pytestmark = [pytest.mark.xdist_group("serve"), pytest.mark.slow]

QUESTIONS = [
    {"question": "def main():\n    return", "choices": [" 0", " None", " main"], "answer": 0},
    {"question": "import", "choices": [" os", " sys", " numpy as np"], "answer": 1},
    {"question": "for i in range(10):\n   ", "choices": [" print(i)", " pass"], "answer": 0},
    {"question": "x = [1, 2, 3]\ny =", "choices": [" x", " len(x)", " {}"], "answer": 2},
]

TASK = """task: hla_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def served(compiled_lm):
    path = compiled_lm("bytes", vocab_size=256, vocab="bytes")[1]
    proc, url = start_server(path, "--max-streams", "4", "--name", "model")
    yield path, url
    stop_server(proc)


def test_lm_eval_local_completions_scores_as_the_module(served, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from hla_tvm.runtime import load

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path, url = served
    data = tmp_path / "questions.json"
    data.write_text(json.dumps(QUESTIONS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    result = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"base_url={url}/v1/completions,model=model,tokenizer_backend=remote,"
                   "tokenized_requests=True,num_concurrent=1,max_retries=1,batch_size=2",
        tasks=["hla_local_mc"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True)
    samples = result["samples"]["hla_local_mc"]
    assert len(samples) == len(QUESTIONS)
    model = load(path, threads=1)
    for sample in samples:
        doc = sample["doc"]
        for choice, resp in zip(doc["choices"], sample["resps"]):
            # (lm-eval moves the context's trailing white space to the continuation)
            context = doc["question"].rstrip()
            ctx = list(context.encode())
            cont = list((doc["question"][len(context):] + choice).encode())
            ids = ctx + cont
            rows = log_softmax(model, ids)
            want = sum(rows[i - 1, ids[i]] for i in range(len(ctx), len(ids)))
            assert abs(resp[0][0] - want) <= 1e-4, (doc["question"], choice)
    acc = result["results"]["hla_local_mc"]["acc,none"]
    assert 0 <= acc <= 1 and np.isfinite(acc)
