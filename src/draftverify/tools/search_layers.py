"""Layer search: which sub-layers self-speculative decoding skips (Draft & Verify, Sec. 3.3).

Bayesian optimisation with optuna's TPE sampler (seeded) over one on/off choice per attention
and per MLP sub-layer, for any number of layers. The objective f(z) is the measured time per
generated token of self-speculative decoding (greedy, the method's draft exit) with skip set z
on a small development prompt set, disjoint from the benchmark prompts (the shipped
`assets/dev_prompts.jsonl`). The study starts from paper-like guesses (`SkipSet.heuristic`
at a few densities), stops when the time budget or the trial count runs out, and lives in a
journal file next to the output (`OUT.study.journal`), so an interrupted search resumes with
`--resume`. The best skip set so far is rewritten, atomically, after every improvement.

Timings are noisy on a shared machine: `--clock cpu --threads 1` measures the process's CPU
time on one thread, which other processes disturb far less than wall-clock time.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import typer

from draftverify.cli_options import device_option, dtype_option, prompts_option, seed_option, target_option
from draftverify.drafters.skipsets import SkipSet, save_skip_set
from draftverify.errors import DraftVerifyError, require
from draftverify.loading import Loaded, decoder_layers
from draftverify.prompt_files import read_prompts
from draftverify.util import optional_import, same_weights

DEV_PROMPTS = Path(__file__).parent.parent / "assets" / "dev_prompts.jsonl"
WARM_START_SCALES = (1.0, 0.5, 0.25, 0.1)  # densities of the paper-like first guesses (1.0 ~ 45% of the sub-layers)
GIVE_UP = 1.5  # stop measuring a trial once it runs this much slower than the best so far (or autoregressive)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
STUDY_NAME = "skipset"


@dataclass
class Measured:
    """One candidate on the development prompts."""

    ms_per_token: float
    acceptance: float | None  # accepted / drafted over all prompts (None: nothing drafted)
    tokens_per_step: float | None  # emitted tokens per verification, bonus included
    cut_short: bool = False  # stopped after some prompts because it was hopeless


def measure(
    engine, prompts: list[list[int]], max_new_tokens: int, clock: str, give_up_ms: float | None = None, **method
) -> Measured:
    """Time per generated token (prefill included) of `method` over `prompts` (greedy)."""
    now = CLOCKS[clock]
    seconds = tokens = drafted = accepted = steps = emitted = 0
    for done, ids in enumerate(prompts, start=1):
        t0 = now()
        r = engine.generate(ids, max_new_tokens=max_new_tokens, **method)
        seconds += now() - t0
        tokens += r.stats.new_tokens
        drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
        steps, emitted = steps + len(r.stats.steps), emitted + sum(r.stats.steps)
        if give_up_ms is not None and done < len(prompts) and 1000 * seconds / tokens > give_up_ms:
            break
    return Measured(
        1000 * seconds / tokens,
        accepted / drafted if drafted else None,
        emitted / steps if steps else None,
        cut_short=done < len(prompts),
    )


def skip_params(skip: SkipSet, n_layers: int) -> dict:
    """A skip set as the study's parameters: one boolean per sub-layer."""
    return {
        **{f"attention.{i}": i in skip.attention for i in range(n_layers)},
        **{f"mlp.{i}": i in skip.mlp for i in range(n_layers)},
    }


def params_skip(params: dict) -> SkipSet:
    on = [name for name, value in params.items() if value]
    return SkipSet(
        tuple(int(n.split(".")[1]) for n in on if n.startswith("attention.")),
        tuple(int(n.split(".")[1]) for n in on if n.startswith("mlp.")),
    )


@dataclass
class SearchResult:
    skip: SkipSet
    measured: Measured
    autoregressive_ms_per_token: float
    trials: int  # trials in the study (all sessions)

    @property
    def speedup(self) -> float:
        return self.autoregressive_ms_per_token / self.measured.ms_per_token


