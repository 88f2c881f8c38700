"""One peer system in a process of its own, for `bench peers`: transformers, OpenVINO GenAI or
CTranslate2 runs the workload given as JSON and prints one JSON object on its last line.

    python bench/peers_systems.py SYSTEM MODEL_DIR PRECISION THREADS WORKLOAD_JSON

It imports only the standard library and the system's own packages, so it runs under the peers'
virtual environment (bench/peers_setup.py) as well as under beamsplit's (transformers).
Workload: {"single": [ids], "warm_singles": [[ids], ...], "batches": [[[ids], ...], ...],
"beam_width": 4, "max_new_tokens": 64} (bench/peers.py's make_workload); eos is ignored
everywhere (every beam runs max_new_tokens).
Output: load_s, first_s (the first single request, cold), single_s (each warm repeat),
batch_runs_s (each batch of 16 requests, all submitted at once) and batch_s (their median),
batch_top_beams (the first batch's top beam's new ids per request, in order),
rss_after_load_bytes and peak_rss_bytes.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Generate = Callable[[list[list[int]]], list[list[int]]]  # prompts -> each one's top beam's new ids


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def load_transformers(model_dir: str, precision: str, threads: int, workload: dict[str, Any]) -> Generate:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    width, new_tokens = workload["beam_width"], workload["max_new_tokens"]

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        # Batches of 4 prompts of similar length (left-padded), as a user of `generate` would.
        order = sorted(range(len(prompts)), key=lambda index: len(prompts[index]))
        results: dict[int, list[int]] = {}
        for first in range(0, len(order), 4):
            members = order[first : first + 4]
            longest = max(len(prompts[index]) for index in members)
            ids = torch.zeros((len(members), longest), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, index in enumerate(members):
                prompt = prompts[index]
                ids[row, longest - len(prompt) :] = torch.tensor(prompt)
                mask[row, longest - len(prompt) :] = 1
            with torch.no_grad():
                output = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    num_beams=width,
                    do_sample=False,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,  # eos ignored: every beam runs to the end
                    pad_token_id=0,
                )
            for row, index in enumerate(members):
                results[index] = output[row, longest:].tolist()
        return [results[index] for index in range(len(prompts))]

    return generate


def load_openvino(model_dir: str, precision: str, threads: int, workload: dict[str, Any]) -> Generate:
    import openvino as ov
    import openvino_genai as genai

    hint = "bf16" if precision == "bfloat16" else "f32"
    scheduler = genai.SchedulerConfig()
    scheduler.cache_size = 2  # GB of KV cache
    properties = {
        "INFERENCE_PRECISION_HINT": hint,
        "KV_CACHE_PRECISION": hint,
        "INFERENCE_NUM_THREADS": threads,
    }
    pipeline = genai.ContinuousBatchingPipeline(model_dir, scheduler, "CPU", properties)
    config = genai.GenerationConfig()
    config.num_beams = workload["beam_width"]
    config.num_beam_groups = 1
    config.num_return_sequences = 1
    config.max_new_tokens = workload["max_new_tokens"]
    config.min_new_tokens = workload["max_new_tokens"]
    config.ignore_eos = True
    config.stop_criteria = genai.StopCriteria.NEVER

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        tensors = [ov.Tensor(_int64_array([prompt])) for prompt in prompts]
        results = pipeline.generate(tensors, [config] * len(prompts))
        return [list(result.m_generation_ids[0]) for result in results]

    return generate


def _int64_array(rows: list[list[int]]) -> Any:
    import numpy

    return numpy.array(rows, dtype=numpy.int64)


def load_ctranslate2(model_dir: str, precision: str, threads: int, workload: dict[str, Any]) -> Generate:
    import ctranslate2
    from tokenizers import Tokenizer

    compute_type = "bfloat16" if precision == "bfloat16" else "float32"
    generator = ctranslate2.Generator(
        model_dir, device="cpu", intra_threads=threads, compute_type=compute_type
    )
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    width, new_tokens = workload["beam_width"], workload["max_new_tokens"]

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        tokens = [[tokenizer.id_to_token(token_id) for token_id in prompt] for prompt in prompts]
        results = generator.generate_batch(
            tokens,
            beam_size=width,
            max_length=new_tokens,
            min_length=new_tokens,
            include_prompt_in_result=False,
            max_batch_size=4,
        )
        return [list(result.sequences_ids[0]) for result in results]

    return generate


LOADERS = {"transformers": load_transformers, "openvino": load_openvino, "ctranslate2": load_ctranslate2}


def run_system(
    system: str, model_dir: str, precision: str, threads: int, workload: dict[str, Any]
) -> dict[str, Any]:
    started = time.monotonic()
    generate = LOADERS[system](model_dir, precision, threads, workload)
    report: dict[str, Any] = {"load_s": time.monotonic() - started, "rss_after_load_bytes": _rss_bytes()}
    single = [workload["single"]]
    started = time.monotonic()
    generate(single)
    report["first_s"] = time.monotonic() - started
    times = []
    for prompt in workload["warm_singles"]:  # prompts of their own, as beamsplit's (bench/peers.py)
        started = time.monotonic()
        generate([prompt])
        times.append(time.monotonic() - started)
    report["single_s"] = times
    report["single_median_s"] = statistics.median(times)
    runs = []
    for batch in workload["batches"]:  # bench/peers.py's make_workload: prompts of their own each
        started = time.monotonic()
        top_beams = generate(batch)
        runs.append(time.monotonic() - started)
        report.setdefault("batch_top_beams", top_beams)  # the first batch's
    report["batch_runs_s"] = runs
    report["batch_s"] = statistics.median(runs)
    report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return report


def main(argv: list[str]) -> int:
    if len(argv) != 5 or argv[0] not in LOADERS:
        print(__doc__, file=sys.stderr)
        return 2
    system, model_dir, precision, threads, workload_file = argv
    workload = json.loads(Path(workload_file).read_text())
    print(json.dumps(run_system(system, model_dir, precision, int(threads), workload)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
