"""Command-line flags as engine server arguments, read by SGLang 0.5.23's own parser."""

from __future__ import annotations

import argparse
import json

import pytest

from qsa_testing import (
    PRODUCTION_FLAGS,
    EngineConfig,
    EngineConfigError,
    server_args_of_flags,
    tiny_qwen4_exp,
)

MODEL_PATH = "/models/m"


def test_flags_become_the_fields_they_set_and_nothing_else() -> None:
    flags = ["--page-size", "64", "--disable-radix-cache", "--cuda-graph-bs-decode", "1", "2"]
    assert server_args_of_flags(flags) == {
        "page_size": 64,
        "disable_radix_cache": True,
        "cuda_graph_bs_decode": [1, 2],
    }


def test_a_flag_at_sglangs_default_sets_nothing() -> None:
    assert server_args_of_flags(["--dtype", "auto"]) == {}


def test_the_fields_build_the_record_sglangs_command_line_builds() -> None:
    """Through JSON, as the harness hands them to the server, the production command's fields
    give the ``ServerArgs`` SGLang's own parser gives for its flags, field for field."""
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs

    fields = json.loads(json.dumps(server_args_of_flags(PRODUCTION_FLAGS)))
    built = ServerArgs(model_path=MODEL_PATH, **fields)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    parsed = ServerArgs.from_cli_args(
        parser.parse_args(["--model-path", MODEL_PATH, *PRODUCTION_FLAGS])
    )
    differing = [
        field.name
        for field in record_fields(ServerArgs)
        if not field.name.startswith("_")
        and getattr(built, field.name) != getattr(parsed, field.name)
    ]
    assert differing == []
    assert fields["tp_size"] == 2
    assert json.loads(fields["json_model_override_args"]) == {
        "text_config": {"ple_embedding_dtype": "int8_row"}
    }
    EngineConfig(tiny_qwen4_exp(), server_args=fields)  # accepted as an engine's overrides


def test_harness_owned_flags_are_refused_by_field() -> None:
    with pytest.raises(EngineConfigError, match=r"set \['port'\]; the harness sets those"):
        server_args_of_flags(["--port", "1234"])
    with pytest.raises(EngineConfigError, match=r"set \['model_path'\]"):
        server_args_of_flags(["--model-path", MODEL_PATH])


def test_a_flag_sglang_does_not_know_is_refused_with_its_parsers_message() -> None:
    with pytest.raises(
        EngineConfigError, match=r"refuses \['--no-such-flag'\]: .*unrecognized arguments"
    ):
        server_args_of_flags(["--no-such-flag"])
