"""`beamsplit model export --model NAME DIR`: the served model as a Hugging Face directory.

Client tools that count tokens (lm-eval, aiperf, guidellm) load a tokenizer from a directory;
`smollm2-135m` ships as one GGUF file and `tiny` as code, so neither has one to point them at.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="model files: export a model as a Hugging Face directory")
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    export = actions.add_parser(
        "export",
        help="write the model's tokenizer and config.json as a Hugging Face directory",
        description="Write MODEL's tokenizer (tokenizer.json, tokenizer_config.json with the chat template "
        "and special tokens, special_tokens_map.json) and config.json into DIR, so that client tools load "
        "it with transformers' AutoTokenizer and count exactly the tokens the server counts. Weights are "
        "not written unless --weights is given: they are not needed for token counting, and a GGUF "
        "model is de-quantized to float32 for them (about 4 bytes per parameter, 0.5 GB for "
        "smollm2-135m, tens of seconds); a Hugging Face directory's safetensors are copied as they are.",
    )
    export.add_argument(
        "--model",
        required=True,
        help="any --model value of `serve` (tiny, smollm2-135m, a .gguf, a directory)",
    )
    export.add_argument(
        "dir",
        metavar="DIR",
        type=Path,
        help="output directory (created; files of the same names are replaced)",
    )
    export.add_argument(
        "--weights", action="store_true", help="also write model.safetensors (float32; see above)"
    )
    export.set_defaults(handler=run_export)


def run_export(args: argparse.Namespace) -> int:
    from engine.models.export import export_model

    try:
        written = export_model(args.model, args.dir, include_weights=args.weights)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: --model {args.model}: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    print(f"load it with: transformers.AutoTokenizer.from_pretrained({str(args.dir)!r})")
    return 0
