"""How `beamsplit generate` prints a result, in-process or remote: one JSON object or readable text.

A beam is a mapping with token_ids, text, cumulative_logprob, score and finish_reason (the JSON
shape); `beam_record` builds one from an engine Beam. Beams are printed in the order given
(best first).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

BEAM_FIELDS = ("token_ids", "text", "cumulative_logprob", "score", "finish_reason")


class BeamLike(Protocol):
    @property
    def token_ids(self) -> list[int]: ...

    @property
    def cumulative_logprob(self) -> float: ...

    @property
    def score(self) -> float: ...

    @property
    def finish_reason(self) -> str: ...


def beam_record(beam: BeamLike, text: str) -> dict[str, Any]:
    return {
        "token_ids": list(beam.token_ids),
        "text": text,
        "cumulative_logprob": float(beam.cumulative_logprob),
        "score": float(beam.score),
        "finish_reason": beam.finish_reason,
    }


def format_result(beams: Sequence[Mapping[str, Any]], stats: Mapping[str, Any], as_json: bool) -> str:
    records = [{name: beam[name] for name in BEAM_FIELDS} for beam in beams]
    if as_json:
        return json.dumps({"beams": records, "stats": dict(stats)})
    lines = []
    for index, record in enumerate(records):
        lines.append(
            f"beam {index}: score {record['score']:.6f}  cumulative_logprob "
            f"{record['cumulative_logprob']:.6f}  finish {record['finish_reason']}  "
            f"{len(record['token_ids'])} tokens"
        )
        lines.append(f"  text: {record['text']!r}")
        lines.append(f"  token_ids: {record['token_ids']}")
    lines.append("stats: " + "  ".join(f"{name}={_format_value(value)}" for name, value in stats.items()))
    return "\n".join(lines)


def _format_value(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)
