"""`auto`'s choices round by round (`drafters.auto.AutoDrafter` over stand-in drafters): it follows the
candidate that pays, scores free offers it does not draft, probes what sits out less and less often, and prices
each choice by what its own rounds measure. The output stays the target's throughout."""

from __future__ import annotations

import time
from dataclasses import replace

from draftverify import Engine
from draftverify.costs import Curve
from draftverify.drafters.auto import AR, MAX_BACKOFF, AutoDrafter
from draftverify.drafters.auto_figures import CALIBRATION_PRIOR, CandidateRecord, Figures, Shadow, mean
from draftverify.drafters.base import Drafter, Proposal
from draftverify.models import Runner
from draftverify.round import decode
from draftverify.sampling import Sampling
from draftverify.session import Session, Stopping


class Fixed(Drafter):
    """Proposes `width` tokens of a known continuation (right) or of nonsense (wrong)."""

    def __init__(self, truth: list[int], offset: int, right: bool, width: int = 3):
        self.truth, self.offset, self.right, self.width = truth, offset, right, width

    def propose(self, s, seq, room):
        if room <= 0:
            return Proposal()
        at = len(seq) - self.offset
        tokens = self.truth[at : at + min(self.width, room)] if self.right else [99] * min(self.width, room)
        return Proposal([tokens] if tokens else [])


def fixed_costs(context: int) -> Curve:
    """A forward cost curve where each further row adds half a step: what `auto` prices with in these tests, in
    place of one measured on a machine whose load would decide which candidate pays."""
    return Curve({w: 1e-3 * (1 + 0.5 * (w - 1)) for w in (1, 2, 4, 8, 16)}, context=context)


def one_scale(auto: AutoDrafter, now: float) -> None:
    """`AutoDrafter.rescale` with one scale for every choice (every round's): the choice then rests on the curve
    and the figures, not on how each choice's rounds happened to be timed on a loaded machine."""
    last = auto.round
    if last.curve_s is not None:
        auto.figures.scale = mean(auto.figures.scale, (now - last.sent_at) / last.curve_s)


class OnCurve(AutoDrafter):
    rescale = one_scale


def decode_with(
    tiny, n: int, make_candidates, records: dict, costs=fixed_costs, others: int = 0, probe: int = 8
) -> tuple[Session, AutoDrafter, list[int]]:
    """Decode n tokens of a tiny Llama with `AutoDrafter` over `make_candidates(truth, prompt length)`; the
    session, the drafter and autoregressive decoding's tokens. The forward costs are a fixed curve (by default a
    row adds half a step), not one measured on a busy machine, and one scale prices every choice (`OnCurve`), so
    who pays does not depend on the load. `others`: priced as if a batch's other requests fed that many rows a
    forward."""
    target = tiny("llama", layers=2)
    runner = Runner(target.model)
    engine = Engine(target)
    prompt = engine.encode("abc", chat=True)
    truth = engine.generate(prompt, method="autoregressive", max_new_tokens=n, eos_token_id=[]).tokens
    s = Session(prompt, Sampling(), Stopping(n, ()))
    s.others = others
    auto = OnCurve(make_candidates(truth, len(prompt)), costs(len(prompt)), Figures(records), probe=probe)
    decode(s, runner, auto)
    return s, auto, truth


def test_auto_follows_the_candidate_that_pays(tiny):
    """A candidate that is always right drafts nearly every round; one always wrong drafts only its probes."""
    records = {"wrong": CandidateRecord(accepted=0.0)}  # a warm start that already knows
    s, _, truth = decode_with(
        tiny, 120, lambda truth, at: {"right": Fixed(truth, at, True), "wrong": Fixed(truth, at, False)}, records
    )
    assert s.output == truth
    rounds = dict.fromkeys(["right", "wrong", AR], 0)
    for who, _ in s.stats.extra["auto_chunks"]:
        rounds[who] += 1
    assert rounds["right"] >= 25 and rounds["wrong"] <= rounds["right"] // 8 + 1, rounds
    assert records["right"].accepted > 2 and records["wrong"].accepted < 0.5


