"""Scoring through the HTTP front of both deployments, on a random Llama with a real tokenizer.

- echo + logprobs (max_tokens 0, a batch of prompts, one of them with its prefix cached) equal
  transformers' log_softmax of the same pass (float32, 1e-4); the coordinator's (scored by the
  context worker) equal the aggregated server's exactly; generated tokens' log-probs too.
- lm-eval 0.4.13 scores a bundled multiple-choice task through the front (`local-completions`),
  and each item's log-likelihoods equal its `hf` backend's on the same weights (float32, 1e-4),
  with the same accuracy.

lm-eval runs from its own venv (tests/helpers/lm_eval_venv.py), built on first use (13 min on the
shared 2-core host). With it built, the lm-eval test took 3 min 26 s here (cluster start and its
three lm-eval runs in one process); the other two, 2 min 28 s with their own cluster start.
Nothing is downloaded: the task reads the jsonl beside its YAML, and the model is a random Llama
with a trained tokenizer written here.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from beamsplit.launch.launcher import ServerProcess
from beamsplit.launch.local_cluster import LocalCluster
from tests.helpers.checkpoints import write_random_llama_with_tokenizer
from tests.helpers.clusters import module_cluster
from tests.helpers.lm_eval_venv import INSTALL_TIMEOUT_S, lm_eval_executable

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = "beamsplit_mc"
TOLERANCE = 1e-4
NUM_ITEMS = 10
NUM_CHOICES = 4
SERVERS = ["aggregated", "coordinator"]
RUNNER = Path(__file__).parents[1] / "helpers" / "lm_eval_runner.py"
LM_EVAL_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def lm_eval() -> Path:
    # The first use builds the venv (INSTALL_TIMEOUT_S at most); the scores fixture's own bound follows.
    return lm_eval_executable()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_llama_with_tokenizer(tmp_path_factory.mktemp("llama-tokenizer"), seed=5)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled YAML with its data file's absolute path filled in."""
    directory = tmp_path_factory.mktemp("task")
    source = (TASK_DIR / f"{TASK}.yaml").read_text()
    (directory / f"{TASK}.yaml").write_text(source.replace("DATA_FILE", str(TASK_DIR / "items.jsonl")))
    return directory


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, lm_eval: Path
) -> Iterator[LocalCluster]:
    yield from module_cluster(
        tmp_path_factory,
        "lm-eval-cluster",
        engine_arguments=["--model", str(model_dir), "--dtype", "float32", "--tokens-per-block", "16"],
        http=True,
    )


