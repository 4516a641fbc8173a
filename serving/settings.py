"""What a serving deployment is configured with: one typed, JSON-serialisable object.

``ServeSettings`` is what :func:`serving.app.build_app` takes, what the YAML's
``args`` hold and what ``specray serve`` builds from its flags. Invalid values
fail at construction with a :class:`~decoding.errors.ConfigError` naming the field.

>>> s = ServeSettings.from_dict({"registry": "/tmp/reg", "max_ongoing_requests": 2})
>>> (s.max_ongoing_requests, s.model_deployment_options()["max_ongoing_requests"])
(2, 2)
>>> ServeSettings(max_queued_requests=0)
Traceback (most recent call last):
...
decoding.errors.ConfigError: max_queued_requests: must be >= 1, got 0
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

from decoding.config import DTYPES
from decoding.errors import ConfigError


def _default_autoscaling() -> dict:
    # one replica per CPU worker is the useful unit on CPU; scale out under sustained queueing
    # (a replica batches its requests, so it takes many before another replica helps)
    return {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 24}


@dataclass(frozen=True)
class ServeSettings:
    """Fields
    ------
    registry: the config registry (``redis://...``, ``file://...`` or a directory);
        ``None``: ``SPECRAY_REDIS_URL`` if set, else ``$SPECRAY_HOME/registry``.
    base_model / dtype: the plain-AR model always served (also every entry's
        ``config.model`` is served as plain AR under its own id), and its dtype.
    max_ongoing_requests: requests a model replica takes at once (Serve queues the
        rest); up to ``max_batch_rows`` of them decode together, the others wait
        in the replica's batch queue.
    max_batch_rows: sequences one model's batch decodes together (continuous
        batching: they join and leave between steps).
    max_step_tokens: the most tokens one step feeds the target (rows x tokens per
        row) when k=auto widens the step; ``None``: no cap.
    max_prefill_tokens: prompt tokens of joining requests prefilled per step, in
        whole chunks of 256 (at least one chunk per step), between the decoding
        rows' steps (chunked prefill: a long prompt delays the others by about one
        chunk per step instead of its whole prefill); ``None``: every waiting
        prompt at once.
    adaptive_k: served entries draft k=auto (per step and per request, 0 to the
        entry's k, by expected committed tokens per second from the request's
        acceptance and the measured cost of a forward by rows and tokens), so
        speculation switches itself off under load; ``false`` keeps each entry's k.
    num_replicas: a fixed number of model replicas; ``None`` uses ``autoscaling``.
    autoscaling: Serve's ``autoscaling_config`` for the model deployment.
    model_num_cpus / ingress_num_cpus: Ray CPUs reserved per replica.
    model_num_gpus: Ray GPUs reserved per model replica (a fraction shares one GPU); a replica given a GPU
        decodes on it (configs with ``device=auto``, the default), one given none decodes on the CPU.
    threads: torch intra-op threads per model replica (``None``: as many as the
        replica's ``model_num_cpus``, at least 1).
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
    max_body_bytes: the largest request body accepted; a bigger one is answered 413
        before it is read or parsed.
    api_key_sha256: the SHA-256 (hex) of the API key every ``/v1/*`` request must bring as
        ``Authorization: Bearer <key>`` (else 401); ``None``: no key (unless the ingress's
        environment has ``SPECRAY_API_KEY``). ``specray serve --api-key`` / ``SPECRAY_API_KEY``
        fill it in; the key itself never enters the Serve config.
    auth_health: also require the key on ``/health`` and ``/metrics`` (open by default, for probes
        and scrapers).
    drain_timeout_s: on shutdown, how long replicas wait for in-flight requests to finish.
    place_actor_entries: serve each registry entry whose draft and target run on actors (pearl,
        ``placement=actors``) as Tune measured it: a deployment of its own whose replica reserves a
        placement group for its two workers (``serving.placed_worker``), validated against the cluster at
        deploy time; ``false`` serves them in the model replica with the sequential schedule.
    placed_replica_num_cpus: Ray CPUs of such a replica when it has a bundle of its own (three nodes or more);
        otherwise it rides in its target worker's bundle, as a Tune trial does.
    """

    registry: str | None = None
    base_model: str = "smollm2-135m"
    dtype: str = "bfloat16"
    max_ongoing_requests: int = 64
    max_batch_rows: int = 32
    max_step_tokens: int | None = 512
    max_prefill_tokens: int | None = 256
    adaptive_k: bool = True
    num_replicas: int | None = None
    autoscaling: dict = field(default_factory=_default_autoscaling)
    model_num_cpus: float = 2.0
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
    max_body_bytes: int = 4 * 1024 * 1024
    api_key_sha256: str | None = None
    auth_health: bool = False
    drain_timeout_s: float = 10.0
    place_actor_entries: bool = True
    placed_replica_num_cpus: float = 1.0

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
        for name in (
            "max_ongoing_requests",
            "max_queued_requests",
            "max_loaded_configs",
            "request_log_size",
            "ingress_replicas",
            "max_batch_rows",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ConfigError("num_replicas", f"must be >= 1, got {self.num_replicas}")
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            raise ConfigError("max_step_tokens", f"must be >= 1, got {self.max_step_tokens}")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ConfigError("max_prefill_tokens", f"must be >= 1, got {self.max_prefill_tokens}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError("threads", f"must be >= 1, got {self.threads}")
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes", f"must be >= 1024, got {self.max_body_bytes}")
        if self.api_key_sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.api_key_sha256):
            raise ConfigError("api_key_sha256", "must be 64 lowercase hex digits (sha256 of the key)")
        for name in ("model_num_cpus", "model_num_gpus", "ingress_num_cpus", "registry_refresh_s", "drain_timeout_s"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if self.placed_replica_num_cpus <= 0:
            raise ConfigError("placed_replica_num_cpus", f"must be > 0 (a placement group bundle), got {self.placed_replica_num_cpus}")
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

    @property
    def model_threads(self) -> int:
        """Torch threads of a model replica: ``threads``, else the CPUs it reserves (a replica uses its cores)."""
        return self.threads or max(1, int(self.model_num_cpus))

    # ---- what the deployments get -----------------------------------------
    def model_deployment_options(self) -> dict:
        opts = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": self.model_num_cpus, "num_gpus": self.model_num_gpus},
            # loading a model can take a while on CPU; don't call a slow start a failure
            "health_check_timeout_s": 60,
            "graceful_shutdown_timeout_s": self.drain_timeout_s,
            "graceful_shutdown_wait_loop_s": 0.5,
        }
        if self.num_replicas is not None:
            opts["num_replicas"] = self.num_replicas
        else:
            opts["autoscaling_config"] = dict(self.autoscaling)
        return opts

    def placed_deployment_options(self, plan) -> dict:
        """Options of an actor entry's own deployment (``serving.placed_worker``): one replica and its placement group."""
        return {
            "num_replicas": 1,
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": plan.replica["CPU"]},
            "placement_group_bundles": plan.bundles,
            "placement_group_strategy": plan.strategy,
            "health_check_period_s": 5,
            "health_check_timeout_s": 60,
            "graceful_shutdown_timeout_s": self.drain_timeout_s,
            "graceful_shutdown_wait_loop_s": 0.5,
        }

    def ingress_deployment_options(self) -> dict:
        return {
            "num_replicas": self.ingress_replicas,
            # the ingress must *see* requests beyond the admission limit to answer them 429,
            # and keep room for /health and /metrics
            "max_ongoing_requests": self.max_queued_requests + 32,
            "ray_actor_options": {"num_cpus": self.ingress_num_cpus},
            "graceful_shutdown_timeout_s": self.drain_timeout_s,
            "graceful_shutdown_wait_loop_s": 0.5,
        }


def api_key_digest(key: str) -> str:
    """What ``api_key_sha256`` holds for ``key``.

    >>> api_key_digest("secret")[:16]
    '2bb80d537b1da3e3'
    """
    import hashlib

    return hashlib.sha256(key.encode("utf-8")).hexdigest()