class FreeFixed(Fixed):
    free = True  # a lookup: asked every round, no state


def test_a_free_candidate_is_scored_in_the_rounds_it_sits_out(tiny):
    """A free candidate's offers are scored against the text whether it drafts or not: one that starts from figures
    saying it never pays but offers the right tokens drafts again within a few rounds, without a probe; one whose
    offers are wrong is never probed. The output is the target's."""
    records = {"right": CandidateRecord(accepted=0.0), "wrong": CandidateRecord(accepted=0.0)}
    s, auto, truth = decode_with(
        tiny, 60, lambda truth, at: {"right": FreeFixed(truth, at, True), "wrong": FreeFixed(truth, at, False)}, records
    )
    assert s.output == truth
    chunks = [who for who, _ in s.stats.extra["auto_chunks"]]
    assert "right" in chunks[:8] and "wrong" not in chunks, chunks
    assert records["right"].accepted > 2 and records["wrong"].accepted < 0.1


def test_a_free_candidate_priced_out_by_one_slow_round_drafts_again(tiny):
    """Its own rounds' scale says one of its rounds took 50 times the curve's time (a busy moment): as it sits out,
    that figure fades toward every round's, so an always-right free candidate drafts again within the request
    (without the fading it never drafted again, in this request or the next). Timed for real: both scales come from
    this machine's rounds."""
    target = tiny("llama", layers=2)
    engine = Engine(target)
    prompt = engine.encode("abc", chat=True)
    truth = engine.generate(prompt, method="autoregressive", max_new_tokens=60, eos_token_id=[]).tokens
    s = Session(prompt, Sampling(), Stopping(60, ()))
    figures = Figures({"right": CandidateRecord(accepted=3.0, nodes=3.0)}, scales={"right": 50.0})
    auto = AutoDrafter({"right": FreeFixed(truth, len(prompt), True)}, fixed_costs(len(prompt)), figures)
    decode(s, Runner(target.model), auto)
    chunks = [who for who, _ in s.stats.extra["auto_chunks"]]
    assert s.output == truth and "right" in chunks[:20], chunks
    assert figures.scales["right"] < 5, figures.scales


class Kinds(FreeFixed):
    """Wrong after a sequence whose length 3 divides, else right, and says which (`Proposal.kind`)."""

    def propose(self, s, seq, room):
        self.right = len(seq) % 3 != 0
        return replace(super().propose(s, seq, room), kind="right" if self.right else "wrong")


def test_auto_prices_each_kind_of_offer_by_its_own_figures(tiny):
    """A free drafter whose offers are right of one kind and wrong of the other: each kind keeps figures of its own,
    so it drafts where its kind pays and sits out where it does not (one mean for both would draft both). The
    output is the target's."""
    records = {}
    s, _, truth = decode_with(tiny, 80, lambda truth, at: {"k": Kinds(truth, at, True)}, records)
    assert s.output == truth
    assert records["k (right)"].accepted > 2 and records["k (wrong)"].accepted < 0.1, records
    chunks = s.stats.extra["auto_chunks"]
    assert sum(who == "k" and n == 1 for who, n in chunks) <= 2, chunks  # drafted and all wrong: the prior's try
    assert sum(who == "k" for who, _ in chunks) >= 10, chunks


def test_auto_does_not_probe_plain_decoding_where_a_candidate_is_priced_far_above_it(tiny):
    """Plain rounds are probed for their measured price, but not while a candidate promises more than
    `PLAIN_PROBE_BELOW` times their rate (here an always-right offer of 3 tokens whose rows add a tenth of a step
    each): a probe could not change the choice and would forgo a round of 4 tokens. One scale prices every choice
    (`OnCurve`), so a loaded machine's slow drafted rounds do not price plain decoding above the candidate."""

    def flat(context: int) -> Curve:
        return Curve({w: 1e-3 * (1 + 0.1 * (w - 1)) for w in (1, 2, 4, 8, 16)}, context=context)

    target = tiny("llama", layers=2)
    engine = Engine(target)
    prompt = engine.encode("abc", chat=True)
    truth = engine.generate(prompt, method="autoregressive", max_new_tokens=120, eos_token_id=[]).tokens
    s = Session(prompt, Sampling(), Stopping(120, ()))
    figures = Figures({"right": CandidateRecord(accepted=3.0, nodes=3.0)})
    auto = OnCurve({"right": FreeFixed(truth, len(prompt), True)}, flat(len(prompt)), figures, probe=2)
    decode(s, Runner(target.model), auto)
    assert s.output == truth
    chunks = [who for who, _ in s.stats.extra["auto_chunks"]]
    assert chunks.count(AR) <= 1 and chunks.count("right") >= 25, chunks  # (a last round with no room is plain)


