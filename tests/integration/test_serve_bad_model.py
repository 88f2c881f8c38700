"""A worker given a bad `--model` exits 2 with one line naming the file, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def serve(role: str, model: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "beamsplit.cli", "serve", role, "--model", str(model), "--port", "0"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("role", "name", "content", "reason"),
    [
        ("context", "junk.gguf", b"GGUFjunk", "not a readable GGUF file"),
        ("generation", "missing.gguf", None, "no such file or directory"),
        ("aggregated", "hf", b"config-only", "no *.safetensors"),
    ],
)
def test_bad_model_is_one_line(
    tmp_path: Path, role: str, name: str, content: bytes | None, reason: str
) -> None:
    model = tmp_path / name
    if name == "hf":
        model.mkdir()
        config = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
                  "num_attention_heads": 2}  # fmt: skip
        (model / "config.json").write_text(json.dumps(config))
    elif content is not None:
        model.write_bytes(content)
    result = serve(role, model)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith(f"[{role}] error:")]
    assert len(errors) == 1 and str(model) in errors[0] and reason in errors[0], result.stderr
    assert "Traceback" not in result.stderr
