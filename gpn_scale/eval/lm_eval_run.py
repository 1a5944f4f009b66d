"""`gpn-scale lm-eval`: lm-evaluation-harness on a checkpoint, through the harness's Python API.

The tasks are resolved first (the harness's own, a directory of task YAMLs given with
`--include_path`, or YAML files named directly), so an unknown one is a one-line error before a
model is loaded; then the checkpoint becomes the harness model `gpn-scale`
(`gpn_scale.eval.lm_eval_model`), `lm_eval.simple_evaluate` runs, and the results (and with
`log_samples` every request's response) are written where the harness's own CLI writes them,
through its `EvaluationTracker`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from data_prep.errors import UserError


@dataclass
class HarnessRun:
    """What to evaluate and how (the options of `lm-eval run` that `gpn-scale lm-eval` takes)."""

    tasks: list[str]  # task or group names of the harness, globs of them, or task YAML files
    include_path: str | None = None  # a directory of task YAMLs of one's own
    num_fewshot: int | None = None
    limit: float | None = None  # the first N documents per task (a fraction below 1)
    batch_size: str = "16"
    output_path: str | None = None
    log_samples: bool = False
    gen_kwargs: str | None = None  # e.g. "temperature=0,max_gen_toks=64"
    seed: int = 0
    bootstrap_iters: int = 100000


def resolve_tasks(run: HarnessRun):
    """(task manager, tasks for simple_evaluate): names matched against the harness's index (and
    `include_path`), YAML files loaded; an unknown one is a UserError naming it."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    if run.include_path is not None and not Path(run.include_path).is_dir():
        raise UserError(f"--include_path: {run.include_path}: no such directory of task YAMLs")
    manager = TaskManager(include_path=run.include_path)
    resolved: list = []
    for name in run.tasks:
        if name.endswith((".yaml", ".yml")):
            if not Path(name).is_file():
                raise UserError(f"--tasks: {name}: no such task YAML file")
            found = [load_yaml(str(Path(name).resolve()), resolve_func=True)]
        else:
            found = manager.match_tasks([name])
        if not found:
            where = f" nor under {run.include_path}" if run.include_path else " (tasks of your own: --include_path DIR)"
            raise UserError(f"--tasks: unknown task {name!r}: not one of lm-evaluation-harness's tasks{where}; "
                            "`lm-eval ls tasks` lists them")
        resolved += [task for task in found if task not in resolved]
    return manager, resolved


def evaluate(lm, run: HarnessRun, resolved) -> dict:
    """Run the harness on the model `lm` (an `lm_eval.api.model.LM`) over the tasks `resolve_tasks`
    found; writes the results under `output_path` when given, and returns the harness's results
    dict (samples removed)."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker

    manager, tasks = resolved
    tracker = EvaluationTracker(output_path=run.output_path) if run.output_path else None
    results = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=run.num_fewshot, limit=run.limit, log_samples=run.log_samples,
        evaluation_tracker=tracker, task_manager=manager, gen_kwargs=run.gen_kwargs, batch_size=run.batch_size,
        random_seed=run.seed, numpy_random_seed=run.seed, torch_random_seed=run.seed, fewshot_random_seed=run.seed,
        bootstrap_iters=run.bootstrap_iters)
    samples = results.pop("samples", None)
    if tracker is not None:
        tracker.save_results_aggregated(results=results, samples=samples if run.log_samples else None)
        if run.log_samples:
            for task in results["configs"]:
                tracker.save_results_samples(task_name=task, samples=samples[task])
    return results