def test_a_shadow_offer_is_scored_once_the_text_decides_it():
    assert Shadow("x", [[1, 2, 3]], 3, [1, 2]).accepted() is None  # right so far
    assert Shadow("x", [[1, 2, 3]], 3, [1, 5]).accepted() == 1
    assert Shadow("x", [[1, 2, 3]], 3, [1, 2, 3, 7]).accepted() == 3
    assert Shadow("x", [[1, 2, 3], [1, 2, 4, 5]], 4, [1, 2, 4]).accepted() is None  # the second path still open
    assert (
        Shadow("x", [[1, 2, 3], [1, 2, 4, 5]], 4, [1, 2, 4, 6]).accepted() == 3
    )  # the longest path verification keeps
    assert Shadow("x", [[7]], 1, [1]).accepted() == 0


def test_auto_probes_a_drafter_that_keeps_missing_less_and_less_often(tiny):
    """Probes that do not pay double the wait for the next (9, 17, 33, 65, 65 ... rounds), where a fixed
    interval would probe every 9th round; the next request keeps the running means but starts its waits
    afresh (a request unlike the earlier ones gets its probes early); the output stays the target's."""
    records = {"wrong": CandidateRecord(accepted=0.0)}
    s, auto, truth = decode_with(tiny, 200, lambda truth, at: {"wrong": Fixed(truth, at, False)}, records)
    assert s.output == truth
    probes = sum(who == "wrong" for who, _ in s.stats.extra["auto_chunks"])
    assert 4 <= probes <= 6 and auto.waits["wrong"].backoff == MAX_BACKOFF, probes
    s, _, truth = decode_with(tiny, 40, lambda truth, at: {"wrong": Fixed(truth, at, False)}, records)
    assert s.output == truth
    assert [i for i, (who, _) in enumerate(s.stats.extra["auto_chunks"]) if who == "wrong"] == [8, 25]
    assert records["wrong"].accepted < 0.1  # warm: what the first request learnt


def test_auto_does_not_probe_a_drafter_that_could_not_pay_even_if_always_right(tiny):
    """In a busy batch a row added to the shared forward can cost more than a step (here from the 8th row on: a
    row of the flat part costs half a step, one past 8 rows a step and a half): a drafter that sits out is then
    not probed, since even a round with every token accepted would be slower than plain decoding, while decoding
    alone, where its rows are cheap, it is probed as before. The output is the target's either way."""

    def steep(context: int) -> Curve:
        return Curve({1: 1e-3, 2: 1.5e-3, 4: 2.5e-3, 8: 4.5e-3, 16: 16.5e-3}, context=context)

    def probes(others: int) -> int:
        records = {"wrong": CandidateRecord(accepted=0.0)}
        make = lambda truth, at: {"wrong": Fixed(truth, at, False)}  # noqa: E731
        s, _, truth = decode_with(tiny, 120, make, records, costs=steep, others=others, probe=2)
        assert s.output == truth
        return sum(who == "wrong" for who, _ in s.stats.extra["auto_chunks"])

    assert probes(others=7) == 0
    assert probes(others=0) >= 3


class Slow(Fixed):
    """Always right, but every round it drafted takes `slow_s` more after the verification (its bookkeeping)."""

    def __init__(self, truth, offset, slow_s: float):
        super().__init__(truth, offset, right=True)
        self.slow_s = slow_s

    def observe(self, s, seq, proposal, step):
        if proposal.paths:
            time.sleep(self.slow_s)