@pytest.fixture(scope="module")
def scores(
    lm_eval: Path,
    model_dir: Path,
    task_dir: Path,
    cluster: LocalCluster,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """lm-eval's results for the hf backend and the front of both deployments, from one process."""
    runs = [{"name": "hf", "model": "hf", "model_args": f"pretrained={model_dir},dtype=float32"}]
    for name in SERVERS:
        url = getattr(cluster, name).http_url
        model_args = (
            f"model={model_dir},base_url={url}/completions,tokenizer_backend=huggingface,"
            f"tokenizer={model_dir},num_concurrent=1,max_retries=1,max_length=512"
        )
        runs.append({"name": name, "model": "local-completions", "model_args": model_args})
    work_dir = tmp_path_factory.mktemp("lm-eval-runs")
    spec = {"task": TASK, "include_path": str(task_dir), "batch_size": 4, "runs": runs}
    (work_dir / "spec.json").write_text(json.dumps(spec))
    environment = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(work_dir / "hf-home"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    finished = subprocess.run(
        [str(lm_eval.parent / "python"), str(RUNNER), str(work_dir / "spec.json"), str(work_dir / "out.json")],
        env=environment, capture_output=True, text=True, timeout=LM_EVAL_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert finished.returncode == 0, f"lm-eval failed:\n{finished.stdout[-3000:]}\n{finished.stderr[-6000:]}"
    print(finished.stdout)
    report: dict[str, Any] = json.loads((work_dir / "out.json").read_text())
    return report


@pytest.mark.timeout(INSTALL_TIMEOUT_S + LM_EVAL_TIMEOUT_S + 120)
@pytest.mark.parametrize("server_name", SERVERS)
def test_lm_eval_scores_through_the_front_equal_the_hf_backend(
    scores: dict[str, Any], server_name: str
) -> None:
    front, reference = scores[server_name], scores["hf"]
    assert [item["doc_id"] for item in front["items"]] == list(range(NUM_ITEMS))
    assert [item["doc_id"] for item in reference["items"]] == list(range(NUM_ITEMS))
    worst = 0.0
    for ours, theirs in zip(front["items"], reference["items"], strict=True):
        assert len(ours["loglikelihoods"]) == len(theirs["loglikelihoods"]) == NUM_CHOICES
        differences = [
            abs(a - b) for a, b in zip(ours["loglikelihoods"], theirs["loglikelihoods"], strict=True)
        ]
        worst = max(worst, *differences)
        assert ours["acc"] == theirs["acc"], (ours, theirs)
        assert ours["is_greedy"] == theirs["is_greedy"], (ours, theirs)
    assert worst <= TOLERANCE, f"largest log-likelihood difference {worst}"
    assert front["acc"] == reference["acc"]
    print(f"{server_name}: acc {front['acc']:.2f} (hf {reference['acc']:.2f}), max |ll diff| {worst:.2e}")


def post(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{server.http_url}/completions", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def reference_logprobs(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """[P, V] transformers' float32 log_softmax of one forward pass."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0], dim=-1)


def scoring_prompts() -> list[list[int]]:
    shared = [(11 * index + 5) % 290 + 3 for index in range(40)]
    return [shared + [7, 8, 9], [(13 * index + 1) % 290 + 3 for index in range(21)]]


def test_echo_logprobs_equal_transformers_on_both_deployments(cluster: LocalCluster, model_dir: Path) -> None:
    prompts = scoring_prompts()
    body = {"model": str(model_dir), "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 3}
    results = {}
    for name in SERVERS:
        server = getattr(cluster, name)
        # The first prompt's 32-token prefix is published: the scored request must not rely on it.
        post(server, {"model": str(model_dir), "prompt": prompts[0][:40], "max_tokens": 1, "temperature": 0})
        results[name] = post(server, body)
        assert results[name]["usage"]["completion_tokens"] == 0
        assert results[name]["usage"]["prompt_tokens"] == sum(len(prompt) for prompt in prompts)
    assert results["aggregated"]["choices"] == results["coordinator"]["choices"]
    choices = results["aggregated"]["choices"]
    assert [choice["index"] for choice in choices] == [0, 1]
    for prompt, choice in zip(prompts, choices, strict=True):
        logprobs = choice["logprobs"]
        assert choice["token_ids"] == [] and len(logprobs["tokens"]) == len(prompt)
        # Nothing generated: no generated token's log-prob either (the one the engine decides and
        # the front drops is sampled at the default temperature, so it differed run to run).
        assert choice["cumulative_logprob"] == 0.0 and choice["score"] == 0.0
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["text_offset"][0] == 0
        assert "".join(logprobs["tokens"]) == choice["text"]
        reference = reference_logprobs(model_dir, prompt)
        for position in range(1, len(prompt)):
            row = reference[position - 1]
            assert abs(logprobs["token_logprobs"][position] - float(row[prompt[position]])) <= TOLERANCE
            # The best 3 and the prompt's token (two ids decoding to one string keep the better).
            allowed = [*torch.topk(row, 3).values.tolist(), float(row[prompt[position]])]
            top = logprobs["top_logprobs"][position]
            assert abs(max(top.values()) - allowed[0]) <= TOLERANCE and len(top) <= 4
            assert all(min(abs(value - other) for other in allowed) <= TOLERANCE for value in top.values())
    wait_for_empty_pools(cluster)


def test_generated_logprobs_equal_on_both_deployments(cluster: LocalCluster, model_dir: Path) -> None:
    prompt = scoring_prompts()[1]
    bodies = [
        {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2, "ignore_eos": True},
        {
            "prompt": prompt,
            "max_tokens": 4,
            "n": 2,
            "use_beam_search": True,
            "logprobs": 2,
            "ignore_eos": True,
        },
        {
            "prompt": prompt,
            "max_tokens": 3,
            "echo": True,
            "logprobs": 1,
            "temperature": 0,
            "ignore_eos": True,
        },
    ]
    for body in bodies:
        body["model"] = str(model_dir)
        aggregated = post(cluster.aggregated, body)["choices"]
        assert post(cluster.coordinator, body)["choices"] == aggregated
        reference = reference_logprobs(model_dir, prompt + aggregated[0]["token_ids"])
        for choice in aggregated:
            logprobs = choice["logprobs"]
            generated = logprobs["token_logprobs"][-len(choice["token_ids"]) :]
            assert abs(sum(generated) - choice["cumulative_logprob"]) <= TOLERANCE
        first = aggregated[0]
        for index, token_id in enumerate(first["token_ids"]):
            expected = float(reference[len(prompt) + index - 1, token_id])
            assert (
                abs(first["logprobs"]["token_logprobs"][-len(first["token_ids"]) + index] - expected)
                <= TOLERANCE
            )
    wait_for_empty_pools(cluster)


def wait_for_empty_pools(cluster: LocalCluster, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    blocks = cluster.blocks_in_use()
    while any(value != 0 for value in blocks.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
        blocks = cluster.blocks_in_use()
    assert all(value == 0 for value in blocks.values()), f"KV blocks still in use: {blocks}"
