"""What `bench peers` builds once into its cache folder (bench/out/peers-cache, ignored by git):

    hf-smollm2-135m/        the packaged SmolLM2 GGUF de-quantized to float32 by transformers'
                            GGUF loader, saved as a Hugging Face directory (+ tokenizer)
    venv/                   the peers' own virtual environment, pinned (PEER_PACKAGES): installing
                            optimum-intel pulls its own torch and transformers, which must not
                            land in beamsplit's
    openvino-smollm2-135m/  `optimum-cli export openvino --weight-format fp32` of the HF directory
    ct2-smollm2-135m/       `ct2-transformers-converter --quantization float32` of it

Each step is skipped when its output is there (a `.done` marker written last); a failed step
leaves no marker, so the next run starts it again.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

CACHE_DIR = Path(__file__).resolve().parent / "out" / "peers-cache"
# torch pinned to beamsplit's CPU build, so pip takes the local CPU wheel, not a multi-GB CUDA one.
PEER_PACKAGES = (
    "torch==2.13.0",
    "torchvision==0.28.0",  # optimum-intel requires it; removed after the install (see peer_venv)
    "transformers==5.5.4",  # optimum-intel 2.2 takes transformers < 5.6
    "openvino==2026.4.1",
    "openvino-genai==2026.4.1.0",
    "openvino-tokenizers==2026.4.1.0",
    "optimum-intel[openvino]==2.2.0",
    "nncf==3.4.0",
    "ctranslate2==4.8.5",
    "tokenizers",
    "numpy",
)
INSTALL_TIMEOUT_S = 1800.0
CONVERT_TIMEOUT_S = 1800.0

Say = Callable[[str], None]


def _done(directory: Path) -> bool:
    return (directory / ".done").is_file()


def _finish(staging: Path, directory: Path) -> Path:
    (staging / ".done").write_text("ok\n")
    if directory.exists():
        shutil.rmtree(directory)
    staging.rename(directory)
    return directory


def hf_checkpoint(gguf_path: Path, name: str, say: Say, cache_dir: Path = CACHE_DIR) -> Path:
    """The GGUF de-quantized to float32 as a Hugging Face directory (transformers' own loader,
    the reference the parity tests use)."""
    directory = cache_dir / f"hf-{name}"
    if _done(directory):
        return directory
    say(f"building {directory.name}: de-quantizing {gguf_path.name} with transformers (once)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    staging = cache_dir / f".{directory.name}-staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    # Its tensors are float32 already; only the GGUF marker makes save_pretrained refuse it.
    model.hf_quantizer = None
    if "quantization_config" in model.config.__dict__:
        del model.config.quantization_config
    model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(staging)
    return _finish(staging, directory)


def venv_python(cache_dir: Path = CACHE_DIR) -> Path:
    return cache_dir / "venv" / "bin" / "python"


def peer_venv(say: Say, install: bool, cache_dir: Path = CACHE_DIR) -> tuple[Path | None, str]:
    """The peers' venv python, installed on first use where `install`; (None, why) otherwise."""
    directory = cache_dir / "venv"
    if _done(directory):
        return venv_python(cache_dir), "ready"
    if not install:
        return None, f"no peer venv at {directory} (the full run, without --quick, installs it)"
    say(f"installing the peers into {directory} (once): {' '.join(PEER_PACKAGES)}")
    shutil.rmtree(directory, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(directory)], check=True, timeout=300)
    command = [str(directory / "bin" / "python"), "-m", "pip", "install", "--quiet", *PEER_PACKAGES]
    result = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    if result.returncode != 0:
        return None, f"pip install failed ({result.returncode}): {result.stderr.strip()[-400:]}"
    # PyPI's torchvision is built against the CUDA torch: beside the local CPU torch its ops fail to
    # register and transformers cannot import a model class. Text models never use it.
    subprocess.run([str(directory / "bin" / "python"), "-m", "pip", "uninstall", "--yes", "torchvision"],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    (directory / ".done").write_text("\n".join(PEER_PACKAGES) + "\n")
    return venv_python(cache_dir), "ready"


def converted(
    kind: str, hf_dir: Path, name: str, python: Path, say: Say, cache_dir: Path = CACHE_DIR
) -> Path:
    """`kind` "openvino" or "ctranslate2": the HF directory converted with the peer's own tool,
    run from the peers' venv."""
    directory = cache_dir / f"{kind}-{name}"
    if _done(directory):
        return directory
    staging = cache_dir / f".{directory.name}-staging"
    shutil.rmtree(staging, ignore_errors=True)
    bin_dir = python.parent
    if kind == "openvino":
        command = [str(bin_dir / "optimum-cli"), "export", "openvino", "--model", str(hf_dir),
                   "--task", "text-generation-with-past", "--weight-format", "fp32", str(staging)]  # fmt: skip
    else:
        command = [str(bin_dir / "ct2-transformers-converter"), "--model", str(hf_dir),
                   "--quantization", "float32", "--output_dir", str(staging)]  # fmt: skip
    say(f"converting for {kind} (once): {' '.join(command[:3])} ...")
    result = subprocess.run(command, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(f"{kind} conversion failed ({result.returncode}): {result.stderr.strip()[-400:]}")
    if kind == "ctranslate2":
        shutil.copy(hf_dir / "tokenizer.json", staging / "tokenizer.json")
    return _finish(staging, directory)