def test_auto_prices_each_choice_by_what_its_rounds_measure(tiny):
    """A drafter that is always right but whose rounds take 20 ms more than the curve says: priced by its measured
    rounds (and plain rounds by theirs, probed), plain decoding takes over after its first round, and it drafts
    only its probes (priced on the curve alone it would draft every round)."""
    target = tiny("llama", layers=2)
    engine = Engine(target)
    prompt = engine.encode("abc", chat=True)
    truth = engine.generate(prompt, method="autoregressive", max_new_tokens=60, eos_token_id=[]).tokens
    s = Session(prompt, Sampling(), Stopping(60, ()))
    figures = Figures({"slow": CandidateRecord(accepted=3.0, nodes=3.0)})  # a warm start: always right
    auto = AutoDrafter({"slow": Slow(truth, len(prompt), 0.02)}, fixed_costs(len(prompt)), figures, probe=8)
    decode(s, Runner(target.model), auto)
    assert s.output == truth
    rounds = [who for who, _ in s.stats.extra["auto_chunks"]]
    assert rounds[0] == "slow" and rounds.count("slow") <= 4, rounds
    assert figures.scales["slow"] > 3 * figures.scales[AR], figures.scales


class Sure(Fixed):
    """Says it expects `expected` of its tokens accepted, whether `right` or not; its first round of a request
    (a catch-up after sitting out, as a model-run drafter's) takes `catch_up_s`."""

    def __init__(self, truth, offset, expected: float, catch_up_s: float = 0.0, right: bool = False):
        super().__init__(truth, offset, right=right)
        self.expected, self.catch_up_s, self.rounds = expected, catch_up_s, 0

    def propose(self, s, seq, room):
        if self.rounds == 0:
            time.sleep(self.catch_up_s)
        self.rounds += 1
        return replace(super().propose(s, seq, room), expected=self.expected)


def test_auto_prices_a_drafter_by_its_own_expectation_and_its_steady_rounds(tiny):
    """A drafter's own estimate (`Proposal.expected`, the feature head's calibrated chances) sets its acceptance
    figure in place of the round's count, scaled by how its estimates fared in this request; a round that follows
    one it sat out (its catch-up) does not set its drafting time."""
    records = {}
    s, auto, truth = decode_with(tiny, 60, lambda truth, at: {"sure": Sure(truth, at, 2.0, 0.2, right=True)}, records)
    assert s.output == truth
    rounds = sum(who == "sure" for who, _ in s.stats.extra["auto_chunks"])
    calibration = auto.calibration["sure"]
    assert (calibration.accepted, calibration.expected) == (
        CALIBRATION_PRIOR + s.stats.accepted,
        CALIBRATION_PRIOR + 2.0 * rounds,
    )
    # its word, raised by a request that bore it out: 3 of every 3 tokens accepted where it said 2 (so never
    # above 2 x 3/2), the request's tail (fewer tokens left than the drafter's width) bringing the ratio down
    assert 2.0 < records["sure"].accepted < 3.0
    assert records["sure"].draft_s < 0.05  # the 0.2 s first round is not a round's drafting time


def test_auto_stops_buying_rounds_on_a_word_the_request_belies(tiny):
    """Always wrong, expecting 2 of its 3 tokens accepted: its word is discounted by what the request shows, so
    it drafts little more than its probes. Priced on its word alone it drafted most of this request's rounds."""
    records = {}
    s, auto, truth = decode_with(tiny, 60, lambda truth, at: {"sure": Sure(truth, at, 2.0)}, records)
    assert s.output == truth and s.stats.accepted == 0
    rounds = sum(who == "sure" for who, _ in s.stats.extra["auto_chunks"])
    calibration = auto.calibration["sure"]
    assert (calibration.accepted, calibration.expected) == (CALIBRATION_PRIOR, CALIBRATION_PRIOR + 2.0 * rounds)
    assert 1 <= rounds <= 8 and records["sure"].accepted < 2.0, (rounds, records["sure"])
