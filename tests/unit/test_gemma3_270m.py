"""The real sliding-window model: Gemma 3 270M (Q4_K_M GGUF) against transformers reading the same file.

Checked here:
- the config the engine reads from the metadata is transformers' own Gemma3TextConfig for the file
  (18 layers, every 6th global, window 512, head_dim 256, rope bases 1e6 / 1e4);
- the tokenizer built from the metadata (SentencePiece BPE with byte fallback, bos prepended)
  encodes and decodes as transformers' GGUF tokenizer on varied text;
- every de-quantized weight equals transformers' bit for bit;
- float64 logits at positions inside, at and past the 512-token window (prefilled in chunks), and
  beam search 4 on prompts of 6 to 640 tokens, equal transformers' (`generate`, the same file).
Needs the gemma3-270m packages (scripts/setup.sh installs them); skipped with the pip command
otherwise.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import engine as engine_package
from beamsplit.cli import main
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.attention import prepare_attention
from engine.kv_pool import KVPool
from engine.models.gguf_checkpoint import GGUFCheckpoint
from engine.models.source import PACKAGED_MODELS, resolve_model_source
from engine.tokenizer import Tokenizer
from tests.helpers.hf_reference import reference_beams

transformers = pytest.importorskip("transformers")
# Parsing 262144 tokens' metadata is slow in `gguf` and in transformers alike (seconds alone, a
# minute on a shared 2-core machine): the default 300 s bound per test is too tight under load.
pytestmark = pytest.mark.timeout(1200)

MODEL = "gemma3-270m"
TEXTS = (
    "The capital of France is",
    "  two spaces,   three\n\nnewlines\n and a tab\there",
    "1234567 3.14159 2024-12-06",
    "naïve café Ünïcödé — “quotes” 東京 日本語のテキスト",
    "emoji 🙂👍🏽🇫🇷 end",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "",
    " leading space",
    "trailing space ",
    "\u2581literal lower block",
    "x" * 50 + " " * 40 + "y",
    "<unused3> and <mask>",
    "a\r\nb\u00a0c\u200bd",
)
BOOKKEEPING = {
    "transformers_version", "_name_or_path", "_model_name_or_path", "dtype", "architectures", "pad_token_id",
    "unk_token_id", "use_cache",
}  # fmt: skip


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        path = resolve_model_source(MODEL).path
    except FileNotFoundError:
        pytest.skip(f"{MODEL} is not installed: {PACKAGED_MODELS[MODEL].install_hint}")
    assert path is not None
    return path


@pytest.fixture(scope="module")
def checkpoint(gguf_path: Path) -> GGUFCheckpoint:
    return GGUFCheckpoint.open(gguf_path)


@pytest.fixture(scope="module")
def tokenizer(checkpoint: GGUFCheckpoint) -> Tokenizer:
    return checkpoint.tokenizer()


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def test_config_is_transformers_config(checkpoint: GGUFCheckpoint, gguf_path: Path) -> None:
    expected = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).to_dict()
    read = transformers.Gemma3TextConfig(**checkpoint.hf_config).to_dict()
    # transformers keeps the file's float32 epsilon (9.99999997e-07); config.json says 1e-06
    assert read.pop("rms_norm_eps") == 1e-6 and expected.pop("rms_norm_eps") == pytest.approx(1e-6, rel=1e-7)
    differing = {key for key in read.keys() | expected.keys() if read.get(key) != expected.get(key)}
    assert differing <= BOOKKEEPING
    assert checkpoint.hf_config["layer_types"].count("full_attention") == 3
    assert checkpoint.hf_config["sliding_window"] == 512


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(tokenizer: Tokenizer, reference_tokenizer: Any, text: str) -> None:
    expected = reference_tokenizer(text).input_ids
    assert expected[0] == tokenizer.bos_token_id == 2  # Gemma prepends <bos>
    assert tokenizer.encode(text) == expected
    assert tokenizer.decode(expected) == reference_tokenizer.decode(expected, skip_special_tokens=True)


def test_text_starting_with_bos_gets_one(tokenizer: Tokenizer, reference_tokenizer: Any) -> None:
    # A chat template writes <bos> itself; apply_chat_template then adds none. The engine encodes
    # rendered text with `encode`, so it adds bos only where the text lacks it (transformers'
    # plain call would give two here).
    assert tokenizer.encode("<bos>Hi") == reference_tokenizer("<bos>Hi", add_special_tokens=False).input_ids
    assert tokenizer.encode("<bos>Hi")[:2] == [
        2,
        reference_tokenizer("Hi", add_special_tokens=False).input_ids[0],
    ]


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> Any:
    """transformers' Gemma3ForCausalLM from the same file, de-quantized at load, float64."""
    torch.set_num_threads(2)
    quantization = transformers.GgufConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float64, quantization_config=quantization
    ).eval()


def test_weights_equal_transformers(checkpoint: GGUFCheckpoint, reference: Any) -> None:
    """Every tensor, de-quantized and converted back (norms minus 1), bit-equal to transformers'."""
    state = checkpoint.state_dict(torch.float64)
    expected = {name.removeprefix("model."): tensor for name, tensor in reference.state_dict().items()}
    expected.pop("lm_head.weight")  # tied: the embedding
    assert sorted(state) == sorted(expected)
    differing = [name for name, tensor in state.items() if not torch.equal(tensor, expected[name])]
    assert differing == []


