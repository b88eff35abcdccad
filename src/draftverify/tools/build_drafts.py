"""`draftverify build-drafts`: everything the seed methods draft with, built for one target in one command.

Three stages, in order, each the project's own tool with its checkpoints:
1. `head`: the feature head (`make-draft --kind head`, tools/make_draft/feature_head.py) on the target's batched
   replies to the training prompts, decoded by the engine in the target's arithmetic; the card's held-out agreement
   goes into the manifest;
2. `acceptance`: SpecDec++'s acceptance head for that feature head (the drafter `specdec-pp` stops by default;
   tools/train_acceptance_head.py): the engine answers that tool's prompts (disjoint from the training prompts)
   batch by batch until the stage's data deadline, then the head drafts chains on the answers (labelled on the
   engine's runner) and the acceptance head is fitted and judged on held-out answers;
3. `skipset`: Draft & Verify's skip set (tools/search_layers.py), searched on the development prompts in the
   target's arithmetic.
The wall-clock budget is split between the stages (`SPLIT`); each stage stops its own work at its share.

Everything is made in a hidden work folder beside the published one (`<store>/<target key>/.<arithmetic>.build`):
a finished stage leaves a marker there and is skipped when the build runs again with `--resume`; an unfinished one
resumes from its tool's checkpoints (data shards, the head's checkpoint, the cached answers, the search's journal).
When every stage is done, the artifacts are assembled in a hidden folder and published with one rename
(`loading.store.publish`), where every method finds them (`loading.store`); the work folder is then removed.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer

from draftverify.cli_options import device_option, dtype_option, seed_option, target_option
from draftverify.errors import require
from draftverify.loading import Loaded, stock_model
from draftverify.loading.store import (
    ARTIFACTS,
    BUILD_MINUTES,
    find,
    read_manifest,
    staging_folder,
    target_key,
    user_root,
    write_manifest,
)
from draftverify.loading.store import publish as publish_folder
from draftverify.sampling import Sampling
from draftverify.util import atomic_write

STAGES = ARTIFACTS  # head, acceptance, skipset
SPLIT = (0.7, 0.15, 0.15)  # of the budget, per stage: 63, 13.5 and 13.5 minutes of the default 90 (`minutes`)
TRAIN_PROMPTS = Path("../shared/data/train_prompts/prompts.jsonl")  # training prompts only, never a benchmark set
ACCEPTANCE_PROMPTS = Path(__file__).parent.parent / "assets" / "specdec-prompts.jsonl"  # disjoint from TRAIN_PROMPTS
ANSWER_SHARE = 0.6  # part of the acceptance stage spent on the target's answers (the rest: labels and the fit)
SEARCH_PROMPTS = 8  # development prompts each skip-set trial decodes
FILES = {"head": "head", "acceptance": "acceptance.safetensors", "skipset": "skipset.json"}
SAMPLING = Sampling()  # greedy labels: the settings the shipped acceptance heads are for


@dataclass(frozen=True)
class BuildSettings:
    """budget_minutes: wall clock of the whole build, split by `split` (head, acceptance, skip set).
    stages: which to build (`--only`). prompts: the feature head's training prompts. acceptance_prompts: the prompts
    whose answers the acceptance head is trained on (`train-acceptance-head`'s own, disjoint from the training
    prompts, so that the head drafts on replies it never trained on). head / acceptance / search: settings handed to
    each tool (`HeadTraining`, `TrainSettings` plus max_new_tokens and answer_batch, `search_layers`' keywords), for
    small test builds."""

    budget_minutes: float = float(BUILD_MINUTES)
    stages: tuple[str, ...] = STAGES
    prompts: Path = TRAIN_PROMPTS
    acceptance_prompts: Path = ACCEPTANCE_PROMPTS
    split: tuple[float, float, float] = SPLIT
    seed: int = 0
    head: dict = field(default_factory=dict)
    acceptance: dict = field(default_factory=dict)
    search: dict = field(default_factory=dict)

    def __post_init__(self):
        require(self.budget_minutes > 0, f"--budget-minutes {self.budget_minutes} must be positive")
        unknown = [s for s in self.stages if s not in STAGES]
        require(self.stages and not unknown, f"--only {','.join(unknown) or '(empty)'}: use some of {','.join(STAGES)}")
        require(
            len(self.split) == 3 and all(x > 0 for x in self.split) and abs(sum(self.split) - 1) < 1e-6,
            f"split {self.split} must be three positive shares summing to 1",
        )

    def minutes(self, stage: str) -> float:
        """The stage's part of the budget: its share among the stages built (all of it for one `--only` stage)."""
        chosen = sum(self.split[STAGES.index(s)] for s in self.stages)
        return self.budget_minutes * self.split[STAGES.index(stage)] / chosen


@dataclass
class Build:
    """One build: the target as the engine decodes it (`engine`, its runners in the target's arithmetic; `target`,
    the engine's model), the settings, and the work folder."""

    target: Loaded
    engine: object  # draftverify.engine.Engine
    settings: BuildSettings
    work: Path
    published: Path  # where the build is published (it may hold an earlier build)
    log: object = print
    progress: bool = True
    _stock: Loaded | None = None

    def stock(self) -> Loaded:
        """The target as a stock transformers module (what the head's training and the acceptance head's chains
        read): the target itself, or a GGUF file's fp32 conversion, built on first use (a skip-set-only build never
        pays for it)."""
        if self._stock is None:
            t = self.target
            self._stock = (
                t if not hasattr(t.model, "stock") else Loaded(stock_model(t.model), t.tokenizer, t.name, t.source)
            )
        return self._stock

    def folder(self, stage: str) -> Path:
        path = self.work / stage
        path.mkdir(parents=True, exist_ok=True)
        return path

    def marker(self, stage: str) -> Path:
        return self.work / f"{stage}.done.json"

    def artifact(self, stage: str) -> Path:
        return self.work / stage / FILES[stage]


# -- the stages ---------------------------------------------------------------------------------


def head_stage(build: Build) -> dict:
    """The feature head, in `work/head/head`; its data and checkpoint in `work/head/work`."""
    from draftverify.tools.make_draft.feature_head import HeadTraining, build_head

    s = build.settings
    config = HeadTraining(**{"budget_minutes": s.minutes("head"), "seed": s.seed, **s.head})
    facts = build_head(
        build.stock(), build.artifact("head"), s.prompts, config, work=build.folder("head") / "work", resume=True,
        command="draftverify build-drafts", log=build.log, progress=build.progress, save_dtype="fp16",
        runner=build.engine.target_runner,
    )  # fmt: skip
    keep = ("heldout_top1", "template_heldout_top1", "expected_chain", "vocab_coverage", "steps", "sequences")
    keep += ("of_steps", "kept_step", "batch_tokens")  # the schedule and the step whose weights were written
    return {k: facts[k] for k in keep} | {"minutes": facts["minutes"]}


def acceptance_stage(build: Build) -> dict:
    """SpecDec++'s acceptance head for the feature head, in `work/acceptance/acceptance.safetensors`."""
    from draftverify.drafters.acceptance_head import save_head
    from draftverify.feature_head import FeatureHead
    from draftverify.tools.acceptance_fit import TrainSettings, report_markdown
    from draftverify.tools.train_acceptance_head import train_acceptance_head

    t0, s, target = time.monotonic(), build.settings, build.stock()
    own = dict(s.acceptance)
    max_new_tokens, batch = own.pop("max_new_tokens", 96), own.pop("answer_batch", 16)
    head = FeatureHead.load(feature_head_folder(build)).bind(target)
    ids, answers = answered_prompts(build, max_new_tokens, batch, t0 + ANSWER_SHARE * s.minutes("acceptance") * 60)
    trained = train_acceptance_head(
        target, head, [], TrainSettings(**{"seed": s.seed, **own}), SAMPLING, max_new_tokens, batch,
        build.folder("acceptance") / "cache", build.progress, answered=(ids, answers),
        runner=build.engine.target_runner,
    )  # fmt: skip
    trained.settings["prompts"] = len(ids)
    path = save_head(build.artifact("acceptance"), trained, head.identity, target.identity)
    atomic_write(path.with_suffix(".md"), report_markdown(trained, path))
    held = trained.settings["report"]["heldout"]
    facts = {k: held.get(k) for k in ("bce", "bce_constant", "ece")} | {"answers": len(ids)}
    return facts | {"drafter": head.identity, "minutes": (time.monotonic() - t0) / 60}


def answered_prompts(build: Build, max_new_tokens: int, batch: int, deadline: float):
    """(prompt ids, greedy answers) of the acceptance prompts, decoded together `batch` at a time by the engine in
    the target's arithmetic until `deadline` (at least one batch); each batch is kept in the work folder
    (atomically), so a resumed stage re-reads what it answered."""
    from draftverify.prompt_files import read_prompts
    from draftverify.tools.make_draft.features import generate

    engine, folder = build.engine, build.folder("acceptance")
    rows = read_prompts(build.settings.acceptance_prompts, chat=True)
    encoded = [engine.encode(text, chat=chat) for text, chat in rows]
    first = engine.target_runner  # on the static path, decoded together in the engine's batch; else model.generate
    runners = (
        [first, *(first.fork() for _ in range(min(batch, len(encoded)) - 1))] if first.static is not None else None
    )
    target = build.target if runners else build.stock()
    ids, answers = [], []
    for n, start in enumerate(range(0, len(encoded), batch)):
        path = folder / f"answers-{n:05d}.json"
        if not path.is_file():
            if ids and time.monotonic() > deadline:
                break
            got = generate(target, encoded[start : start + batch], max_new_tokens, runners=runners)
            atomic_write(path, json.dumps([s.ids[s.start :].tolist() for s in got]))
        ids += encoded[start : start + batch]
        answers += json.loads(path.read_text())
        build.log(f"acceptance: the target answered {len(ids)} of {len(encoded)} prompts")
    return ids, answers


def skipset_stage(build: Build) -> dict:
    """The skip set, in `work/skipset/skipset.json` (its study's journal beside it)."""
    from draftverify.prompt_files import read_prompts
    from draftverify.tools.search_layers import DEV_PROMPTS, search_layers, study_path

    t0, s, engine = time.monotonic(), build.settings, build.engine
    ids = [engine.encode(text, chat=chat) for text, chat in read_prompts(DEV_PROMPTS)[:SEARCH_PROMPTS]]
    out = build.artifact("skipset")
    build.folder("skipset")
    result = search_layers(
        engine.target, ids, out, s.minutes("skipset") * 60, seed=s.seed, resume=study_path(out).exists(),
        progress=build.progress, engine=engine, **s.search,
    )  # fmt: skip
    m = result.measured
    facts = {"skip": {"attention": list(result.skip.attention), "mlp": list(result.skip.mlp)}}
    facts |= {"acceptance": m.acceptance, "tokens_per_step": m.tokens_per_step, "trials": result.trials}
    return facts | {"minutes": (time.monotonic() - t0) / 60}


STAGE_RUNNERS = {"head": head_stage, "acceptance": acceptance_stage, "skipset": skipset_stage}


def feature_head_folder(build: Build) -> Path:
    """The feature head the acceptance head is for: this build's, else the one published for the target."""
    if build.marker("head").is_file():
        return build.artifact("head")
    found = find(build.target.identity, build.engine.arithmetic, "head", roots=[build.published.parent.parent])
    require(
        found is not None,
        f"no feature head built for {build.target.name}: run `draftverify build-drafts --only head` first",
    )
    return found


# -- the build --------------------------------------------------------------------------------


def build_drafts(
    target: Loaded,
    engine,
    settings: BuildSettings = BuildSettings(),
    root: Path | None = None,
    resume: bool = False,
    log=print,
    progress: bool = True,
) -> Path:
    """Run the stages of `settings` for `target` (the model `engine` decodes in its arithmetic) and
    publish the result in the store under `root` (default: the user cache's); returns the published folder."""
    root = Path(root) if root is not None else user_root()
    published = root / target_key(target.identity) / engine.arithmetic
    work = published.parent / f".{engine.arithmetic}.build"
    require(
        resume or not work.exists(),
        f"an unfinished build is in {work}: pass --resume to continue it, or delete that folder to start over",
    )
    work.mkdir(parents=True, exist_ok=True)
    build = Build(target, engine, settings, work, published, log, progress)
    t0 = time.monotonic()
    for stage in (s for s in STAGES if s in settings.stages):
        if build.marker(stage).is_file():
            log(f"[{stage}] finished in an earlier run: kept")
            continue
        log(f"[{stage}] start ({settings.minutes(stage):.1f} min of the budget; {_clock(t0)} elapsed)")
        started = time.monotonic()
        facts = STAGE_RUNNERS[stage](build)
        atomic_write(build.marker(stage), json.dumps(facts, indent=1) + "\n")
        log(f"[{stage}] done in {_clock(started)} ({_clock(t0)} elapsed)")
    dest = publish(build)
    shutil.rmtree(work, ignore_errors=True)
    log(f"published {dest} ({_clock(t0)} elapsed)")
    return dest


def publish(build: Build) -> Path:
    """Assemble this build's artifacts (and the earlier build's for the stages not rebuilt) with a manifest in a
    hidden folder, then move it into place with one rename."""
    earlier = read_manifest(build.published) or {}
    staging = staging_folder(build.published)
    try:
        manifest = assemble(build, earlier, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    write_manifest(staging, manifest)
    return publish_folder(staging, build.published)


def assemble(build: Build, earlier: dict, staging: Path) -> dict:
    """Copy the artifacts into `staging`: those built now, and those of the `earlier` build (its manifest) for the
    stages not rebuilt (not its acceptance head once the feature head is new); returns the manifest."""
    artifacts, stages = {}, {}
    for stage in STAGES:
        if build.marker(stage).is_file():
            source, facts = build.artifact(stage), json.loads(build.marker(stage).read_text())
        elif stage in earlier.get("artifacts", {}):
            source, facts = build.published / earlier["artifacts"][stage], earlier.get("stages", {}).get(stage)
        else:
            continue
        if stage == "acceptance" and build.marker("head").is_file() and not build.marker(stage).is_file():
            build.log("[acceptance] the earlier acceptance head was for the earlier feature head: dropped")
            continue
        copy = shutil.copytree if source.is_dir() else shutil.copy2
        copy(source, staging / FILES[stage])
        if stage == "acceptance" and source.with_suffix(".md").is_file():
            shutil.copy2(source.with_suffix(".md"), staging / "acceptance.md")
        artifacts[stage], stages[stage] = FILES[stage], facts
    s = build.settings
    return {
        "target": build.target.identity,
        "target_name": build.target.name,
        "arithmetic": build.engine.arithmetic,
        "built": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "budget_minutes": s.budget_minutes,
        "split": {stage: s.minutes(stage) / s.budget_minutes for stage in STAGES if stage in s.stages},
        "built_now": [stage for stage in STAGES if build.marker(stage).is_file()],
        "artifacts": artifacts,
        "stages": stages,
        "acceptance_for": (stages.get("acceptance") or {}).get("drafter"),
    }


def _clock(since: float) -> str:
    seconds = int(time.monotonic() - since)
    return f"{seconds // 60}:{seconds % 60:02d}"


# -- the command ------------------------------------------------------------------------------

BUDGET = typer.Option(
    float(BUILD_MINUTES),
    "--budget-minutes",
    help="Wall clock of the whole build, split between the stages: 70% feature head, 15% acceptance head, 15% skip "
    "set (the defaults fit a 1.5B target on a 2-core CPU).",
)
ONLY = typer.Option(
    None,
    help="Build only these stages, comma-separated: head, acceptance, skipset (the rest of an earlier build is kept).",
)
RESUME = typer.Option(False, help="Continue an interrupted build: finished stages are kept, the others resume.")
PROMPTS = typer.Option(
    TRAIN_PROMPTS, help="Training prompts (.jsonl with a prompt field, or .txt): never a benchmark set."
)


def build_drafts_command(
    target: Optional[str] = target_option(),
    budget_minutes: float = BUDGET,
    only: Optional[str] = ONLY,
    resume: bool = RESUME,
    prompts: Path = PROMPTS,
    seed: int = seed_option("the data order, the sampled replies and the search"),
    dtype: str = dtype_option("Weights dtype and target arithmetic (the build is stored per arithmetic)"),
    device: str = device_option(),
):
    """Build every draft the seed methods need for a target (a feature head, SpecDec++'s acceptance head for it,
    Draft & Verify's skip set), stored per target and arithmetic where every method finds it without flags."""
    from draftverify.engine import Engine, load_target
    from draftverify.prompt_files import read_prompts

    stages = tuple(x.strip() for x in only.split(",")) if only else STAGES
    settings = BuildSettings(budget_minutes=budget_minutes, stages=stages, prompts=prompts, seed=seed)
    if {"head", "acceptance"} & set(stages):  # a missing prompt file fails now, not after loading the target
        read_prompts(prompts, at_least=2)
    loaded, arithmetic = load_target(target, dtype, device)  # a GGUF file on its direct path: what the engine runs
    engine = Engine(loaded, arithmetic=arithmetic)
    build_drafts(loaded, engine, settings, resume=resume, log=lambda m: typer.echo(m, err=True))
