"""Cost tables (width -> seconds) and curves (a table plus its growth with context), with the memo caches the
drafters read each round: a curve's tables per context, a table's marginal times."""

from __future__ import annotations

from draftverify.costs.interpolate import ascending, between, marginal

# A curve is read at the context rounded down to a multiple of this: a few tokens of context barely move a forward's
# time, and one table (with the marginal times drawn from it) then serves several rounds.
CONTEXT_STEP = 16
KEPT_TABLES = 256  # a curve's tables at this many contexts at most (then it starts over)


class Table(dict):
    """A cost table (width -> seconds) that keeps its points in ascending order for `forward_time`, and the
    `marginal_time`s and `marginal_times` asked of it: the drafters read one several times a round. Built once,
    never changed (but a pending `Curve`, filled once)."""

    def __init__(self, times: dict[int, float]):
        super().__init__(times)
        self.points = ascending(times)
        self.marginals: dict[tuple[int, int], list[float]] = {}  # (upto, others) -> marginal_times
        self.marginal: dict[tuple[int, int], float] = {}  # (width, others) -> marginal_time


class Curve(Table):
    """t(w) in seconds after `context` tokens (the table itself: width -> seconds, as `forward_times` gives),
    plus `slope[w]`: the seconds each further token of context adds to it (none: the same table at every context).
    `quick`: measured within `curves.quick_curve`'s budget (a few runs a width, no slope).

    A pending curve (`Curve.waiting(measure)`) is not measured yet: the next prefill on its path times its widths
    among the prompt's own forwards (`costs.prefill`) and hands them to `settle`, which fills the curve in place
    once (`measure(known, since)` times what they left out); read before that (`at`), it measures itself in full."""

    def __init__(self, times: dict[int, float], context: int, slope: dict[int, float] | None = None, quick=False):
        super().__init__(times)
        self.context, self.slope, self.quick = context, slope or {}, quick
        # the tables `at` made, by context: a round asks for its context more than once, and the requests of a batch
        # (which share the curve) each for its own
        self.tables: dict[int, Table] = {}
        self.pending = None  # `measure(known, since) -> Curve` while the curve waits to be measured (`waiting`)

    @classmethod
    def waiting(cls, measure) -> "Curve":
        """A quick curve to be measured later: `measure(known, since)` returns it, given the seconds per width
        already timed (`settle`)."""
        pending = cls({}, 0, quick=True)
        pending.pending = measure
        return pending

    def settle(self, known: dict[int, list[float]] | None = None, since=None) -> None:
        """Fill a pending curve in place (the drafters holding it read the filled one): measured by its `pending`
        callable, given `known` (per width, seconds already timed: a prefill's) and `since` (`busy.cpu_times()`
        when their timing began). A measured curve: nothing."""
        if self.pending is None:
            return
        measured = self.pending(known or {}, since)  # interrupted, the curve still waits
        self.pending = None
        self.clear()
        self.update(measured)
        self.points, self.marginals, self.marginal = ascending(measured), {}, {}
        self.context, self.slope, self.quick, self.tables = measured.context, measured.slope, measured.quick, {}

    def at(self, context: int) -> Table:
        """The table after `context` tokens, read per `CONTEXT_STEP` tokens (one table serves a few rounds)."""
        self.settle()
        context -= context % CONTEXT_STEP
        table = self.tables.get(context)
        if table is None:
            if len(self.tables) >= KEPT_TABLES:
                self.tables.clear()
            more = max(0, context - self.context)
            table = self.tables[context] = Table({w: t + more * self.slope.get(w, 0.0) for w, t in self.items()})
        return table


def at_context(costs: dict, context: int) -> dict[int, float]:
    """The cost table for a forward after `context` tokens (a plain table has no context: as it is)."""
    return costs.at(context) if isinstance(costs, Curve) else costs


def _points(table: dict[int, float]) -> list[tuple[int, float]]:
    return table.points if isinstance(table, Table) else ascending(table)


def forward_time(table: dict[int, float], width: int) -> float:
    """t(width) from a table of measured widths: linear between points, extended linearly beyond."""
    return between(_points(table), width)


def rows_within(table: dict[int, float], others: int, budget_s: float, most: int) -> int:
    """The most rows n (at most `most`; 0 when even one is over) whose forward beside `others` rows of other
    sequences, t(others + n), the table prices within `budget_s` seconds: the whole forward's time, not the
    rows' marginal time. Bisection: a table's time grows with its width."""
    low, high = 0, most
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if forward_time(table, others + mid) <= budget_s else (low, mid - 1)
    return low


def marginal_time(table: dict[int, float], width: int, others: int = 0) -> float:
    """Seconds `width` rows add to a forward that carries `others` rows of other sequences (a batch); alone
    (others = 0) that is t(width). Never below a twentieth of t(1) per row: a measured curve can dip."""
    if not isinstance(table, Table):
        return marginal(_points(table), width, others)
    found = table.marginal.get((width, others))
    if found is None:
        found = table.marginal[width, others] = marginal(table.points, width, others)
    return found


def marginal_times(table: dict[int, float], upto: int, others: int = 0) -> list[float]:
    """[marginal_time(table, w, others) for w in 1..upto] (a tree's sizes, each round; a `Table` keeps them:
    do not change the list)."""
    found = table.marginals.get((upto, others)) if isinstance(table, Table) else None
    if found is None:
        points = _points(table)
        found = [marginal(points, w, others) for w in range(1, upto + 1)]
        if isinstance(table, Table):
            table.marginals[(upto, others)] = found
    return found
