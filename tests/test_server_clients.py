"""Unmodified third-party clients against the server (installed by the dev dependency group):
lm-evaluation-harness's ``local-completions`` model on a loglikelihood task read from a local file,
and guidellm's streaming benchmark for a short bounded run. Nothing is fetched from a network."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tiny_models import DEFAULT_MODEL

from sparse_serve import LLM, EngineConfig, SamplingParams
from sparse_serve.engine import LLMEngine
from sparse_serve.server import ServerConfig
from sparse_serve.server.background import BackgroundServer

MODEL = "tiny-retrieval"
ENGINE = dict(model=str(DEFAULT_MODEL), device="cpu", max_model_len=512, num_kv_blocks=256, block_size=16)
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# A loglikelihood (multiple-choice) task: which continuation of Python source is more likely.
DOCS = [
    {
        "context": "import os\nimport sys\n\ndef main():\n    print(os.getcwd())\n\nif __name__ ==",
        "choices": [' "__main__":', " 42:"],
        "label": 0,
    },
    {"context": "for i in range(10):\n    total +=", "choices": [" i", " )"], "label": 0},
    {"context": "with open(path) as f:\n    data = f.", "choices": ["read()", "banana"], "label": 0},
]
TASK_YAML = """\
task: sparse_loglik
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(port=0, access_log=False, log_level="warning")
    with BackgroundServer(LLMEngine(EngineConfig(**ENGINE)), config) as srv:
        yield srv


def test_lm_eval_local_completions_loglikelihood(server, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "sparse_loglik.yaml").write_text(TASK_YAML.format(data=data))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": server.url + "/v1/completions",
            "model": MODEL,
            # The server's /tokenizer_info, /tokenize and /detokenize: no tokenizer on the client side.
            "tokenizer_backend": "remote",
            "tokenized_requests": True,
            "num_concurrent": 2,
            "max_retries": 1,
            "batch_size": 2,
        },
        tasks=["sparse_loglik"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True,
    )
    samples = results["samples"]["sparse_loglik"]
    assert len(samples) == len(DOCS)
    # Each choice's loglikelihood equals the engine's own prompt logprobs for the same tokens.
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    llm = LLM(**ENGINE)
    for sample in samples:
        for (context, continuation), (loglik, _greedy) in zip(
            sample["arguments"], [r[0] for r in sample["resps"]], strict=True
        ):
            ctx = tok(context, add_special_tokens=False).input_ids
            whole = tok(context + continuation, add_special_tokens=False).input_ids
            out = llm.generate(whole, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
            expected = sum(e.logprob for e in out.prompt_logprobs[len(ctx) :])
            assert loglik == pytest.approx(expected, abs=1e-3)
    assert results["results"]["sparse_loglik"]["acc,none"] >= 2 / 3


@pytest.mark.slow  # ~40-75 s: guidellm starts worker processes of its own
def test_guidellm_streaming_run(server, tmp_path):
    pytest.importorskip("guidellm")
    out = tmp_path / "guidellm.json"
    cmd = [sys.executable, "-m", "guidellm", "run"]
    cmd += ["--backend", f"kind=openai_http,target={server.url},model={MODEL},request_format=/v1/completions"]
    cmd += ["--profile", "kind=concurrent,streams=2", "--constraint", "kind=max_requests,count=6"]
    cmd += ["--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=6"]
    cmd += ["--tokenizer", json.dumps({"kind": "huggingface_auto", "model": str(DEFAULT_MODEL)})]
    cmd += ["--output", f"kind=json,path={out}", "--disable-console"]
    run = subprocess.run(
        cmd, env={**os.environ, **OFFLINE_ENV}, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    bench = json.loads(out.read_text())["benchmarks"][0]
    # Streaming with stream_options.continuous_usage_stats: every request completed, none errored.
    assert bench["requests"]["errored"] == [] and len(bench["requests"]["successful"]) == 6
    assert all(r["output_metrics"]["text_tokens"] == 6 for r in bench["requests"]["successful"])
