"""`beamsplit generate`: the JSON shape, the readable output, and bad arguments named by flag
(also `serve generation --transfer-lanes`)."""

from __future__ import annotations

import json

import pytest
import torch

from beamsplit.cli import main


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def test_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--token-ids", "1,2,3,4,5", "--beam-width", "3", "--max-new-tokens", "6", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"beams", "stats"}
    assert len(result["beams"]) == 3
    for beam in result["beams"]:
        assert set(beam) == {"token_ids", "text", "cumulative_logprob", "score", "finish_reason"}
        assert beam["finish_reason"] in ("stop", "length")
        assert 1 <= len(beam["token_ids"]) <= 6 and isinstance(beam["text"], str)
    scores = [beam["score"] for beam in result["beams"]]
    assert scores == sorted(scores, reverse=True)
    for name in (
        "prompt_tokens",
        "reused_tokens",
        "new_blocks",
        "copied_blocks",
        "peak_blocks",
        "formula_blocks",
    ):
        assert name in result["stats"]
    assert result["stats"]["prompt_tokens"] == 5


def test_readable_output_and_prompt_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "hello", "--max-new-tokens", "4", "--no-early-stopping"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("beam 0: score ") and "stats: prompt_tokens=5" in out


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--token-ids", "1,2", "--beam-width", "0"], "--beam-width"),
        (["--token-ids", "1,x"], "--token-ids"),
        (["--token-ids", "1,2", "--tokens-per-block", "20"], "--tokens-per-block"),
        (["--token-ids", "1,2", "--beam-width", "2", "--temperature", "0.5"], "--temperature"),
        (["--token-ids", "1,2", "--beam-width", "2", "--enable-partial-commit"], "--enable-partial-commit"),
        (["--token-ids", "1,99999"], "--token-ids"),
        (["--token-ids", "1,2", "--model", "/nonexistent/model"], "--model"),
    ],
)
def test_bad_argument_names_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *argv])
    assert exit_info.value.code != 0
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("lanes", ["0", "17", "two"])
def test_bad_transfer_lanes_names_the_flag(lanes: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "generation", "--transfer-lanes", lanes])
    assert exit_info.value.code == 2
    assert "--transfer-lanes" in capsys.readouterr().err