def search_layers(
    target: Loaded,
    prompts: list[list[int]],
    out: Path,
    budget_s: float,
    trials: int | None = None,
    seed: int = 0,
    resume: bool = False,
    max_new_tokens: int = 32,
    clock: str = "wall",
    method: dict | None = None,
    progress: bool = True,
    give_up: float | None = GIVE_UP,
    engine=None,
) -> SearchResult:
    """Search a skip set for `target` on `prompts` (token ids); write the best to `out` as it improves.

    A trial that runs `give_up` times slower than the best so far (or autoregressive) stops early
    and cannot become the best; None measures every trial in full. `engine`: the target's `Engine` in the
    arithmetic to search in (a draft that skips sub-layers costs what its rows cost in it); by default one in fp32.
    """
    from tqdm import tqdm

    from draftverify.engine import Engine

    check_search(clock, budget_s, trials, prompts)
    method = dict(method or {})
    engine = engine if engine is not None else Engine(target)
    settings = study_settings(prompts, max_new_tokens, clock, method, engine.arithmetic)
    study = open_study(target, out, settings, seed, resume)
    engine.generate(prompts[0], method="autoregressive", max_new_tokens=4)  # warm-up
    autoregressive = measure(engine, prompts, max_new_tokens, clock, method="autoregressive").ms_per_token
    bar = tqdm(total=trials, unit="trial", desc="search-layers", disable=not progress, dynamic_ncols=True)
    bar.set_postfix_str(f"autoregressive {autoregressive:.1f} ms/token")
    n_layers = len(decoder_layers(target.model))
    session = SearchSession(
        study, engine, prompts, out, target.identity, n_layers, seed, clock, max_new_tokens, method, give_up,
        autoregressive, bar,
    )  # fmt: skip
    try:
        study.optimize(session.objective, n_trials=trials, timeout=budget_s, callbacks=[session.after_trial])
    finally:
        bar.close()
    require(session.best is not None, "no trial finished within the budget: give a larger --budget")
    result = session.result_of(session.best)
    session.write(result)  # again, to record the final trial count
    return result


def check_search(clock: str, budget_s: float, trials: int | None, prompts: list) -> None:
    """Refuse, in one line each, a search that cannot run."""
    require(clock in CLOCKS, f"unknown clock {clock!r}: use wall or cpu")
    require(budget_s > 0, f"budget {budget_s / 60:g} min must be positive")
    require(trials is None or trials >= 1, f"--trials {trials} must be at least 1")
    require(prompts, "no development prompts: pass --prompts FILE with at least one prompt")


def study_settings(prompts: list[list[int]], max_new_tokens: int, clock: str, method: dict, arithmetic: str) -> dict:
    """What a study's trials were measured on (the target's arithmetic included): a resumed study must be measured
    alike."""
    require(
        "skip" not in method and "strategy" not in method and "skip_file" not in method,
        "the search chooses the skip set: drop skip, strategy and skip_file from the method options",
    )
    return {
        "prompts_sha1": hashlib.sha1(repr(prompts).encode()).hexdigest()[:16],
        "max_new_tokens": max_new_tokens,
        "clock": clock,
        "method": {k: method[k] for k in sorted(method)},
        "arithmetic": arithmetic,
    }


def open_study(target: Loaded, out: Path, settings: dict, seed: int, resume: bool):
    """The study kept next to `out` (a new one seeded with the heuristic skip sets), refused if it was made for
    another model or with other prompts or settings."""
    optuna = optional_import("optuna", "tools")
    n_layers, identity, storage_path = len(decoder_layers(target.model)), target.identity, study_path(out)
    require(
        resume or not storage_path.exists(),
        f"a study already exists at {storage_path}: pass --resume to continue it, or delete it to start over",
    )
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(storage_path)))
    done_before = sum(s.n_trials for s in optuna.get_all_study_summaries(storage) if s.study_name == STUDY_NAME)
    sampler = optuna.samplers.TPESampler(
        seed=seed + done_before, multivariate=True, n_startup_trials=len(WARM_START_SCALES) + 4
    )  # a resumed session draws other trials than the sessions before it
    study = optuna.create_study(
        storage=storage, study_name=STUDY_NAME, sampler=sampler, direction="minimize", load_if_exists=True
    )
    if not study.user_attrs:
        study.set_user_attr("model", identity)
        study.set_user_attr("settings", settings)
        for scale in WARM_START_SCALES:
            study.enqueue_trial(skip_params(SkipSet.heuristic(n_layers, scale), n_layers))
    require(
        same_weights(study.user_attrs["model"], identity),
        f"the study at {storage_path} was made for another model: use another --out",
    )
    require(
        study.user_attrs["settings"] == settings,
        f"the study at {storage_path} measured other prompts or settings ({study.user_attrs['settings']}): "
        "resume with the same ones, or use another --out",
    )
    return study


