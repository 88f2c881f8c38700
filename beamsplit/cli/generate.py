"""`beamsplit generate`: its flags, and the in-process run (or the remote one with --target).

Configuration errors from the engine's configs (ValueError naming a field) become argparse
errors naming the flag, so a bad argument exits with status 2 and a message that says which.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from beamsplit.cli import security_args
from beamsplit.cli.engine_args import add_engine_arguments, engine_config_from_args

if TYPE_CHECKING:
    from engine import SamplingParams

# engine config field -> the flag that sets it, so an engine error names what the user typed
FIELD_FLAGS = (
    ("tokens_per_block", "--tokens-per-block"),
    ("num_blocks", "--num-blocks"),
    ("dtype", "--dtype"),
    ("beam_width", "--beam-width"),
    ("max_new_tokens", "--max-new-tokens"),
    ("length_penalty", "--length-penalty"),
    ("early_stopping", "--early-stopping"),
    ("eos_token_id", "--eos-token-id"),
    ("temperature", "--temperature"),
    ("top_k", "--top-k"),
    ("top_p", "--top-p"),
    ("prompt_ids", "--token-ids/--prompt"),
    ("beam search needs enable_partial_commit", "--enable-partial-commit"),
)


def parse_token_ids(text: str) -> list[int]:
    try:
        token_ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not token_ids:
        raise argparse.ArgumentTypeError("needs at least one token id")
    return token_ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)

    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, encoded with the model's tokenizer")
    prompt.add_argument("--token-ids", type=parse_token_ids, help="comma-separated, e.g. 1,2,3")

    sampling = parser.add_argument_group("decoding")
    sampling.add_argument("--beam-width", type=int, default=1, help="1: greedy (or sampling)")
    sampling.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate per beam")
    sampling.add_argument(
        "--length-penalty",
        type=float,
        default=1.0,
        help="score = logprob / length**penalty (> 1 favours long)",
    )
    sampling.add_argument(
        "--early-stopping",
        nargs="?",
        const="true",
        default="false",
        choices=("true", "false", "never"),
        help="stop once beam_width beams finished (alone: true); 'never' as in transformers",
    )
    sampling.add_argument(
        "--no-early-stopping",
        dest="early_stopping",
        action="store_const",
        const="false",
        help="same as --early-stopping false",
    )
    sampling.add_argument("--eos-token-id", type=int, default=None, help="default: the model's eos")
    sampling.add_argument("--temperature", type=float, default=0.0, help="> 0 samples (beam width 1)")
    sampling.add_argument("--top-k", type=int, default=0, help="sample among the k best (0: all)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    sampling.add_argument("--seed", type=int, default=None, help="sampling seed")

    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--target", metavar="HOST:PORT", help="send the request to a running server")
    security_args.add_client_tls_arguments(parser)
    parser.set_defaults(generate_parser=parser)


def run(args: argparse.Namespace) -> int:
    if args.target:
        from beamsplit.client.remote import run_generate_remote

        return int(run_generate_remote(args) or 0)
    try:
        return _run_local(args)
    except FileNotFoundError as error:
        args.generate_parser.error(f"argument --model: {error}")
    except ValueError as error:
        args.generate_parser.error(_name_the_flag(str(error)))
    return 2  # parser.error exits; kept for the type checker


def _run_local(args: argparse.Namespace) -> int:
    from beamsplit.cli.output import beam_record, format_result
    from engine import LLMEngine

    # Loading a real model takes seconds: its progress goes to stderr, stdout keeps the result.
    logging.basicConfig(level=logging.INFO, format="[load] %(message)s", stream=sys.stderr)
    engine = LLMEngine(engine_config_from_args(args))
    prompt_ids = args.token_ids if args.token_ids is not None else engine.tokenizer.encode(args.prompt)
    output = engine.generate(prompt_ids, sampling_params(args))
    if output.error is not None:
        print(f"error: {output.error}", file=sys.stderr)
        return 1
    records = [beam_record(beam, engine.tokenizer.decode(beam.token_ids)) for beam in output.beams]
    print(format_result(records, output.stats, args.json))
    return 0


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    from engine import SamplingParams

    early_stopping: bool | str = {"true": True, "false": False}.get(args.early_stopping, args.early_stopping)
    return SamplingParams(
        beam_width=args.beam_width,
        max_new_tokens=args.max_new_tokens,
        length_penalty=args.length_penalty,
        early_stopping=early_stopping,
        eos_token_id=args.eos_token_id,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )


def _name_the_flag(message: str) -> str:
    for field, flag in FIELD_FLAGS:
        if message.startswith(field):
            return f"argument {flag}: {message}"
    return message
