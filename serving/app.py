"""The Ray Serve application: the OpenAI ingress (``serving.ingress``) composed with the model deployment.

    from serving.app import build_app, start
    from serving.settings import ServeSettings
    start(ServeSettings(registry="/path/to/registry"), port=8000)     # on a connected Ray; or serve.run(build_app(...))

``build_app`` is the ``.bind()`` graph: ``OpenAIIngress(ModelServer, placed)``, where ``ModelServer`` is the model
replica (:class:`serving.worker.ModelWorker`: one batching engine per model) and ``placed`` one deployment per
registry entry that runs on two workers (:class:`serving.placed_worker.PlacedWorker`, each reserving its placement
group). ``app_builder`` is the import path of a Serve config file (``infra/serve.yaml``).
"""

from ray import serve
from ray.serve import Application

from cluster.runtime import keep_replica_grpc_on_loopback
from serving.catalog import Catalog, ModelNotFound
from serving.ingress import OpenAIIngress
from serving.placed_worker import PlacedWorker, deployment_name, placed_entries
from serving.settings import ServeSettings
from serving.worker import ModelWorker

INGRESS_NAME = "OpenAIIngress"
MODEL_NAME = "ModelServer"


class LoopbackModelWorker(ModelWorker):
    """The model replica: ``ModelWorker``, its inter-deployment gRPC server kept on loopback under the embedded Ray."""

    def __init__(self, *args, **kwargs):
        keep_replica_grpc_on_loopback()
        super().__init__(*args, **kwargs)


class LoopbackPlacedWorker(PlacedWorker):
    """An actor entry's replica (``serving.placed_worker``), its gRPC server kept on loopback under the embedded Ray."""

    def __init__(self, *args, **kwargs):
        keep_replica_grpc_on_loopback()
        super().__init__(*args, **kwargs)


ModelServer = serve.deployment(LoopbackModelWorker, name=MODEL_NAME)
PlacedServer = serve.deployment(LoopbackPlacedWorker)
Ingress = serve.deployment(OpenAIIngress, name=INGRESS_NAME)


def placed_deployments(settings: ServeSettings) -> dict:
    """One deployment per registry entry that runs on actors, each reserving its placement group; validated against the
    cluster now (``serving.placed_worker.placed_entries`` raises a ConfigError naming the entry, what it wants and what there is)."""
    if not settings.place_actor_entries:
        return {}
    catalog = Catalog(settings.registry, settings.base_model, settings.dtype, watch=False)
    try:
        entries = placed_entries(catalog, settings.placed_replica_num_cpus)
    finally:
        catalog.close()
    out = {}
    for served, plan in entries:
        app = PlacedServer.options(name=deployment_name(served.name), **settings.placed_deployment_options(plan))
        out[served.name] = {"config": served.config.to_json(), "handle": app.bind(served.name, served.config.to_dict(), plan.to_dict())}
    return out


def build_app(settings: ServeSettings | dict | None = None) -> Application:
    """The ``.bind()`` graph: ``OpenAIIngress(ModelServer)`` configured from ``settings``."""
    if not isinstance(settings, ServeSettings):
        settings = ServeSettings.from_dict(settings or {})
    preload = []
    if settings.preload:
        catalog = Catalog(settings.registry, settings.base_model, settings.dtype, watch=False)
        try:
            preload = [catalog.resolve(name).config.to_dict() for name in settings.preload]
        except ModelNotFound as e:
            from decoding.errors import ConfigError

            raise ConfigError("preload", str(e)) from None
        finally:
            catalog.close()
    model = ModelServer.options(**settings.model_deployment_options()).bind(
        max_ongoing_requests=settings.max_ongoing_requests,
        max_loaded_configs=settings.max_loaded_configs,
        threads=settings.model_threads,
        preload=preload,
        request_log_size=settings.request_log_size,
        max_batch_rows=settings.max_batch_rows,
        max_step_tokens=settings.max_step_tokens,
        max_prefill_tokens=settings.max_prefill_tokens,
        adaptive_k=settings.adaptive_k,
    )
    placed = placed_deployments(settings)
    return Ingress.options(**settings.ingress_deployment_options()).bind(model, settings.to_dict(), placed)


def app_builder(args: dict) -> Application:
    """For ``serve run`` / a Serve config file: ``import_path: serving.app:app_builder`` with ``args`` = ServeSettings fields."""
    return build_app(ServeSettings.from_dict(args))


def start(settings: ServeSettings, host: str = "127.0.0.1", port: int = 8000, name: str = "specray", proxy_location=None) -> str:
    """On the connected Ray: Serve's proxy on ``host:port`` and the app as ``name`` at ``/``; returns the base URL."""
    options = {"http_options": {"host": host, "port": port}}
    if proxy_location:
        options["proxy_location"] = proxy_location
    serve.start(**options)
    serve.run(build_app(settings), name=name, route_prefix="/")
    return f"http://{host}:{port}"
