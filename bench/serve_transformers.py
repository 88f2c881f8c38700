"""transformers `generate` on the same checkpoint, dtype and workload, batched as well as it allows.

`generate` runs one static batch at a time and its continuous batching (`generate_batch`) has no
beam search, so the replay is: whenever the model is free, take the oldest request that has
arrived, add the other arrived requests of the same beam width whose prompt length is within 2x
of its length (oldest first) up to MAX_BATCH_ROWS rows (requests x beams) and MAX_BATCH_TOKENS
rows x padded tokens, left-pad them and run
one `generate(num_beams=W, num_return_sequences=W)`; requests arriving meanwhile wait. eos is
off (`eos_token_id=None`), so every beam decodes `max_new_tokens`, as on our servers.

`generate` cannot stream beam search; a logits processor records the time of each decode step
instead (it runs once per step, right after the step's forward), which stands for the step's
tokens reaching a client. Its KV memory is estimated from the cache's shape: `generate` expands
the prompt to W rows before prefill, so a batch holds rows x (padded prompt + new tokens) x
(bytes per token of K and V over all layers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

MAX_BATCH_ROWS = 16
# Rows x padded prompt tokens: bounds the prefill's attention scores (transformers' masked SDPA
# path materializes them: [rows, heads, L, L]); 16384 at L = 4096 is 4 rows, about 4 GiB in float32.
MAX_BATCH_TOKENS = 16384
PAD_TOKEN_ID = 0


class _StepClock:
    """A logits processor that only notes when each decode step's scores are ready."""

    def __init__(self) -> None:
        self.times_s: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times_s.append(time.monotonic())
        return scores


class TransformersSystem:
    def __init__(self, model_dir: Path, kv_bytes_per_token: int, record_type: type) -> None:
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.kv_bytes_per_token = kv_bytes_per_token
        self.record_type = record_type  # workload.RequestRecord
        self.peak_kv_bytes = 0

    def describe(self) -> dict[str, Any]:
        import transformers

        return {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "attention": str(self.model.config._attn_implementation),
            "batching": f"static batches of one beam width, prompt lengths within 2x, up to {MAX_BATCH_ROWS} "
            f"rows (requests x beams) and {MAX_BATCH_TOKENS} rows x padded tokens, left padding; oldest "
            "arrived request first",
            "step_times": "a logits processor notes each decode step (generate cannot stream beams)",
            "kv_estimate": "rows x (padded prompt + max_new_tokens) x kv bytes per token, largest batch",
        }

    def generate(
        self, prompts: Sequence[Sequence[int]], beam_width: int, max_new_tokens: int
    ) -> tuple[list[float], list[list[int]]]:
        """Step times and, per prompt, each returned beam's generated length."""
        from transformers import LogitsProcessorList

        padded_len = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), padded_len), PAD_TOKEN_ID, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), padded_len), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, padded_len - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, padded_len - len(prompt) :] = 1
        clock = _StepClock()
        rows = len(prompts) * beam_width
        self.peak_kv_bytes = max(
            self.peak_kv_bytes, rows * (padded_len + max_new_tokens) * self.kv_bytes_per_token
        )
        with torch.no_grad():
            sequences = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                num_beams=beam_width,
                num_return_sequences=beam_width,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=None,
                pad_token_id=PAD_TOKEN_ID,
                length_penalty=1.0,
                early_stopping=False,
                logits_processor=LogitsProcessorList([clock]),
            )
        generated = sequences[:, padded_len:]  # [len(prompts) * W, new]
        lengths = [[int(generated.shape[1])] * beam_width for _ in prompts]
        return clock.times_s, lengths

    def run_batch(self, specs: Sequence[Any], records: dict[int, Any]) -> None:
        """`records` holds a RequestRecord per spec index, filled in here."""
        beam_width = specs[0].beam_width
        max_new_tokens = specs[0].max_new_tokens
        try:
            step_times, lengths = self.generate(
                [spec.prompt_ids for spec in specs], beam_width, max_new_tokens
            )
        except (RuntimeError, ValueError) as error:
            for spec in specs:
                records[spec.index].error = f"{type(error).__name__}: {error}"
            return
        end = time.monotonic()
        for spec, beam_lengths in zip(specs, lengths, strict=True):
            record = records[spec.index]
            record.step_times_s = list(step_times)
            record.step_counts = [1] * len(step_times)
            record.num_beam_tokens = beam_width * len(step_times)
            record.final_lengths = beam_lengths
            record.finish_reasons = ["length"] * beam_width
            record.end_s = end

    def run_alone(self, spec: Any) -> Any:
        """One request now, alone: its record (the clock starts at the call)."""
        records = {
            spec.index: self.record_type(
                index=spec.index, beam_width=spec.beam_width, sent_s=time.monotonic()
            )
        }
        self.run_batch([spec], records)
        return records[spec.index]

    def replay(self, specs: Sequence[Any], on_done: Callable[[int], None]) -> list[Any]:
        start = time.monotonic()
        records = {
            spec.index: self.record_type(
                index=spec.index, beam_width=spec.beam_width, sent_s=start + spec.arrival_s
            )
            for spec in specs
        }
        pending = sorted(specs, key=lambda spec: spec.arrival_s)
        waiting: list[Any] = []
        while pending or waiting:
            now = time.monotonic() - start
            while pending and pending[0].arrival_s <= now:
                waiting.append(pending.pop(0))
            if not waiting:
                time.sleep(max(0.0, pending[0].arrival_s - now))
                continue
            batch = pick_batch(waiting)
            for spec in batch:
                waiting.remove(spec)
            self.run_batch(batch, records)
            on_done(len(batch))
        return [records[spec.index] for spec in specs]


def pick_batch(
    waiting: Sequence[Any], max_rows: int = MAX_BATCH_ROWS, max_tokens: int = MAX_BATCH_TOKENS
) -> list[Any]:
    """The oldest waiting request and, oldest first, others of its width and a similar length, while
    rows x padded length stays within `max_tokens` (the oldest always goes, even alone above it)."""
    oldest = waiting[0]
    length = len(oldest.prompt_ids)
    max_requests = max(1, max_rows // oldest.beam_width)
    batch = [oldest]
    padded_len = length
    for spec in waiting[1:]:
        if len(batch) >= max_requests:
            break
        if spec.beam_width != oldest.beam_width or not length / 2 <= len(spec.prompt_ids) <= 2 * length:
            continue
        if (len(batch) + 1) * spec.beam_width * max(padded_len, len(spec.prompt_ids)) > max_tokens:
            continue
        batch.append(spec)
        padded_len = max(padded_len, len(spec.prompt_ids))
    return batch
