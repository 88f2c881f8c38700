"""`beamsplit serve ROLE --config FILE`: TOML settings as flag defaults, the command line wins."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from beamsplit.cli import build_parser, main
from beamsplit.cli.config_file import parse_args_with_config
from beamsplit.cli.serve import _device_error

DEPLOYMENT = """
model = "tiny"          # shared: every role with --model
dtype = "float64"       # the coordinator has no --dtype and skips it
num_blocks = 128
enable-partial-reuse = true

[context]
port = 6001
lease_s = 12            # an integer is fine for a float flag

[generation]
port = 6002
transfer-lanes = 4

[coordinator]
context = "10.0.0.1:6001,10.0.0.2:6001"
generation = "10.0.0.3:6002"
wait_for_workers_s = 5.5
"""


def parse(argv: list[str]) -> argparse.Namespace:
    return parse_args_with_config(build_parser(), argv)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "beamsplit.toml"
    path.write_text(text)
    return path


def test_each_role_takes_shared_keys_and_its_own_table(tmp_path: Path) -> None:
    path = str(write(tmp_path, DEPLOYMENT))
    context = parse(["serve", "context", "--config", path])
    assert (context.model, context.dtype, context.num_blocks) == ("tiny", "float64", 128)
    assert context.enable_partial_reuse is True
    assert (context.port, context.lease_s) == (6001, 12.0)
    assert isinstance(context.lease_s, float)
    assert context.transfer_lanes is None  # only [generation] sets it

    generation = parse(["serve", "generation", f"--config={path}"])
    assert (generation.port, generation.transfer_lanes, generation.num_blocks) == (6002, 4, 128)

    coordinator = parse(["serve", "coordinator", "--config", path])  # --context/--generation from the file
    assert coordinator.context == "10.0.0.1:6001,10.0.0.2:6001"
    assert coordinator.generation == "10.0.0.3:6002"
    assert (coordinator.model, coordinator.wait_for_workers_s, coordinator.port) == ("tiny", 5.5, 50050)
    assert not hasattr(coordinator, "dtype")

    aggregated = parse(["serve", "aggregated", "--config", path])
    assert (aggregated.num_blocks, aggregated.port) == (128, 50050)  # no [aggregated] table


def test_command_line_overrides_the_file_before_or_after_config(tmp_path: Path) -> None:
    path = str(write(tmp_path, DEPLOYMENT))
    args = parse(["serve", "context", "--port", "7001", "--config", path, "--dtype", "float32"])
    assert (args.port, args.dtype, args.num_blocks) == (7001, "float32", 128)
    args = parse(["serve", "coordinator", "--config", path, "--context", "h:1"])
    assert (args.context, args.generation) == ("h:1", "10.0.0.3:6002")


def test_without_config_defaults_and_required_flags_are_unchanged() -> None:
    args = parse(["serve", "context"])
    assert (args.config, args.num_blocks, args.port) == (None, None, 50051)
    with pytest.raises(SystemExit):
        parse(["serve", "coordinator"])  # --context is still required


def test_a_file_that_gives_the_coordinator_no_workers_still_fails_on_required(tmp_path: Path) -> None:
    path = str(write(tmp_path, 'model = "tiny"\n'))
    with pytest.raises(SystemExit):
        parse(["serve", "coordinator", "--config", path])


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("num_blokcs = 3\n", "unknown key 'num_blokcs' (no such flag --num-blokcs)"),
        ("[context]\nwait_for_workers_s = 3\n", "unknown key 'wait_for_workers_s' in [context]"),
        ("[worker]\nport = 1\n", "unknown table [worker] (expected one of: aggregated, context,"),
        ('num_blocks = "128"\n', "'num_blocks' must be an integer, got '128' (str)"),
        ("num_blocks = true\n", "'num_blocks' must be an integer, got True (bool)"),
        ("num_blocks = 1.5\n", "'num_blocks' must be an integer, got 1.5 (float)"),
        ('[context]\nlease_s = "long"\n', "'context.lease_s' must be a number, got 'long' (str)"),
        ("enable_partial_reuse = 1\n", "'enable_partial_reuse' must be true or false, got 1 (int)"),
        ("model = 3\n", "'model' must be a string, got 3 (int)"),
        ('dtype = "float16"\n', "'dtype' must be one of 'float32', 'float64', 'bfloat16'"),
        ("tokens_per_block = 48\n", "'tokens_per_block' must be one of 16, 32, 64, 128, got 48"),
        ("[context]\ntransfer_lanes = 40\n", "'context.transfer_lanes' must be one of {1..16}, got 40"),
        ("num_blocks = \n", "is not valid TOML"),
    ],
)
def test_a_bad_file_is_one_line_naming_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str
) -> None:
    path = write(tmp_path, text)
    line = run_main(["serve", "context", "--config", str(path)], capsys)
    assert line.startswith("beamsplit serve context: error: ")
    assert str(path) in line
    assert expected in line


def test_a_missing_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.toml"
    line = run_main(["serve", "generation", "--config", str(missing)], capsys)
    assert f"cannot read config file {missing}: No such file or directory" in line


@pytest.mark.parametrize("role", ["aggregated", "context", "generation"])
def test_every_engine_role_takes_device(role: str, tmp_path: Path) -> None:
    assert parse(["serve", role, "--device", "cuda:1"]).device == "cuda:1"
    path = str(write(tmp_path, f'[{role}]\ndevice = "cuda:0"\n'))
    assert parse(["serve", role, "--config", path]).device == "cuda:0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
@pytest.mark.parametrize("role", ["aggregated", "context", "generation"])
def test_cuda_on_a_cpu_host_is_one_line_exit_2(role: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", role, "--device", "cuda:0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        f"[{role}] error: --device cuda:0: CUDA is not available on this host "
        f"({'torch is built without CUDA' if torch.version.cuda is None else 'no CUDA device is visible'}); "
        "use --device cpu"
    )


def test_device_strings() -> None:
    assert _device_error(None) is None
    assert _device_error("cpu") is None
    assert _device_error("gpu") == "--device gpu: not a torch device (expected cpu, cuda or cuda:N)"
    assert _device_error("meta") == "--device meta: only cpu and cuda devices are supported"
