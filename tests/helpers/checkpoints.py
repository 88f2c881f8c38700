"""Random tiny Llama checkpoints written by transformers itself, the reference the engine must match."""

from __future__ import annotations

from pathlib import Path


def write_random_llama_checkpoint(
    directory: str | Path,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    vocab_size: int = 96,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_layers: int = 2,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 512,
    max_shard_size: str | None = None,
    rope_scaling: dict[str, float | int | str] | None = None,
) -> Path:
    """Builds a LlamaForCausalLM with seeded weights and saves it with save_pretrained.

    Weights are redrawn with std 1/sqrt(fan_in) (norm weights around 1) instead of the default
    0.02, so logits are far from uniform and a parity test compares meaningful numbers.
    `rope_scaling` (e.g. {"rope_type": "llama3", "factor": 8.0, ...}) joins `rope_parameters`.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})},
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters(), key=lambda item: item[0]):
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * torch.randn(parameter.shape, generator=generator)
            elif parameter.dim() == 2 and "embed_tokens" not in name:
                values = torch.randn(parameter.shape, generator=generator) / parameter.shape[-1] ** 0.5
            else:
                values = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(values)
    if max_shard_size is None:
        model.save_pretrained(directory)
    else:  # several *.safetensors plus model.safetensors.index.json
        model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def write_random_lfm2_checkpoint(
    directory: str | Path,
    *,
    layer_types: tuple[str, ...] = ("conv", "full_attention", "conv", "full_attention"),
    num_heads: int = 4,
    num_kv_heads: int = 2,
    conv_kernel_size: int = 3,
    conv_bias: bool = False,
    tie_word_embeddings: bool = True,
    auto_adjust_ff_dim: bool = False,
    seed: int = 0,
    vocab_size: int = 96,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    max_position_embeddings: int = 512,
) -> Path:
    """Builds an Lfm2ForCausalLM (a hybrid: short-convolution and attention layers) with seeded
    weights, drawn as for Llama above (biases std 1/sqrt(fan_in) too), and saves it."""
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    directory = Path(directory)
    config = Lfm2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=len(layer_types),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        layer_types=list(layer_types),
        conv_L_cache=conv_kernel_size,
        conv_bias=conv_bias,
        block_auto_adjust_ff_dim=auto_adjust_ff_dim,
        block_multiple_of=16,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = Lfm2ForCausalLM(config)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters(), key=lambda item: item[0]):
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * torch.randn(parameter.shape, generator=generator)
            elif "embed_tokens" in name:
                values = torch.randn(parameter.shape, generator=generator)
            else:
                # Linear and convolution weights by their last axis; biases as small offsets.
                values = torch.randn(parameter.shape, generator=generator) / parameter.shape[-1] ** 0.5
            parameter.copy_(values)
    model.save_pretrained(directory)
    return directory


TOKENIZER_CORPUS = (
    "Question: the sky on a clear day is blue, water freezes into ice, a cat says meow.",
    "Answer: two plus two is four; the sun rises in the east; bees make honey; we read a book.",
    "Fish live in water, snow is white, and a week has seven days of hours and years.",
    "The quick brown fox jumps over the lazy dog while the green river runs to the south.",
)


def write_random_llama_with_tokenizer(
    directory: str | Path, *, vocab_size: int = 300, seed: int = 0, chat_template: str | None = None
) -> Path:
    """A random Llama checkpoint with a real byte-level BPE `tokenizer.json` (trained here on a
    fixed corpus, so it is the same everywhere) and a `tokenizer_config.json` that transformers'
    AutoTokenizer loads: the directory any Hugging Face tool (lm-eval's `hf` model) can open.
    Specials: <unk> 0, <s> 1 (bos), </s> 2 (eos); the model's vocabulary is the tokenizer's.
    chat_template: written into tokenizer_config.json (chat completions need one)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = Path(directory)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TOKENIZER_CORPUS * 4, trainer=trainer)
    write_random_llama_checkpoint(
        directory, vocab_size=tokenizer.get_vocab_size(), seed=seed, tie_word_embeddings=False
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "model_max_length": 512,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory
