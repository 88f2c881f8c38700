"""`beamsplit demo` as a newcomer runs it: SmolLM2-135M, four real processes, parity per case.

This is the README's first command and the real model's disaggregated-versus-aggregated check:
every case's beams (widths 1, 2 and 4; plain text and a chat message; prompts of one full block
and of a partial one; a repeated prompt that reuses a block on both sides) must be equal, the text
must be the model's real continuation, every pool empty and every server exited 0. On a timeout
the demo gets SIGINT, which makes it stop its servers by pid before the test fails.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

DEMO_TIMEOUT_S = 240.0


def run_demo(arguments: list[str], log_dir: Path) -> tuple[int, str]:
    command = [sys.executable, "-m", "beamsplit.cli", "demo", "--log-dir", str(log_dir), *arguments]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=DEMO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)  # the demo's finally stops its servers
        try:
            output, _ = process.communicate(timeout=30.0)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        raise AssertionError(f"demo ran past {DEMO_TIMEOUT_S:.0f} s:\n{output}") from None
    return process.returncode, output


def test_demo_on_smollm2(tmp_path: Path) -> None:
    returncode, output = run_demo([], tmp_path)
    assert returncode == 0, output
    parity_lines = [line for line in output.splitlines() if "parity with the aggregated server" in line]
    assert len(parity_lines) == 4, output
    assert all(": equal (" in line for line in parity_lines), output
    assert [re.search(r"\((\d) beams", line).group(1) for line in parity_lines] == ["1", "2", "4", "4"]  # type: ignore[union-attr]
    assert "32 tokens = 1 full block of 32" in output and "1 full + 1 partial block" in output
    assert "text: 'The capital of France is Paris.'" in output  # real text, from the chat template
    assert "context_reused_tokens=32  generation_reused_tokens=32" in output
    assert "KV blocks in use after the run: context 0, generation 0, aggregated 0" in output
    assert "exit codes: coordinator 0, aggregated 0, generation 0, context 0" in output
    assert "PASS" in output.splitlines()[-1]


def test_demo_in_bfloat16(tmp_path: Path) -> None:
    """The fastest dtype on a CPU with native bfloat16 (the compiled attention's bfloat16 dot
    products where the CPU has them): disaggregated beams still equal the aggregated ones."""
    returncode, output = run_demo(["--dtype", "bfloat16"], tmp_path)
    assert returncode == 0, output
    parity_lines = [line for line in output.splitlines() if "parity with the aggregated server" in line]
    assert len(parity_lines) == 4 and all(": equal (" in line for line in parity_lines), output
    assert "max |score diff| 0.0e+00" in parity_lines[-1], output
    assert "KV blocks in use after the run: context 0, generation 0, aggregated 0" in output
    assert "PASS" in output.splitlines()[-1]


def test_demo_names_a_missing_model(tmp_path: Path) -> None:
    returncode, output = run_demo(["--model", str(tmp_path / "nowhere.gguf")], tmp_path)
    assert returncode == 1
    assert "nowhere.gguf" in output and "starting" not in output  # refused before any server starts
