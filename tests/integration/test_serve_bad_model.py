"""A worker given a bad `--model` exits 2 with one line naming the file, never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.checkpoints import write_random_llama_checkpoint


def serve(role: str, model: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "beamsplit.cli", "serve", role, "--model", str(model), "--port", "0"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def assert_one_line_error(
    result: subprocess.CompletedProcess[str], role: str, names: Path, reason: str
) -> None:
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith(f"[{role}] error:")]
    assert len(errors) == 1 and str(names) in errors[0] and reason in errors[0], result.stderr
    assert "Traceback" not in result.stderr


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
    assert_one_line_error(serve(role, model), role, model, reason)


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_llama_checkpoint(
        tmp_path_factory.mktemp("good"), vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1,
        num_heads=2, num_kv_heads=1,
    )  # fmt: skip


def _truncate(fraction: float) -> Callable[[Path], Path]:
    def damage(model: Path) -> Path:
        weights = model / "model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(data[: int(len(data) * fraction)])
        return weights

    return damage


def _remove_config(model: Path) -> Path:
    (model / "config.json").unlink()
    return model


def _corrupt_config(model: Path) -> Path:
    (model / "config.json").write_text("{not json")
    return model / "config.json"


def _reshape_config(model: Path) -> Path:
    config = json.loads((model / "config.json").read_text())
    config["hidden_size"] = 16  # the tensors stay 8 wide
    (model / "config.json").write_text(json.dumps(config))
    return model / "model.safetensors"


@pytest.mark.parametrize(
    ("case", "damage", "reason"),
    [
        ("truncated safetensors", _truncate(0.5), "not a readable safetensors file"),
        ("no config.json", _remove_config, "no config.json"),
        ("config.json not JSON", _corrupt_config, "not valid JSON"),
        ("wrong shapes", _reshape_config, "config says"),
    ],
)
def test_malformed_checkpoint_directory(
    good_checkpoint: Path, tmp_path: Path, case: str, damage: Callable[[Path], Path], reason: str
) -> None:
    model = Path(shutil.copytree(good_checkpoint, tmp_path / "model"))
    named = damage(model)
    assert_one_line_error(serve("context", model), "context", named, reason)
