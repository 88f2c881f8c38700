"""lm-eval 0.4.13 scores a bundled multiple-choice task through the HTTP front (`local-completions`,
echo + logprobs, batches of prompts) on both deployments, and each item's log-likelihoods equal
its `hf` backend's on the same weights (float32, 1e-4), with the same accuracy.

lm-eval runs from its own venv (tests/helpers/lm_eval_venv.py), built on first use (~6 min on the
2-core CI host); the rest takes under 4 minutes. Nothing is downloaded: the task reads the jsonl
beside its YAML, and the model is a random Llama with a trained tokenizer written here.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from beamsplit.launch.local_cluster import LocalCluster, start_local_cluster
from tests.helpers.checkpoints import write_random_llama_with_tokenizer
from tests.helpers.lm_eval_venv import INSTALL_TIMEOUT_S, lm_eval_executable

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = "beamsplit_mc"
TOLERANCE = 1e-4
NUM_ITEMS = 10
LM_EVAL_TIMEOUT_S = 240

pytestmark = pytest.mark.timeout(INSTALL_TIMEOUT_S + 600)


@pytest.fixture(scope="module")
def lm_eval() -> Path:
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
    log_dir = tmp_path_factory.mktemp("lm-eval-cluster")
    started = start_local_cluster(
        log_dir,
        engine_arguments=["--model", str(model_dir), "--dtype", "float32", "--tokens-per-block", "16"],
        startup_timeout_s=180.0,
        http=True,
    )
    try:
        yield started
    finally:
        codes = started.stop()
    assert all(code == 0 for code in codes.values()), f"unclean exits {codes}; logs in {log_dir}"


def run_lm_eval(lm_eval: Path, model: str, model_args: str, task_dir: Path, output_dir: Path) -> list[dict]:
    """One lm_eval run; returns its samples (one per item, sorted by doc_id)."""
    environment = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(output_dir / "hf-home"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    command = [
        str(lm_eval), "--model", model, "--model_args", model_args, "--tasks", TASK,
        "--include_path", str(task_dir), "--batch_size", "4", "--output_path", str(output_dir),
        "--log_samples",
    ]  # fmt: skip
    if model == "hf":
        command += ["--device", "cpu"]
    finished = subprocess.run(
        command, env=environment, capture_output=True, text=True, timeout=LM_EVAL_TIMEOUT_S, check=False
    )
    assert finished.returncode == 0, (
        f"lm_eval {model} failed:\n{finished.stdout[-3000:]}\n{finished.stderr[-6000:]}"
    )
    paths = sorted(output_dir.glob(f"**/samples_{TASK}_*.jsonl"))
    assert len(paths) == 1, f"expected one samples file under {output_dir}, found {paths}"
    with open(paths[0]) as file:
        samples = [json.loads(line) for line in file if line.strip()]
    return sorted(samples, key=lambda sample: sample["doc_id"])


def loglikelihoods(sample: dict) -> list[float]:
    """The item's log-likelihood of each choice, as lm-eval scored it."""
    return [float(response[0][0]) for response in sample["resps"]]


@pytest.mark.parametrize("server_name", ["aggregated", "coordinator"])
def test_lm_eval_scores_through_the_front_equal_the_hf_backend(
    lm_eval: Path,
    model_dir: Path,
    task_dir: Path,
    cluster: LocalCluster,
    tmp_path: Path,
    server_name: str,
    hf_samples: list[dict],
) -> None:
    server = getattr(cluster, server_name)
    model_args = (
        f"model={model_dir},base_url={server.http_url}/completions,tokenizer_backend=huggingface,"
        f"tokenizer={model_dir},num_concurrent=1,max_retries=1,max_length=512"
    )
    front = run_lm_eval(lm_eval, "local-completions", model_args, task_dir, tmp_path / "front")
    assert [sample["doc_id"] for sample in front] == list(range(NUM_ITEMS))
    worst = 0.0
    for ours, theirs in zip(front, hf_samples, strict=True):
        ours_ll, theirs_ll = loglikelihoods(ours), loglikelihoods(theirs)
        assert len(ours_ll) == len(theirs_ll) == len(ours["doc"]["choices"])
        worst = max(worst, *(abs(a - b) for a, b in zip(ours_ll, theirs_ll, strict=True)))
        assert ours["acc"] == theirs["acc"], (ours["doc_id"], ours_ll, theirs_ll)
    assert worst <= TOLERANCE, f"largest log-likelihood difference {worst}"
    accuracy = sum(sample["acc"] for sample in front) / NUM_ITEMS
    print(f"{server_name}: acc {accuracy:.2f} over {NUM_ITEMS} items; max |ll diff| vs hf {worst:.2e}")


@pytest.fixture(scope="module")
def hf_samples(
    lm_eval: Path, model_dir: Path, task_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[dict]:
    output_dir = tmp_path_factory.mktemp("lm-eval-hf")
    samples = run_lm_eval(lm_eval, "hf", f"pretrained={model_dir},dtype=float32", task_dir, output_dir)
    assert [sample["doc_id"] for sample in samples] == list(range(NUM_ITEMS))
    accuracy = sum(sample["acc"] for sample in samples) / NUM_ITEMS
    print(f"hf: acc {accuracy:.2f} over {NUM_ITEMS} items")
    return samples
