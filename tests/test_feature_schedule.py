"""The feature head's training schedule (tools/make_draft/feature_schedule.py): small data gets smaller batches
(large data keeps `batch_tokens`), the schedule's length is what fits the time left, capped by the epochs, and the
warm-up is at most a tenth of it. The build-level behaviour (the best weights kept, a resumed build's schedule):
test_feature_head.py."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from draftverify.tools.make_draft.feature_losses import batches
from draftverify.tools.make_draft.feature_schedule import (
    MIN_EPOCH_STEPS,
    PLANNED_SHARE,
    epoch_batch_tokens,
    eval_every,
    learning_rate,
    schedule_length,
    warmup_steps,
)
from draftverify.tools.make_draft.feature_settings import HeadTraining


def sequences(lengths: list[int]) -> list:
    return [SimpleNamespace(ids=list(range(n))) for n in lengths]


def test_small_data_gets_smaller_batches_and_enough_steps_an_epoch():
    config = HeadTraining()
    rng = random.Random(0)
    for lengths in (
        [100] * 300,
        [rng.randint(20, 600) for _ in range(200)],
        [rng.randint(16, 120) for _ in range(900)],
    ):
        data = sequences(lengths)
        b = epoch_batch_tokens(data, config)
        assert config.max_len <= b < config.batch_tokens
        assert len(batches(data, config, 0)) < MIN_EPOCH_STEPS  # the cap alone gives too few steps
        assert all(len(batches(data, config, epoch, b)) >= MIN_EPOCH_STEPS for epoch in range(3))
    few = sequences([50] * 10)
    assert epoch_batch_tokens(few, config) == config.max_len  # never below one sequence's room


def test_large_data_keeps_the_batch_cap():
    config = HeadTraining()
    data = sequences([384] * 3000)
    assert epoch_batch_tokens(data, config) == config.batch_tokens
    assert batches(data, config, 1, epoch_batch_tokens(data, config)) == batches(data, config, 1)


def test_the_schedule_fits_the_time_left_at_most_the_epochs():
    # 14 steps an epoch, 8 epochs: at most 112 steps
    assert schedule_length(14, 8, 3, 2.0, 1000.0) == 112  # plenty of time: the epochs bound it
    assert schedule_length(14, 8, 3, 2.0, 100.0) == 3 + int(PLANNED_SHARE * 100 / 2)  # the time bounds it
    assert schedule_length(14, 8, 3, 2.0, 0.0) == 4  # no time left: one more step
    assert schedule_length(14, 0.5, 3, 2.0, 1000.0) == 7
    assert schedule_length(1000, 2, 5, 0.5, 60.0) == 5 + int(PLANNED_SHARE * 120)


@pytest.mark.parametrize("total", [1, 5, 28, 100, 199, 5000])
def test_the_warm_up_is_at_most_a_tenth_of_the_schedule(total):
    config = HeadTraining(warmup=20, lr=1e-3)
    w = warmup_steps(config, total)
    assert 1 <= w <= max(1, total // 10) and w <= 20
    rates = [learning_rate(config, s, total) for s in range(total)]
    assert rates[w - 1] == pytest.approx(max(rates))  # the peak comes after the warm-up, then the cosine falls
    assert all(a >= b for a, b in zip(rates[w - 1 :], rates[w:]))
    assert learning_rate(config, total, total) == pytest.approx(1e-4)  # a tenth at the end


def test_evaluations_are_spread_over_the_schedule():
    assert eval_every(28) == 10 and eval_every(1000) == 50 and eval_every(100_000) == 5000
