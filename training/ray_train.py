"""Drafter training under Ray Train: ``TorchTrainer`` workers run :func:`training.trainer.train` on a shard each.

Scaling comes from the cluster: one worker per GPU when there are GPUs (else
one CPU worker, or ``workers``). Strategies:

- ``ddp``: gradients are averaged across workers with ``torch.distributed``
  all-reduce after each backward (what DDP does; done by hand because the
  recipes call their modules' own methods, not ``forward``);
- ``deepspeed``: ZeRO stage 2 through ``deepspeed.initialize``; it needs GPUs
  in the cluster and the ``deepspeed`` package, and fails with a
  ``ConfigError`` on ``strategy`` when either is missing.

Rank 0 writes the checkpoints and the artifact into ``out`` (shared storage on
a multi-node cluster) and reports them to Ray Train; a rerun resumes from
``out/checkpoint.pt`` like the local path.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from decoding.drafters.storage import Storage
from decoding.errors import ConfigError

STRATEGIES = ("ddp", "deepspeed")  # how Ray Train runs a drafter's training (scaling checks what the cluster allows)


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def scaling(resources: dict, workers: int | None, strategy: str) -> tuple[int, bool]:
    """(number of workers, use_gpu) from the cluster's resources; checks the strategy can run.

    >>> scaling({"CPU": 8}, None, "ddp")
    (1, False)
    >>> scaling({"CPU": 8, "GPU": 4}, None, "ddp")
    (4, True)
    >>> scaling({"CPU": 8}, None, "deepspeed")
    Traceback (most recent call last):
    ...
    decoding.errors.ConfigError: strategy: deepspeed (ZeRO) runs on GPUs and this cluster has none; use --strategy ddp
    """
    gpus = int(resources.get("GPU", 0))
    if strategy == "deepspeed":
        if gpus < 1:
            raise ConfigError("strategy", "deepspeed (ZeRO) runs on GPUs and this cluster has none; use --strategy ddp")
        if not deepspeed_available():
            raise ConfigError("strategy", "deepspeed is not installed (pip install deepspeed); use --strategy ddp")
    elif strategy not in STRATEGIES:
        raise ConfigError("strategy", f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    if workers is not None and workers < 1:
        raise ConfigError("workers", f"must be >= 1, got {workers}")
    return (workers or (gpus if gpus else 1)), gpus > 0


def _ddp_wrap(world: int):
    def wrap(module, opt):
        import torch.distributed as dist

        def step():
            if world > 1:
                for p in module.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                        p.grad /= world
            opt.step()

        return module, lambda loss: loss.backward(), step if world > 1 else opt.step

    return wrap


def _deepspeed_wrap(batch: int):
    def wrap(module, opt):
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": batch, "zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}
        engine, ds_opt, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=config)
        return engine.module, engine.backward, engine.step

    return wrap


def _worker(config: dict) -> None:
    import ray.train
    import torch

    from decoding.model.loading import load_model
    from training.data import load_examples
    from training.trainer import TrainSpec, train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    spec = TrainSpec(**config["spec"])
    target = load_model(config["model"], "float32").model
    if config["use_gpu"]:
        from ray.train.torch import get_device

        target = target.to(get_device())
    features, eval_examples = None, None
    if config.get("distill"):  # token ids of `specray distill`; the target's features computed per window
        from training.features import TargetFeatures, distill_training_set

        d = config["distill"]
        examples, eval_examples = distill_training_set(Path(config["data_dir"]), d["max_sequences"], d["eval_sequences"])
        features = TargetFeatures(
            load_model(config["model"], "bfloat16", next(target.parameters()).device, d["quant"]).model,
            config["layers"],
            d.get("max_context"),
        )
    else:
        examples = load_examples(Path(config["data_dir"]), config["layers"])
    wrap = _deepspeed_wrap(spec.batch) if config["strategy"] == "deepspeed" else _ddp_wrap(world)

    def report(row, ckpt_path):
        ckpt = ray.train.Checkpoint.from_directory(str(ckpt_path.parent)) if ckpt_path is not None else None
        ray.train.report(row, checkpoint=ckpt)

    torch.set_num_threads(config["threads"])
    training = train(
        spec,
        target,
        examples,
        Path(config["out"]),
        config["model"],
        progress=rank == 0,
        wrap=wrap,
        report=report,
        shard=(rank, world),
        extra_training=config["extra"],
        features=features,
        eval_examples=eval_examples,
        storage=Storage(**config.get("storage", {})),
    )
    if rank == 0:
        ray.train.report({"done": True, "eval_agreement": training["eval_agreement"]})


def train_on_cluster(
    spec,
    model: str,
    data_dir: Path,
    layers: list[int],
    out: Path,
    workers: int | None = None,
    strategy: str = "ddp",
    extra: dict | None = None,
    threads: int = 1,
    address: str | None = None,
    distill: dict | None = None,
    storage: dict | None = None,
) -> dict:
    """Run the training on Ray Train; returns the artifact's ``training`` description (read back from ``out``).

    ``distill`` ({"max_sequences", "eval_sequences", "quant"}): ``data_dir`` is a ``specray distill`` directory
    (token ids; each worker computes the target's features as it draws windows). ``storage``: ``Storage`` fields of
    the artifact's weights off the default."""
    import json

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from cluster.runtime import connect, shutdown_if_started_here

    info = connect(address)
    try:
        num_workers, use_gpu = scaling(info["resources"], workers, strategy)
        out = Path(out).resolve()
        config = {
            "spec": spec.to_dict(),
            "model": model,
            "data_dir": str(Path(data_dir).resolve()),
            "layers": layers,
            "out": str(out),
            "strategy": strategy,
            "use_gpu": use_gpu,
            "threads": threads,
            "extra": {**(extra or {}), "ray_workers": num_workers, "strategy": strategy},
            "distill": distill,
            "storage": storage or {},
        }
        resources = None if use_gpu else {"CPU": threads}
        trainer = TorchTrainer(
            _worker,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu, resources_per_worker=resources),
            run_config=RunConfig(name=f"train-drafter-{spec.recipe}", storage_path=str(out / "ray")),
        )
        result = trainer.fit()
        if result.error:
            raise result.error
        return json.loads((out / "drafter.json").read_text())["training"]
    finally:
        shutdown_if_started_here()
