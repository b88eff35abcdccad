"""`python -m draftverify.serve.ray_cli` as a typer command: every option reaches the deployment's settings, the
cluster is joined, the app started and, on SIGTERM, taken down; a bad value is a one-line error before Ray is
touched. Runs without the `ray` extra: `ray_deploy` is replaced by a recorder of what it was asked."""

from __future__ import annotations

import os
import signal
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

import draftverify.serve
from draftverify.serve import ray_cli


@dataclass(frozen=True)
class EngineArgs:
    target: str | None = None
    draft: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    backend: str = "auto"


@dataclass(frozen=True)
class RaySettings:
    replicas: int = 2
    num_cpus: float = 1.0
    host: str = "127.0.0.1"
    port: int = 8000


@pytest.fixture
def deploy(monkeypatch):
    """A stand-in ray_deploy: records connect/start/stop; `start` sends this process SIGTERM, as a user would."""
    calls = []
    fake = types.ModuleType("draftverify.serve.ray_deploy")
    fake.EngineArgs, fake.RaySettings = EngineArgs, RaySettings
    fake.connect = lambda address, num_cpus: calls.append(("connect", address, num_cpus))

    def start(where, load, config):
        calls.append(("start", where, load, config))
        os.kill(os.getpid(), signal.SIGTERM)
        return "http://127.0.0.1:9"

    fake.start, fake.stop = start, lambda: calls.append(("stop",))
    monkeypatch.setitem(sys.modules, "draftverify.serve.ray_deploy", fake)
    monkeypatch.setattr(draftverify.serve, "ray_deploy", fake, raising=False)
    return calls


def test_every_option_reaches_the_deployment(deploy, tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    args = ["--replicas", "3", "--num-cpus", "0.5", "--address", "auto", "--cluster-cpus", "4", "-t", "m.gguf",
            "-d", "self:layers=2", "-m", "speculative[k=3],autoregressive", "--host", "0.0.0.0", "--port", "8100",
            "--model-name", "coder", "--max-queue", "5", "--max-batch", "2", "--prompt-part", "64", "--max-gap-ms",
            "40", "--timeout", "9", "--shutdown-grace", "1.5", "--default-max-tokens", "7", "--pool-file",
            str(tmp_path / "pool"), "--dtype", "fp32", "--device", "cpu", "--backend", "eager"]  # fmt: skip
    result = CliRunner().invoke(ray_cli.app, args)
    assert result.exit_code == 0, result.output
    assert "serving with speculative[k=3], autoregressive on http://127.0.0.1:9/v1 (3 replicas)" in result.output
    assert [c[0] for c in deploy] == ["connect", "start", "stop"] and deploy[0][1:] == ("auto", 4.0)
    _, where, load, config = deploy[1]
    assert where == RaySettings(3, 0.5, "0.0.0.0", 8100)
    assert load == EngineArgs("m.gguf", "self:layers=2", "fp32", "cpu", "eager")
    assert [s.label for s in config.methods] == ["speculative[k=3]", "autoregressive"]
    assert (config.model_name, config.max_queue, config.max_batch, config.timeout_s) == ("coder", 5, 2, 9.0)
    assert (config.shutdown_grace_s, config.default_max_tokens) == (1.5, 7)
    assert (config.prompt_part, config.max_gap_ms) == (64, 40.0)  # the config every replica's app is built with
    assert config.pool_file == Path(tmp_path / "pool")
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are put back


def test_defaults_and_help(deploy):
    result = CliRunner().invoke(ray_cli.app, [])
    assert result.exit_code == 0, result.output
    _, where, load, config = deploy[1]
    assert where == RaySettings() and load == EngineArgs() and deploy[0][1:] == (None, None)
    assert [s.label for s in config.methods] == ["auto"] and config.max_queue == 16
    assert (config.prompt_part, config.max_gap_ms) == (512, 250.0)  # `draftverify serve`'s defaults
    help_text = CliRunner().invoke(ray_cli.app, ["--help"], env={"COLUMNS": "200"}).output
    for option in ("--replicas", "--num-cpus", "--address", "--cluster-cpus", "--pool-file", "--backend",
                   "--prompt-part", "--max-gap-ms"):  # fmt: skip
        assert option in help_text, option


def test_bad_values_are_one_line_errors_before_ray(deploy):
    result = CliRunner().invoke(ray_cli.app, ["--max-batch", "0"])
    assert result.exit_code == 2 and "error: max_batch=0 must be at least 1" in result.output and deploy == []
    result = CliRunner().invoke(ray_cli.app, ["--max-gap-ms", "-1"])
    assert result.exit_code == 2 and "error: max_gap_ms=-1.0 must be at least 0" in result.output and deploy == []
    result = CliRunner().invoke(ray_cli.app, ["--replicas", "two"])
    assert result.exit_code == 2 and deploy == []


def test_without_ray_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as it does without the extra
    monkeypatch.delitem(sys.modules, "draftverify.serve.ray_deploy", raising=False)
    monkeypatch.delattr(draftverify.serve, "ray_deploy", raising=False)
    result = CliRunner().invoke(ray_cli.app, [])
    assert result.exit_code == 2 and "error: Ray Serve is not installed: pip install" in result.output
