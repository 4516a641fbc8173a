"""Open the decoder of a configuration: the one place that chooses the runtime.

The method table says whether a configuration runs on a target and a draft worker
(``decoding.methods.runs_on_actors``: ``pearl`` always, ``placement=actors`` for the methods that can); such a
configuration gets an ``actors.driver.ActorDecoder`` over two workers placed on the Ray cluster
(``cluster.placement``), any other an in-process ``decoding.in_process.SpecDecoder``. Both implement
``decoding.decoder.Decoder``: generate, bench, Tune trials and Serve replicas use what they get.

Where the workers go: into ``placement_group`` when one is given, else into the placement group this process runs
in (a Tune trial's: the trial holds bundle 0 and the target shares it; a Serve replica's: ``layout`` says which
bundle each worker takes), else into a new group sized to the cluster. ``in_process`` hosts the models here whatever
the table says (a model replica: PEARL then takes turns, the same tokens without the overlap).

>>> # with open_decoder(SpecConfig(method="pearl")) as dec:     # two workers on the Ray cluster
>>> #     dec.generate_text("hi")["stats"]["placement"]["mode"]  # 'actors'; 'local' for an in-process method
"""

from __future__ import annotations

from actors.devices import placed
from decoding.config import SpecConfig
from decoding.decoder import Decoder
from decoding.methods import runs_on_actors


def open_decoder(
    cfg: SpecConfig,
    *,
    address: str | None = None,
    placement_group=None,
    layout: dict | None = None,
    in_process: bool = False,
) -> Decoder:
    """The decoder ``cfg`` runs on (see the module docstring); ``address``: the Ray cluster to join for workers
    (default ``RAY_ADDRESS``, else an embedded local Ray)."""
    if in_process or not runs_on_actors(cfg.method, cfg.placement):
        from decoding.in_process import SpecDecoder

        return SpecDecoder(placed(cfg))  # device=auto inside a Ray worker: the GPU Ray gave it, else CPU
    from cluster.placement import build_actor_decoder

    group, holds_first = placement_group, False
    if group is None:
        group = current_placement_group()
        holds_first = group is not None and layout is None  # a Tune trial runs in its group's first bundle
    return build_actor_decoder(
        cfg.replace(placement="actors"), address=address, placement_group=group, caller_holds_first=holds_first, layout=layout
    )


def current_placement_group():
    """The placement group this process runs in (a Tune trial's, a Serve replica's), or None."""
    import sys

    if "ray" not in sys.modules:  # a Ray worker has Ray imported: this process is not one
        return None
    import ray
    from ray.util import get_current_placement_group

    return get_current_placement_group() if ray.is_initialized() else None
