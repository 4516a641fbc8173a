"""Which device a config decodes on inside a Ray worker.

``SpecConfig.device=auto`` means CUDA when torch sees a GPU. Ray 2.60 no longer
hides the GPUs from a worker that was given none (it leaves
``CUDA_VISIBLE_DEVICES`` alone when zero GPUs are assigned), so in a Tune trial,
a Serve replica or a bench worker torch would see every GPU of the node. Inside
a Ray worker ``auto`` therefore means the GPUs Ray assigned to it (Ray then sets
``CUDA_VISIBLE_DEVICES`` to them, so ``cuda`` is the first of them), else CPU:
this module says whether Ray gave the worker any, ``decoding.model.loading.auto_device``
decides what ``auto`` is from that.

>>> placed_device("cpu"), placed_device("cuda:1")   # explicit devices are kept
('cpu', 'cuda:1')
"""

from __future__ import annotations

import sys


def in_ray_worker() -> bool:
    ray = sys.modules.get("ray")  # a Ray worker has imported Ray; a process that has not is no Ray worker
    return ray is not None and ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def placed_device(requested: str = "auto") -> str:
    """``requested`` unless it is ``auto`` inside a Ray worker: then what ``auto`` means for a process given the GPUs
    Ray gave this worker (``decoding.model.loading.auto_device``: ``cuda`` if it has one, else ``cpu``)."""
    if requested != "auto" or not in_ray_worker():
        return requested
    import ray

    from decoding.model.loading import auto_device

    return auto_device(gpus_given=bool(ray.get_gpu_ids()))


def placed(cfg):
    """``cfg`` (a SpecConfig) with its device resolved for this process (see :func:`placed_device`)."""
    device = placed_device(cfg.device)
    return cfg if device == cfg.device else cfg.replace(device=device)
