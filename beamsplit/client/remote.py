"""`beamsplit generate --target HOST:PORT`: the same request and output as the offline command,
sent to a coordinator or an aggregated server.
"""

from __future__ import annotations

import argparse
import sys

import grpc

from beamsplit.cli.output import beam_record, format_result
from beamsplit.client.grpc_client import BeamsplitClient, build_request
from beamsplit.server.request_validation import EARLY_STOPPING_TO_PROTO
from beamsplit.v1 import common_pb2

DEFAULT_TIMEOUT_S = 300.0


def sampling_options_from_args(args: argparse.Namespace) -> common_pb2.SamplingOptions:
    # Values go to the server as typed; the server validates them and names the field.
    early_stopping: bool | str = {"true": True, "false": False}.get(args.early_stopping, args.early_stopping)
    options = common_pb2.SamplingOptions(
        beam_width=args.beam_width,
        max_new_tokens=args.max_new_tokens,
        length_penalty=args.length_penalty,
        early_stopping=EARLY_STOPPING_TO_PROTO[early_stopping],
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
    )
    if args.eos_token_id is not None:
        options.eos_token_id = args.eos_token_id
    if args.seed is not None:
        options.seed = args.seed
    return options


def run_generate_remote(args: argparse.Namespace) -> int:
    request = build_request(
        prompt=args.prompt, token_ids=args.token_ids, sampling=sampling_options_from_args(args)
    )
    timeout_s = float(getattr(args, "timeout_s", None) or DEFAULT_TIMEOUT_S)
    from beamsplit.cli.security_args import load_token
    from beamsplit.server.tls import tls_from_args

    with BeamsplitClient(args.target, tls_from_args(args), load_token(args)) as client:
        try:
            result = client.generate(request, timeout_s=timeout_s)
        except grpc.RpcError as error:
            print(f"error: {args.target}: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    records = [beam_record(beam, text) for beam, text in zip(result.beams, result.texts, strict=True)]
    print(format_result(records, result.stats, args.json))
    return 0
