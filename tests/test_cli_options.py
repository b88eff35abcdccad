"""The options several commands share are declared once (`cli_options`): same flags, same default, same help."""

from __future__ import annotations

import typer

from draftverify.cli import app
from draftverify.cli_options import DEFAULT_DRAFT, DEFAULT_TARGET

SHARED = {  # parameter name -> (flags every command gives it, text its help always holds)
    "target": ({"--target", "-t"}, DEFAULT_TARGET),
    "draft": ({"--draft", "-d"}, DEFAULT_DRAFT),
    "dtype": ({"--dtype"}, "fp32, bf16 or fp16 (opt-in"),
    "device": ({"--device"}, "cpu, cuda or cuda:N"),
    "backend": ({"--backend"}, "eager (the stock transformers model"),
}


def test_every_command_declares_the_shared_options_alike():
    commands = typer.main.get_command(app).commands
    seen = {name: 0 for name in SHARED}
    for command_name, command in commands.items():
        for param in command.params:
            if param.name in SHARED or (command_name == "search-layers" and param.name == "model"):
                name = "target" if param.name == "model" else param.name
                flags, text = SHARED[name]
                assert flags <= set(param.opts), (command_name, param.name, param.opts)
                assert text in param.help, (command_name, param.name, param.help)
                seen[name] += 1
    assert seen["target"] >= 8 and seen["draft"] >= 5 and seen["dtype"] >= 6, seen  # each command, not one of them


def test_every_command_still_shows_its_help():
    from typer.testing import CliRunner

    for name in typer.main.get_command(app).commands:
        result = CliRunner().invoke(app, [name, "--help"])
        assert result.exit_code == 0 and "--help" in result.output, (name, result.output)