# A text long enough that its prompts run well past the 512-token window of the sliding layers.
STORY = " ".join(
    f"Day {day}: the ship sailed {direction} past {place}, and the crew counted {day * 7} gulls."
    for day, (direction, place) in enumerate(
        [("north", "the lighthouse"), ("east", "a fishing village"), ("south", "the red cliffs"),
         ("west", "an island of pines"), ("north-east", "two wrecks")] * 12, start=1,
    )
)  # fmt: skip
FRANCE = "The capital of France is"
MAX_NEW_TOKENS = 8
SCORE_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def engine(gguf_path: Path) -> Iterator[LLMEngine]:
    # One pool of 3-layer pages shared by 6 KV groups: a 640-token beam-4 request may hold up to
    # 24 pages in each, 144 in all.
    yield LLMEngine(
        EngineConfig(model=MODEL, dtype="float64", cache=CacheConfig(tokens_per_block=32, num_blocks=192))
    )


def prompt_of(tokenizer: Tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` ids of STORY (bos first), so lengths land on chosen block boundaries."""
    ids = tokenizer.encode(STORY)
    assert len(ids) >= num_tokens, len(ids)
    return ids[:num_tokens]


def test_logits_match_transformers_past_the_window(engine: LLMEngine, reference: Any) -> None:
    prompt = prompt_of(engine.tokenizer, 700)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]  # [T, V]
    positions = [5, 511, 512, 513, 699]  # inside, at and past the 512-token window
    logits = engine_logits(engine, prompt, positions)
    assert not torch.equal(logits[3], logits[4])  # five different rows, not one broadcast
    difference = (logits - expected[positions]).abs().max().item()
    print(f"max |logit difference| over {len(positions)} positions: {difference:.3g}")
    assert difference < 1e-9


# A few tokens, a few blocks, and past the window (decoding at 640..647); the logits test above
# covers the positions either side of 512. More lengths cost ~30 s each (2.5 min on a loaded machine).
@pytest.mark.parametrize("num_tokens", [6, 96, 640])
def test_beam_search_4_matches_transformers(engine: LLMEngine, reference: Any, num_tokens: int) -> None:
    eos = engine.tokenizer.eos_token_id
    prompt = engine.tokenizer.encode(FRANCE) if num_tokens == 6 else prompt_of(engine.tokenizer, num_tokens)
    assert len(prompt) == num_tokens
    expected = reference_beams(reference, prompt, 4, MAX_NEW_TOKENS, 1.0, False, eos)
    output = engine.generate(
        prompt,
        SamplingParams(beam_width=4, max_new_tokens=MAX_NEW_TOKENS, length_penalty=1.0, eos_token_id=eos),
    )
    engine.check_integrity()
    assert engine.num_blocks_in_use() == 0
    for index, (beam, (tokens, score, stopped)) in enumerate(zip(output.beams, expected, strict=True)):
        assert beam.token_ids == tokens, f"beam {index}: {engine.tokenizer.decode(beam.token_ids)!r}"
        assert math.isclose(beam.score, score, rel_tol=0.0, abs_tol=SCORE_TOLERANCE), f"beam {index}"
        assert beam.finish_reason == ("stop" if stopped else "length"), f"beam {index}"
    if num_tokens == 6:
        assert (
            engine.tokenizer.decode(output.beams[0].token_ids) == " one of the most beautiful cities in the"
        )


def engine_logits(engine: LLMEngine, prompt: list[int], positions: list[int]) -> torch.Tensor:
    """The engine model's logits after each of `positions`, prefilling the prompt in chunks that end
    there (so the sliding layers also read their window across chunks), in a pool of its own."""
    config = engine.model_config
    pool = KVPool(config, CacheConfig(tokens_per_block=32, num_blocks=24), torch.float64, "cpu")
    block_ids = list(range(24))
    rows, start = [], 0
    for position in positions:
        metadata = prepare_attention(
            [(block_ids, start, position + 1 - start)],
            32,
            torch.device("cpu"),
            sliding_windows=config.sliding_windows,
        )
        with torch.no_grad():
            rows.append(
                engine.runner.model(
                    torch.tensor(prompt[start : position + 1]), metadata.positions, pool, metadata
                )[0]
            )
        start = position + 1
    return torch.stack(rows)  # [len(positions), V]


def test_cli_generate_json_lists_transformers_beams(
    engine: LLMEngine, reference: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`beamsplit generate --model gemma3-270m ... --json`, on this module's float64 engine (a second
    load would double the test's time; the CLI's own float32 run is quoted in docs/model.md)."""
    built: list[str] = []

    def reuse_engine(config: EngineConfig) -> LLMEngine:
        built.append(config.model)
        return engine

    monkeypatch.setattr(engine_package, "LLMEngine", reuse_engine)  # what the CLI imports
    argv = [
        "generate",
        "--model",
        MODEL,
        "--prompt",
        FRANCE,
        "--beam-width",
        "4",
        "--max-new-tokens",
        "8",
        "--json",
    ]
    assert main(argv) == 0
    assert built == [MODEL]
    beams = json.loads(capsys.readouterr().out)["beams"]
    expected = reference_beams(
        reference, engine.tokenizer.encode(FRANCE), 4, 8, 1.0, False, engine.tokenizer.eos_token_id
    )
    assert [beam["token_ids"] for beam in beams] == [tokens for tokens, _, _ in expected]
    assert beams[0]["text"] == " one of the most beautiful cities in the"
