"""Several requests decoding together: one stacked target forward per step, each request exact on its own.

Every request runs the one round (`round.rounds`, through its method's `Method.rounds`) on a *slot*
of the engine: a runner with its own KV cache (and, for a draft model, a draft runner of its own),
and its own drafter, draft length, acceptance and stop. A step collects the forward each live
request waits for (a prefill, a plain step, or a tree to verify), runs them as ONE forward
(`models.forward_many`: the rows of all requests stacked, no padding; per-request positions,
masks and caches), and hands each request its output; each then verifies, rolls back, emits and
drafts its next proposal. Requests join (`add`) and leave (finished, stopped, cancelled, failed)
between steps: continuous batching.

Exactness is per request: a request's forward is the same arithmetic on its own cache whatever
else is stacked with it (on the static path each request's rows take the product its own forward
would take, `backend.spans.Spans`, bit for bit on a quantized model; attention runs per request),
verification is its own, and its random draws come from its own seeded generator. Drafting stays per request
(drafts are small beside the stacked forward on this path); what the batch changes is the price of
verification: each request's `Session.others` says how many rows the rest of the batch fed last
step, and `auto` prices a draft by the rows it *adds* to the shared forward (`costs.marginal_time`),
so draft lengths shrink as the batch grows and speculation stops where the cost curve turns
linear.

With `prompt_part` (`Batch(prompt_part=...)`, `serve --prompt-part`), a longer prompt that joins while others
decode is fed in parts, at most that many rows a step (on a runner whose rows do not depend on the rows beside
them, `Runner.rows_alone`: the cache and the logits are the ones a whole prefill gives, bit for bit), so the others
go on emitting tokens instead of waiting for the whole prompt, whose prefill takes many decoding steps' time, and a
shorter request that arrives meanwhile joins at the next part rather than after the whole prefill; each part
streams the weights again. With a gap budget (`max_gap_s`, `serve --max-gap-ms`) a part has the most rows whose
stacked forward, beside the rows the others feed this step (their drafts included), the target's cost curve
(`costs.kept_curve`) prices within the budget, and at least `LEAST_PART` so that the prompt moves on: the others'
streams stall no longer than that, and the prompt takes what the step has left. Prompts waiting together take
turns, the shortest rest first (a later one waits for a step with room for `LEAST_PART` of its rows). Under a
budget, members decoding together each feed at most an even share of the rows it prices (`Session.step_rows`,
which bounds how deep the round drafts; a member alone drafts as its drafter prices). Off (0) by default here;
the server feeds prompts in parts by default (`ServeConfig.prompt_part`, `max_gap_ms`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from draftverify.backend.feed import Feed, Forward
from draftverify.costs import at_context, kept_curve, rows_within
from draftverify.models import Runner, forward_many
from draftverify.round import Rounds
from draftverify.session import Session


@dataclass(eq=False)
class Member:
    """One request in the batch."""

    session: Session
    runner: Runner  # its slot's target runner
    rounds: Rounds
    feed: Feed | None = None  # the forward it waits for
    error: BaseException | None = None
    done: bool = False
    tag: object = None  # the caller's handle (the server's ticket)
    fed: int = 0  # the rows of `feed` already run (a prompt fed in parts)
    states: list[torch.Tensor] = field(default_factory=list)  # their final hidden states, when `feed` asks for all


def divisible(feed: Feed, part: int) -> bool:
    """Whether `feed` is a prompt that may run in parts of `part` rows: causal new tokens after the cache (no
    positions, tree, skipped layers or draft vocabulary) whose logits are asked for its last few rows only."""
    plain = feed.positions is None and feed.tree_mask is None and feed.skip is None and feed.vocab is None
    return plain and feed.last is not None and feed.last <= part


LEAST_PART = 8  # rows a prompt part has at least, however full the step: a waiting prompt always moves on
FIXED_PART = 128  # rows a part has under a gap budget while the target's cost curve is not measured yet
MOST_ROWS = 1024  # the widest step a gap budget is searched over


class Batch:
    """Requests that share every target forward; see the module docstring."""

    def __init__(self, prompt_part: int = 0, max_gap_s: float = 0.0):
        """`prompt_part`: feed a longer prompt at most that many rows a step while others decode (0: whole);
        `max_gap_s`: fewer, so that the cost curve prices each step's forward within this many seconds (0: parts of
        `prompt_part` rows)."""
        self.members: list[Member] = []
        self.prompt_part, self.max_gap_s = prompt_part, max_gap_s
        self.turn = 0  # steps that shared a gap budget (`_shares`)

    def __len__(self) -> int:
        return len(self.members)

    def add(self, session: Session, runner: Runner, rounds: Rounds, tag: object = None) -> Member:
        """Start a request (its prefill joins the next step). `rounds` runs on `runner`, which no other member uses."""
        assert all(m.runner is not runner for m in self.members), "each request of a batch needs a runner of its own"
        member = Member(session, runner, rounds, tag=tag)
        self._advance(member, None)
        self.members.append(member)
        return member

    def step(self) -> list[Member]:
        """One stacked forward for every live member; returns the members that ended (and leave the batch)."""
        live = [m for m in self.members if not m.done]
        if live:
            table = self._table(live)
            split, shares = self._part_rows(live, table), self._shares(live, table)
            live = [m for m in live if split.get(m) != 0]  # a prompt that waits for its turn is not in this step
            parts = [self._part(m, split.get(m)) for m in live]
            rows = [part.size for part in parts]
            for m, n in zip(live, rows):
                m.session.others, m.session.step_rows = sum(rows) - n, shares.get(m, 0)
            try:
                outs = forward_many([m.runner for m in live], parts)
            except Exception as exc:  # the stacked forward itself failed: every member in it fails
                for m in live:
                    self._fail(m, exc)
            else:
                for m, part, out in zip(live, parts, outs):
                    self._take(m, part, out)
        ended = [m for m in self.members if m.done]
        self.members = [m for m in self.members if not m.done]
        return ended

    def drop(self, member: Member) -> None:
        """Stop a member now (its client went away): its drafter is told and it leaves the batch."""
        if not member.done:
            member.rounds.close()
            member.done = member.session.done = True
            member.session.stats.finish_reason = member.session.stats.finish_reason or "cancelled"
        self.members = [m for m in self.members if m is not member]

    def _part_rows(self, live: list[Member], table) -> dict[Member, int]:
        """The rows this step feeds of each prompt that runs in part (0: it waits this step). When every live member
        waits for a prompt longer than a part may take alone (`_rows(0)`), all run whole: no stream waits on the
        step. Otherwise the prompts that may run in parts take their turn, the one with the fewest rows left first
        (the first tokens come soonest on average), each getting `_rows` beside every row the step feeds besides it
        (the others' whole feeds, a draft's rows as well, and the parts before it); a prompt that fits runs whole."""
        if not self.prompt_part:
            return {}
        alone = self._rows(0, table)
        prompts = sorted((m for m in live if self._divides(m, alone)), key=lambda m: m.feed.size - m.fed)
        if len(prompts) == len(live) and all(m.feed.size - m.fed > alone for m in live):
            return {}
        rows = sum(m.feed.size - m.fed for m in live if m not in prompts)
        split, first = {}, True
        for m in prompts:
            rest, n = m.feed.size - m.fed, self._rows(rows, table, first)
            if n >= rest or rest <= m.feed.last:  # it fits, or is too short to part: whole
                rows, first = rows + rest, False
                continue
            split[m] = min(n, rest - m.feed.last)  # the last part keeps the rows whose logits it gives (0: waits)
            rows, first = rows + split[m], False
        return split

    def _shares(self, live: list[Member], table) -> dict[Member, int]:
        """The rows each member's next forward may feed (`Session.step_rows`, which bounds its drafts): an even
        share of the rows the cost table prices within the gap budget, at least 1, members taking the rest one
        row each, in turn. None for a member alone (its drafts delay no other stream, and its drafter prices its
        own time) or without a budget or a table."""
        if len(live) < 2 or table is None:
            return {}
        share, rest = divmod(rows_within(table, 0, self.max_gap_s, MOST_ROWS), len(live))
        self.turn += 1  # the rest goes round: each step to the next members
        return {m: max(1, share + ((i - self.turn) % len(live) < rest)) for i, m in enumerate(live)}

    def _divides(self, m: Member, part: int) -> bool:
        """Whether `m`'s feed may run in parts: a prompt begun in parts, or one `divisible` on a runner whose rows
        do not depend on the rows beside them."""
        return m.fed > 0 or (divisible(m.feed, part) and m.runner.rows_alone)

    def _table(self, live: list[Member]):
        """The target's cost table after the longest context in the step (None: no curve measured yet)."""
        if not self.max_gap_s:
            return None
        curve = kept_curve(live[0].runner)
        return None if curve is None else at_context(curve, max(m.runner.length for m in live))

    def _rows(self, others: int, table, first: bool = True) -> int:
        """Rows of a prompt part in a forward beside `others` rows, at most `prompt_part`: with a gap budget, the most
        the cost table prices the forward within (`costs.rows_within`), at least `LEAST_PART` for the `first` prompt
        in turn and else none below that (it waits for a step with room), or `FIXED_PART` with no table; without a
        budget, `prompt_part`."""
        if not self.max_gap_s:
            return self.prompt_part
        if table is None:
            return min(self.prompt_part, FIXED_PART)
        n, least = rows_within(table, others, self.max_gap_s, self.prompt_part), min(LEAST_PART, self.prompt_part)
        return max(n, least) if first else n if n >= least else 0

    def _part(self, m: Member, rows: int | None) -> Feed:
        """What of `m.feed` runs this step: its next `rows` rows (a long prompt while others decode; logits for the
        last of them, unused, and the hidden states when all are asked for), else all of it, or all that is left of
        a prompt begun in parts."""
        feed = m.feed
        if rows is not None:
            tokens = feed.tokens[m.fed : m.fed + rows]
            return Feed(tokens, last=1, hidden="all" if feed.hidden == "all" else False)
        return feed if m.fed == 0 else replace(feed, tokens=feed.tokens[m.fed :])

    def _take(self, m: Member, part: Feed, out: Forward) -> None:
        """`m`'s output of this step: kept while its prompt has rows still to run, else handed to its round."""
        if m.fed + part.size < m.feed.size:
            m.fed += part.size
            if m.feed.hidden == "all":
                m.states.append(out.hidden)
            return
        if m.states:
            out = Forward(out.logits, torch.cat([*m.states, out.hidden]))
        m.fed, m.states = 0, []
        self._advance(m, out)

    def _advance(self, m: Member, out) -> None:
        try:
            m.feed = next(m.rounds) if out is None else m.rounds.send(out)
        except StopIteration:
            m.done = True
        except Exception as exc:  # this request's error; the others go on
            m.error, m.done = exc, True

    def _fail(self, m: Member, exc: BaseException) -> None:
        m.error, m.done = exc, True
        m.rounds.close()


def run_batch(members: list[tuple[Session, Runner, Rounds]]) -> Batch:
    """Decode these requests together to the end (all start at once); returns the spent batch."""
    batch = Batch()
    for session, runner, rounds in members:
        batch.add(session, runner, rounds)
    ended = []
    while batch.members:
        ended += batch.step()
    for m in ended:
        if m.error is not None:
            raise m.error
    return batch
