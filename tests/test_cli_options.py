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


LEAVE = """
import atexit, sys, threading, time
from draftverify.cli import leave
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished"))).start()
print("buffered", end="")
leave(sys.argv[1] if sys.argv[1].startswith("x") else int(sys.argv[1]))
"""


def test_the_command_line_leaves_without_teardown_but_as_an_exit_would():
    """`draftverify` ends its process without tearing the interpreter down (`cli.leave`), yet as a normal exit
    would: other threads finish, atexit handlers run, buffered output arrives, and the code (or a message: code 1)
    is the process's."""
    import subprocess
    import sys

    for code, rc in (("0", 0), ("3", 3), ("x-message", 1)):
        done = subprocess.run([sys.executable, "-c", LEAVE, code], capture_output=True, text=True, timeout=60)
        assert done.returncode == rc, done.stderr
        assert done.stdout == "bufferedthread finished\natexit ran\n", done.stdout
        assert done.stderr == ("x-message\n" if code.startswith("x") else "")
