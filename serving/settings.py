"""What a serving deployment is configured with: one typed, JSON-serialisable object.

``ServeSettings`` is what :func:`serving.app.build_app` takes, what the YAML's
``args`` hold and what ``specray serve`` builds from its flags. Invalid values
fail at construction with a :class:`~decoding.config.ConfigError` naming the field.

>>> s = ServeSettings.from_dict({"registry": "/tmp/reg", "max_ongoing_requests": 2})
>>> (s.max_ongoing_requests, s.model_deployment_options()["max_ongoing_requests"])
(2, 2)
>>> ServeSettings(max_queued_requests=0)
Traceback (most recent call last):
...
decoding.config.ConfigError: max_queued_requests: must be >= 1, got 0
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from decoding.config import DTYPES, ConfigError


def _default_autoscaling() -> dict:
    # one replica per CPU worker is the useful unit on CPU; scale out under sustained queueing
    return {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2}


@dataclass(frozen=True)
class ServeSettings:
    """Fields
    ------
    registry: the config registry (``redis://...``, ``file://...`` or a directory);
        ``None``: ``SPECRAY_REDIS_URL`` if set, else ``$SPECRAY_HOME/registry``.
    base_model / dtype: the plain-AR model always served (also every entry's
        ``config.model`` is served as plain AR under its own id), and its dtype.
    max_ongoing_requests: concurrent generations per model replica (each runs in
        its own thread); Serve queues the rest.
    num_replicas: a fixed number of model replicas; ``None`` uses ``autoscaling``.
    autoscaling: Serve's ``autoscaling_config`` for the model deployment.
    model_num_cpus / ingress_num_cpus: Ray CPUs reserved per replica.
    model_num_gpus: Ray GPUs reserved per model replica (a fraction shares one GPU); a replica given a GPU
        decodes on it (configs with ``device=auto``, the default), one given none decodes on the CPU.
    threads: torch intra-op threads per model replica (``None``: torch/Ray's default).
    max_queued_requests: admission limit of one ingress replica: requests it holds at
        once (generating or waiting for a model replica). Beyond it: 429 + Retry-After.
    retry_after_s: the Retry-After value sent with a 429.
    max_loaded_configs: decoders kept per model replica (least recently used is dropped;
        model weights are shared between configurations of the same model and dtype).
    preload: model names (registry entries or plain ids) loaded when a replica starts.
    registry_refresh_s: re-read the registry when the cached copy is older than this
        (it is also re-read on ``/v1/models`` and on an unknown model name).
    watch_registry: also follow the registry's update channel (Redis pub/sub, file polling).
    request_log_size: finished generations a model replica remembers for
        ``/v1/specray/requests/{id}``.
    ingress_replicas: replicas of the HTTP ingress.
    """

    registry: str | None = None
    base_model: str = "smollm2-135m"
    dtype: str = "bfloat16"
    max_ongoing_requests: int = 4
    num_replicas: int | None = None
    autoscaling: dict = field(default_factory=_default_autoscaling)
    model_num_cpus: float = 1.0
    model_num_gpus: float = 0.0
    ingress_num_cpus: float = 0.0
    threads: int | None = None
    max_queued_requests: int = 64
    retry_after_s: int = 1
    max_loaded_configs: int = 4
    preload: list = field(default_factory=list)
    registry_refresh_s: float = 5.0
    watch_registry: bool = True
    request_log_size: int = 1024
    ingress_replicas: int = 1

    def __post_init__(self) -> None:
        types = {f.name: f.type for f in dataclasses.fields(self)}
        for name in types:
            value = getattr(self, name)
            want = {"int": int, "float": (int, float), "bool": bool, "str": str, "dict": dict, "list": list}
            base = types[name].replace(" | None", "")
            if value is None and "None" in types[name]:
                continue
            if isinstance(value, bool) and base != "bool" or not isinstance(value, want[base]):
                raise ConfigError(name, f"expected {base}, got {type(value).__name__} {value!r}")
        if not self.base_model:
            raise ConfigError("base_model", "must name a model")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        for name in ("max_ongoing_requests", "max_queued_requests", "max_loaded_configs", "request_log_size", "ingress_replicas"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ConfigError("num_replicas", f"must be >= 1, got {self.num_replicas}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError("threads", f"must be >= 1, got {self.threads}")
        for name in ("model_num_cpus", "model_num_gpus", "ingress_num_cpus", "registry_refresh_s"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if self.retry_after_s < 0:
            raise ConfigError("retry_after_s", f"must be >= 0, got {self.retry_after_s}")
        if not all(isinstance(p, str) and p for p in self.preload):
            raise ConfigError("preload", "must be a list of model names")
        if self.num_replicas is None:
            a = self.autoscaling
            lo, hi = a.get("min_replicas", 1), a.get("max_replicas", 1)
            if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi and hi >= 1):
                raise ConfigError("autoscaling", f"needs 0 <= min_replicas <= max_replicas, max_replicas >= 1; got {a}")

    # ---- serialisation ----------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict | None) -> ServeSettings:
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown serve setting; known: {', '.join(sorted(known))}")
        return cls(**data)

    def replace(self, **changes) -> ServeSettings:
        return dataclasses.replace(self, **changes)

    # ---- what the deployments get -----------------------------------------
    def model_deployment_options(self) -> dict:
        opts = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": self.model_num_cpus, "num_gpus": self.model_num_gpus},
            # loading a model can take a while on CPU; don't call a slow start a failure
            "health_check_timeout_s": 60,
        }
        if self.num_replicas is not None:
            opts["num_replicas"] = self.num_replicas
        else:
            opts["autoscaling_config"] = dict(self.autoscaling)
        return opts

    def ingress_deployment_options(self) -> dict:
        return {
            "num_replicas": self.ingress_replicas,
            # the ingress must *see* requests beyond the admission limit to answer them 429,
            # and keep room for /health and /metrics
            "max_ongoing_requests": self.max_queued_requests + 32,
            "ray_actor_options": {"num_cpus": self.ingress_num_cpus},
        }