@dataclass
class SearchSession:
    """One search session's objective and bookkeeping: the best finished trial so far (across sessions), written
    to `out` whenever it improves; a trial slower than `give_up` times the best (or autoregressive) stops early."""

    study: object  # the optuna study
    engine: object  # the target's Engine
    prompts: list[list[int]]
    out: Path
    identity: dict  # the target's
    n_layers: int
    seed: int
    clock: str
    max_new_tokens: int
    method: dict  # the self-speculative options of every trial
    give_up: float | None
    autoregressive: float  # ms per token
    bar: object  # the progress bar

    def __post_init__(self):
        done = [t for t in self.study.trials if t.state.name == "COMPLETE" and not t.user_attrs["cut_short"]]
        self.best = min(done, key=lambda t: t.value, default=None)

    def objective(self, trial) -> float:
        names = skip_params(SkipSet(), self.n_layers)
        skip = params_skip({name: trial.suggest_categorical(name, [False, True]) for name in names})
        fastest = min(self.autoregressive, self.best.value if self.best is not None else self.autoregressive)
        limit = None if self.give_up is None else self.give_up * fastest
        m = measure(
            self.engine,
            self.prompts,
            self.max_new_tokens,
            self.clock,
            limit,
            method="self-speculative",
            skip=skip,
            **self.method,
        )
        for key, value in asdict(m).items():
            trial.set_user_attr(key, value)
        return m.ms_per_token

    def after_trial(self, study, trial) -> None:
        self.bar.update(1)
        if trial.state.name == "COMPLETE" and not trial.user_attrs["cut_short"]:
            if self.best is None or trial.value < self.best.value:
                self.best = trial
                self.write(self.result_of(trial))
        if self.best is not None:
            speedup = self.autoregressive / self.best.value
            self.bar.set_postfix_str(f"best {self.best.value:.1f} ms/token ({speedup:.2f}x autoregressive)")

    def result_of(self, trial) -> SearchResult:
        m = Measured(**{k: trial.user_attrs[k] for k in ("ms_per_token", "acceptance", "tokens_per_step", "cut_short")})
        finished = [t for t in self.study.trials if t.state.is_finished()]  # not the warm starts still queued
        return SearchResult(params_skip(trial.params), m, self.autoregressive, len(finished))

    def write(self, result: SearchResult) -> None:
        write_result(self.out, result, self.identity, self.seed, self.clock, self.engine.arithmetic)


def study_path(out: Path) -> Path:
    """Where the study of a search writing `out` is kept: next to it."""
    return out.with_name(out.stem + ".study.journal")


def write_result(out: Path, result: SearchResult, identity: dict, seed: int, clock: str, arithmetic: str) -> None:
    m = result.measured
    save_skip_set(
        out,
        result.skip,
        identity,
        search={
            "objective": f"ms per generated token ({clock} clock), greedy, on the development prompts",
            "arithmetic": arithmetic,
            "ms_per_token": round(m.ms_per_token, 3),
            "autoregressive_ms_per_token": round(result.autoregressive_ms_per_token, 3),
            "speedup": round(result.speedup, 4),
            "acceptance": None if m.acceptance is None else round(m.acceptance, 4),
            "tokens_per_step": None if m.tokens_per_step is None else round(m.tokens_per_step, 4),
            "trials": result.trials,
            "seed": seed,
        },
    )


# -- the command ---------------------------------------------------------------------------


# -- the options of `search_layers_command` ---------------------------------------

