"""deploy/grafana/beamsplit.json: every query is well formed and names only series ServerMetrics exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from beamsplit.server.metrics import ServerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "beamsplit.json"
# The PromQL this dashboard may use; anything else is a typo or needs adding here on purpose.
FUNCTIONS = {"histogram_quantile", "sum", "rate", "clamp_min", "by"}
TOKEN = re.compile(
    r"""\s*(?:
        (?P<number>\d+(?:\.\d+)?(?:e-?\d+)?)
      | (?P<range>\[(?:\$__rate_interval|\d+[smhd])\])
      | (?P<string>"(?:[^"\\]|\\.)*")
      | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
      | (?P<op>[-+*/(){},=]|!=|=~)
    )""",
    re.VERBOSE,
)


def expressions(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr":
                yield value
            else:
                yield from expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from expressions(item)


def tokens(expr: str) -> list[tuple[str, str]]:
    found, position = [], 0
    while position < len(expr.rstrip()):
        match = TOKEN.match(expr, position)
        assert match is not None and match.end() > position, f"cannot parse {expr!r} at {expr[position:]!r}"
        kind = match.lastgroup
        assert kind is not None
        found.append((kind, match.group(kind)))
        position = match.end()
    return found


def check_balanced(expr: str, parsed: list[tuple[str, str]]) -> None:
    pairs, stack = {")": "(", "}": "{"}, []
    for kind, text in parsed:
        if kind != "op":
            continue
        if text in "({":
            stack.append(text)
        elif text in pairs:
            assert stack and stack.pop() == pairs[text], f"unbalanced {text!r} in {expr!r}"
    assert not stack, f"unclosed {stack} in {expr!r}"


def exported_names(kind: str | None = None) -> set[str]:
    """Sample names as scraped (counters end in _total, histograms add _bucket/_sum/_count),
    of every family or of one `kind` ("counter", "gauge", "histogram")."""
    metrics = ServerMetrics("coordinator")
    return {
        sample.name
        for family in metrics.registry.collect()
        if kind is None or family.type == kind
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def test_every_query_parses_and_names_an_exported_series() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_names()
    counters = exported_names("counter")
    queries = list(expressions(dashboard))
    assert len(queries) >= 15
    referenced: set[str] = set()
    for expr in queries:
        parsed = tokens(expr)
        check_balanced(expr, parsed)
        names = [text for kind, text in parsed if kind == "name"]
        series = {name for name in names if name.startswith("beamsplit_")}
        assert series, f"{expr!r} reads no beamsplit series"
        unknown = {name for name in names if not name.startswith("beamsplit_")} - FUNCTIONS
        # Whatever else is a name is a label inside by (...) or {...}.
        labels = set(re.findall(r"by \(([^)]*)\)", expr))
        label_names = {label.strip() for group in labels for label in group.split(",")}
        assert unknown <= label_names, f"{expr!r}: unknown names {unknown - label_names}"
        assert series <= exported, f"{expr!r} names {series - exported}, not exported"
        for name in series:
            if name.endswith("_bucket"):
                assert "histogram_quantile" in expr, f"{expr!r}: buckets without histogram_quantile"
            if name in counters:
                assert "rate(" in expr, f"{expr!r}: a counter graphed without rate()"
        referenced |= series
    # The dashboard graphs every family the issue lists.
    for family in (
        "beamsplit_time_to_first_token_seconds_bucket",
        "beamsplit_inter_token_latency_seconds_bucket",
        "beamsplit_e2e_latency_seconds_bucket",
        "beamsplit_requests_total",
        "beamsplit_scheduler_waiting_requests",
        "beamsplit_engine_queued_commands",
        "beamsplit_kv_blocks_capacity",
        "beamsplit_kv_blocks_in_use",
        "beamsplit_kv_blocks_cached",
        "beamsplit_prefix_reused_tokens_total",
        "beamsplit_prefix_prompt_tokens_total",
        "beamsplit_transfer_bytes_total",
        "beamsplit_transfer_failures_total",
        "beamsplit_transfers_in_flight",
        "beamsplit_lease_expiries_total",
        "beamsplit_kv_block_copies_total",
    ):
        assert family in referenced, f"the dashboard does not graph {family}"


def test_the_checker_refuses_a_misspelt_series() -> None:
    exported = exported_names()
    parsed = tokens("sum(rate(beamsplit_transfer_byte_total[5m]))")
    assert {text for kind, text in parsed if kind == "name" and text.startswith("beamsplit_")} - exported
