"""Runs lm-eval several times in one process (one import of lm-eval, torch and transformers):
run inside the lm-eval venv (tests/helpers/lm_eval_venv.py), never in the project's.

    .cache/lm-eval-venv/bin/python tests/helpers/lm_eval_runner.py SPEC.json OUT.json

SPEC: {"task": name, "include_path": dir, "batch_size": n,
       "runs": [{"name": ..., "model": "hf" | "local-completions", "model_args": "k=v,..."}]}
OUT: {run name: {"acc": float, "items": [{"doc_id", "loglikelihoods": [float], "is_greedy": [bool],
      "acc": float}] sorted by doc_id}}
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def main(spec_path: str, out_path: str) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    with open(spec_path) as file:
        spec = json.load(file)
    task = spec["task"]
    task_manager = TaskManager(include_path=spec["include_path"])
    report: dict[str, Any] = {}
    for run in spec["runs"]:
        started = time.monotonic()
        results = lm_eval.simple_evaluate(
            model=run["model"],
            model_args=run["model_args"],
            tasks=[task],
            task_manager=task_manager,
            batch_size=spec.get("batch_size", 1),
            device="cpu",
            log_samples=True,
        )
        assert results is not None
        items = []
        for sample in results["samples"][task]:
            responses = [response[0] for response in sample["resps"]]
            items.append(
                {
                    "doc_id": int(sample["doc_id"]),
                    "loglikelihoods": [float(response[0]) for response in responses],
                    "is_greedy": [bool(response[1]) for response in responses],
                    "acc": float(sample["acc"]),
                }
            )
        items.sort(key=lambda item: item["doc_id"])
        accuracy = float(results["results"][task]["acc,none"])
        report[run["name"]] = {"acc": accuracy, "items": items}
        print(f"lm_eval {run['name']}: acc {accuracy:.3f} in {time.monotonic() - started:.1f} s", flush=True)
    with open(out_path, "w") as file:
        json.dump(report, file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