OUT = typer.Option(
    ..., "--out", help="Where to write the skip set (JSON); the study is kept next to it in OUT.study.journal."
)
BUDGET = typer.Option(10.0, "--budget", "-b", help="Time budget in minutes; the running trial finishes after it.")
TRIALS = typer.Option(None, "--trials", help="Stop after this many trials in this session (default: only the budget).")
RESUME = typer.Option(False, help="Continue the study kept next to OUT (same model, prompts and settings).")
LIMIT = typer.Option(None, help="Use only the first N prompts (each trial decodes them all).")
MAX_NEW_TOKENS = typer.Option(32, "--max-new-tokens", "-n", help="New tokens per prompt and trial.")
CHAT = typer.Option(True, help="Wrap prompts in the chat template unless their JSONL row says otherwise.")
CLOCK = typer.Option(
    "wall", help="wall: elapsed time; cpu: this process's CPU time (steadier on a busy machine, CPU only)."
)
THREADS = typer.Option(None, help="torch CPU threads while searching (1 with --clock cpu on a shared machine).")
GIVE_UP_OPTION = typer.Option(
    GIVE_UP,
    help="Stop measuring a trial once it runs this many times slower than the best so far (0 = measure every trial in "
    "full).",
)
OPTION = typer.Option(
    [],
    "--option",
    "-o",
    help="A self-speculative option as key=value for every trial, e.g. -o policy=constant -o k=4. Repeatable.",
)


def search_layers_command(
    out: Path = OUT,
    model: Optional[str] = target_option("The model", "--model"),
    prompts: Path = prompts_option(DEV_PROMPTS, "Development prompts"),
    budget: float = BUDGET,
    trials: Optional[int] = TRIALS,
    seed: int = seed_option("the TPE sampler"),
    resume: bool = RESUME,
    limit: Optional[int] = LIMIT,
    max_new_tokens: int = MAX_NEW_TOKENS,
    chat: bool = CHAT,
    clock: str = CLOCK,
    threads: Optional[int] = THREADS,
    give_up: float = GIVE_UP_OPTION,
    option: list[str] = OPTION,
    dtype: str = dtype_option(),
    device: str = device_option(),
):
    """Search which attention / MLP sub-layers self-speculative decoding skips (Bayesian optimisation, time-boxed,
    resumable)."""
    import torch

    from draftverify.engine import Engine, load_target
    from draftverify.methods.spec import parse_options

    require(out.suffix == ".json", f"--out {out} must end in .json")
    require(limit is None or limit >= 1, f"--limit {limit} must be at least 1")
    require(give_up == 0 or give_up >= 1, f"--give-up {give_up} must be 0 (never) or at least 1")
    if threads is not None:
        require(threads >= 1, f"--threads {threads} must be at least 1")
        torch.set_num_threads(threads)
    rows = read_prompts(prompts, chat)[:limit]
    target, arithmetic = load_target(model, dtype, device)  # searched in the arithmetic it decodes in
    engine = Engine(target, arithmetic=arithmetic)
    ids = [engine.encode(text, chat=as_chat) for text, as_chat in rows]
    try:
        result = search_layers(
            target, ids, out, budget * 60, trials, seed, resume, max_new_tokens, clock, parse_options(option),
            give_up=give_up or None, engine=engine,
        )  # fmt: skip
    except KeyboardInterrupt:
        raise DraftVerifyError(
            f"interrupted: the best skip set so far is in {out}; continue with the same command and --resume"
        ) from None
    typer.echo(describe_result(result, out, 2 * len(decoder_layers(target.model))))


def describe_result(result: SearchResult, out: Path, sub_layers: int) -> str:
    """The search's closing lines: the best skip set, its speed against autoregressive, where it was written."""
    m = result.measured
    return (
        f"best of {result.trials} trials: skip {result.skip.describe()} ({result.skip.size} of "
        f"{sub_layers} sub-layers)\n"
        f"{m.ms_per_token:.1f} ms/token vs {result.autoregressive_ms_per_token:.1f} autoregressive "
        f"({result.speedup:.2f}x), "
        f"acceptance {m.acceptance if m.acceptance is None else round(m.acceptance, 3)}, tokens/step "
        f"{m.tokens_per_step if m.tokens_per_step is None else round(m.tokens_per_step, 2)}\n"
        f"wrote {out}; use it with `draftverify generate -m self-speculative --skip-file {out}`"
    )
