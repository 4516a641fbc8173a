"""The search: a Ray Tune ``Tuner`` over a :class:`~tuning.space.SearchSpace`, started fresh or restored.

- searcher: Optuna TPE (``OptunaSearch`` with the space as a define-by-run
  function, so each method's knobs are suggested only when it is chosen), seeded
  with the untuned defaults of every method so the search always measures them;
  ``random`` uses Tune's own sampler over :meth:`SearchSpace.tune_space`;
- scheduler: ASHA on prompt-count milestones (``training_iteration`` = prompts
  done; ``max_t`` = the number of prompts);
- resources: ``tune.with_resources`` with a placement-group factory per trial
  (:mod:`tuning.resources`); ``max_concurrent_trials`` = cluster CPUs // CPUs per trial;
- storage: ``<storage>/<name>``; ``FailureConfig(max_failures)`` retries a
  trial whose worker died; :func:`restore` continues an interrupted experiment
  (``Tuner.restore``) with the settings saved next to it.

Ray must already be connected (``cluster.runtime.connect``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from decoding.config import SpecConfig
from tuning.resources import max_concurrent, trial_resources
from tuning.space import SearchSpace
from tuning.trainable import METRIC, TrialSetup, trainable

SETTINGS_FILE = "specray_tune.json"
SEARCHERS = ("optuna", "random")


@dataclass
class TuneSettings:
    """Everything that defines a search; saved as ``<experiment>/specray_tune.json`` so ``--resume`` rebuilds it."""

    base: dict  # SpecConfig fields
    methods: list
    name: str
    storage: str
    prompts_file: str
    categories: list | None = None
    limit: int | None = None
    workload: str = "spec_bench"
    fixed: list = field(default_factory=list)
    ranges: dict = field(default_factory=dict)
    num_samples: int = 20
    time_budget_s: float | None = None
    searcher: str = "optuna"
    early_stop: bool = True
    grace_period: int = 1
    reduction_factor: int = 2
    seed: int = 0
    cpus_per_trial: int = 1
    gpus_per_trial: float = 0.0
    max_concurrent: int | None = None
    max_failures: int = 2
    warmup: int = 1
    seed_defaults: bool = True
    holdout: float = 0.0  # fraction of every category's prompts kept out of the search (specray tune: 0.5)
    verify_repeats: int = 1  # passes over those prompts when the winner is re-measured
    allow_lossy: bool = False  # a lossy method's trial (EAD) may be the winner (published under a name saying lossy)

    @property
    def base_config(self) -> SpecConfig:
        return SpecConfig.from_dict(self.base)

    @property
    def experiment_path(self) -> Path:
        return Path(self.storage) / self.name

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: Path | None = None) -> Path:
        path = Path(path or self.experiment_path / SETTINGS_FILE)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))
        return path

    @classmethod
    def load(cls, experiment: Path) -> TuneSettings:
        data = json.loads((Path(experiment) / SETTINGS_FILE).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def build_trainable(setup: TrialSetup, settings: TuneSettings):
    from ray import tune

    fn = tune.with_parameters(trainable, setup=setup)
    return tune.with_resources(fn, trial_resources(settings.cpus_per_trial, settings.gpus_per_trial))


def _searcher(settings: TuneSettings, space: SearchSpace, base: SpecConfig):
    if settings.searcher == "random":
        return None, space.tune_space()
    from ray.tune.search.optuna import OptunaSearch

    points = space.default_points(base) if settings.seed_defaults else None
    return OptunaSearch(space=space, metric=METRIC, mode="max", points_to_evaluate=points, seed=settings.seed), {}


def _scheduler(settings: TuneSettings, n_prompts: int):
    if not settings.early_stop or n_prompts < 2:
        return None
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(
        time_attr="training_iteration",
        max_t=n_prompts,
        grace_period=max(1, min(settings.grace_period, n_prompts)),
        reduction_factor=settings.reduction_factor,
    )


def concurrency(settings: TuneSettings) -> int:
    import ray

    limit = max_concurrent(ray.cluster_resources(), settings.cpus_per_trial, settings.gpus_per_trial)
    return min(limit, settings.max_concurrent) if settings.max_concurrent else limit


def new_tuner(settings: TuneSettings, setup: TrialSetup, callbacks=None, verbose: int = 1):
    """A fresh ``Tuner`` for the settings (its experiment directory gets the settings file)."""
    from ray import tune

    base = setup.base
    search_alg, param_space = _searcher(settings, setup.space, base)
    settings.save()
    return tune.Tuner(
        build_trainable(setup, settings),
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=METRIC,
            mode="max",
            search_alg=search_alg,
            scheduler=_scheduler(settings, len(setup.prompts)),
            num_samples=settings.num_samples,
            max_concurrent_trials=concurrency(settings),
            time_budget_s=settings.time_budget_s,
            reuse_actors=True,  # a worker keeps its loaded model (decoding.model.loading caches per process) for the next trial
        ),
        run_config=tune.RunConfig(
            name=settings.name,
            storage_path=str(Path(settings.storage).resolve()),
            failure_config=tune.FailureConfig(max_failures=settings.max_failures),
            callbacks=callbacks,
            verbose=verbose,
        ),
    )


def restore_tuner(experiment: Path, setup: TrialSetup, settings: TuneSettings):
    """``Tuner.restore`` of an interrupted experiment: finished trials are kept, unfinished and errored ones run again."""
    from ray import tune

    return tune.Tuner.restore(
        str(Path(experiment).resolve()),
        trainable=build_trainable(setup, settings),
        resume_unfinished=True,
        resume_errored=False,
        restart_errored=True,
    )


def can_restore(experiment: Path) -> bool:
    from ray import tune

    return (Path(experiment) / SETTINGS_FILE).is_file() and tune.Tuner.can_restore(str(Path(experiment).resolve()))


def model_depth(base: SpecConfig) -> int:
    """Decoder layers of the target (the bound of the layer knobs); loads the model in this process (cached)."""
    from decoding.model.adapter import ModelAdapter
    from decoding.model.loading import load_model

    return len(ModelAdapter(load_model(base.model, base.dtype).model).layers)


def build_space(settings: TuneSettings, depth: int) -> SearchSpace:
    """The settings' search space for a target of ``depth`` layers, checked against the base config."""
    base = settings.base_config
    ranges = {k: {kk: tuple(vv) if isinstance(vv, list) else vv for kk, vv in v.items()} for k, v in settings.ranges.items()}
    space = SearchSpace.build(settings.methods, depth, fixed=settings.fixed, ranges=ranges, draft_model=base.draft_model)
    space.check_base(base)
    return space


def trial_statuses(grid) -> list[str]:
    analysis = getattr(grid, "_experiment_analysis", None)
    trials = getattr(analysis, "trials", None) or []
    return [str(t.status) for t in trials]


def was_interrupted(statuses: list[str], settings, wall_s: float) -> bool:
    """A trial left unfinished, or fewer trials than asked with time budget left: Tune stopped on Ctrl-C (or SIGUSR1).

    >>> from types import SimpleNamespace as S
    >>> was_interrupted(["TERMINATED"] * 3, S(num_samples=3, time_budget_s=None), 10.0)
    False
    >>> was_interrupted(["TERMINATED"], S(num_samples=3, time_budget_s=None), 10.0)
    True
    >>> was_interrupted(["TERMINATED"], S(num_samples=3, time_budget_s=5.0), 10.0)  # the budget ended it
    False
    """
    if any(s not in ("TERMINATED", "ERROR") for s in statuses):
        return True
    budget_spent = settings.time_budget_s is not None and wall_s >= settings.time_budget_s
    return len(statuses) < settings.num_samples and not budget_spent
