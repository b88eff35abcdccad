"""Cost curves kept on disk (costs.curve with an engine's `Shared.curve_folder`): a second engine, as in a fresh
process, reads them instead of measuring; a change of machine, model, arithmetic or kernel build measures again."""

from __future__ import annotations

import json
import types

import pytest

from draftverify import Engine, costs


def _refuse_to_measure(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("measured a curve again")

    monkeypatch.setattr(costs.timing, "forward_times", fail)


@pytest.fixture
def curves_home(tmp_path, monkeypatch):
    folder = tmp_path / "curves"  # not XDG_CACHE_HOME: that would move the compiled kernels too
    monkeypatch.setattr(costs, "cache_folder", lambda: folder)
    return folder


def test_a_second_engine_reads_the_curve_instead_of_measuring(tiny, curves_home, monkeypatch):
    target = tiny("llama")
    measured = costs.curve(Engine(target, backend="static").target_runner, widths=(1, 2, 4))
    (saved,) = curves_home.glob("*.json")
    assert json.loads(saved.read_text())["key"]["arithmetic"] == "fp32 torch.float32"
    _refuse_to_measure(monkeypatch)
    again = costs.curve(Engine(target, backend="static").target_runner, widths=(1, 2, 4))  # a fresh engine's memory
    assert again is not measured and dict(again) == dict(measured)
    assert again.context == measured.context and again.slope == pytest.approx(measured.slope)


@pytest.mark.parametrize(
    "change",
    [
        "kernels",
        "machine",
        "model",
        "arithmetic",
    ],
)
def test_a_changed_key_measures_again(tiny, curves_home, monkeypatch, change):
    target = tiny("llama")
    costs.curve(Engine(target, backend="static").target_runner, widths=(1, 2))
    _refuse_to_measure(monkeypatch)
    engine = Engine(tiny("llama", seed=1) if change == "model" else target, backend="static")
    if change == "kernels":
        monkeypatch.setattr(costs.fingerprint, "kernel_build", lambda: "another-build")
    elif change == "machine":
        monkeypatch.setattr(costs.fingerprint, "machine", lambda: {"cpu": "another CPU", "cpu_flags": "0"})
    elif change == "arithmetic":
        engine.shared.packs.arithmetic = "q8"  # (a tiny model has no blocks for a q8 engine)
    with pytest.raises(AssertionError, match="measured a curve again"):
        costs.curve(engine.target_runner, widths=(1, 2))


def test_a_damaged_or_foreign_file_is_measured_again_and_replaced(tiny, curves_home, monkeypatch):
    target = tiny("llama")
    runner = Engine(target, backend="static").target_runner
    costs.curve(runner, widths=(1, 2))
    (saved,) = curves_home.glob("*.json")
    data = json.loads(saved.read_text())
    saved.write_text(json.dumps({**data, "key": {**data["key"], "threads": -1}}))  # a hash collision's key
    assert costs.load_curve(curves_home, costs.curve_key(runner, True, (1, 2))) is None
    saved.write_text("{not json")
    assert costs.load_curve(curves_home, costs.curve_key(runner, True, (1, 2))) is None


def test_a_bare_runner_keeps_no_file(tiny, curves_home):
    from draftverify.models import Runner

    costs.curve(Runner(tiny("llama").model, "static"), widths=(1, 2))
    assert not curves_home.exists()


def test_an_auto_request_in_a_second_engine_measures_nothing(tiny, curves_home, monkeypatch):
    from test_feature_head import random_head

    from draftverify.loading import truncated_copy

    target = tiny("llama", layers=2)
    draft, head = truncated_copy(target, 1), random_head(target, seed=2)
    want = Engine(target, draft, feature_head=head).generate("ab", method="auto", max_new_tokens=12, temperature=0)
    _refuse_to_measure(monkeypatch)
    second = Engine(target, draft, feature_head=head)
    assert second.generate("ab", method="auto", max_new_tokens=12, temperature=0).tokens == want.tokens


def test_a_curve_measured_on_a_busy_machine_steers_its_process_but_is_not_kept(tiny, curves_home, monkeypatch, capsys):
    share = {"now": 0.5}
    monkeypatch.setattr(costs.busy, "BUSY_SHARE", 0.15)  # the shipped bound (the test session lifts it: conftest.py)
    monkeypatch.setattr(costs.busy, "others_share", lambda before, after: share["now"])
    runner = Engine(tiny("llama"), backend="static").target_runner
    measured = costs.curve(runner, widths=(1, 2))
    assert not list(curves_home.glob("*.json"))
    assert "other work used 50% of the CPU time" in capsys.readouterr().err
    assert costs.curve(runner, widths=(1, 2)) is measured  # this engine keeps it
    share["now"] = costs.busy.BUSY_SHARE  # a quiet enough machine: the next engine measures again, and keeps that one
    costs.curve(Engine(tiny("llama"), backend="static").target_runner, widths=(1, 2))
    assert len(list(curves_home.glob("*.json"))) == 1 and not capsys.readouterr().err


def test_others_share_is_the_cpu_time_other_work_took_from_this_process(monkeypatch):
    monkeypatch.setattr(costs.busy.os, "sysconf", lambda name: 100)  # clock ticks a second
    # two CPUs, two seconds (400 ticks), two threads: 200 busy ticks, 150 of them this process's own
    assert costs.others_share((1000, 5000, 3.0, 2), (1200, 5400, 4.5, 2), threads=2) == pytest.approx(50 / 400)
    assert costs.others_share((1000, 5000, 3.0, 2), (1200, 5400, 6.0, 2), threads=2) == 0.0  # never below nothing
    # eight CPUs, two seconds, two threads: other work's 600 ticks fit in the six CPUs the threads leave free...
    assert costs.others_share((0, 0, 0.0, 8), (1000, 1600, 4.0, 8), threads=2) == 0.0
    # ...but in one second of eight busy CPUs where the threads got one CPU's worth, 100 of other work's 700 ticks
    # came out of the 200 the threads could have had
    assert costs.others_share((0, 0, 0.0, 8), (800, 800, 1.0, 8), threads=2) == pytest.approx(100 / 200)
    assert costs.others_share(None, (1200, 5400, 4.5, 2)) is None  # no /proc/stat: unknown, and the curve is kept
    assert costs.others_share((1000, 5000, 3.0, 2), (1000, 5000, 3.0, 2)) is None
    now = costs.cpu_times()
    if now is not None:  # Linux: the ticks count up, and this process has used some CPU time
        assert now[0] <= now[1] and now[2] > 0 and now[3] >= 1


def test_widths_are_timed_in_turns_so_a_drifting_machine_keeps_their_ratios(monkeypatch):
    """A machine that runs at a third of its speed for the first 16 forwards, then at full speed: timed in turns,
    every width's fastest run falls in the fast spell and the ratios are the forwards' own (a row adds a tenth of
    a step); timed one width after another, 1 and 2 rows fell in the slow spell and cost more than 4."""
    clock, calls = [0.0], []

    def forward(tokens):
        slow = 3.0 if len(calls) < 16 else 1.0
        calls.append(len(tokens))
        clock[0] += slow * (1 + 0.1 * (len(tokens) - 1))

    monkeypatch.setattr(costs.timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    times = costs.time_widths(forward, lambda: None, [5, 6, 7], widths=(1, 2, 4), reps=3)
    assert times == pytest.approx({1: 1.0, 2: 1.1, 4: 1.3})
