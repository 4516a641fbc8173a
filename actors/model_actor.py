"""A Ray actor hosting one model (draft or target) with its KV cache: a thin RPC face over ``decoding.schedules.two_sided``'s sides.

The worker loads its model on the device it was placed on (``cuda`` when Ray
gave it a GPU, else CPU with its own ``torch.set_num_threads``) and forwards
each call to a ``VerifySide`` or ``DraftSide``; all decoding logic stays in
``decoding/``.

What crosses the wire, per round:

- greedy: token ids only. The draft returns its drafted ids; the target gets
  ``[pending, drafts]`` and returns the accepted count and the committed ids.
- sampling: the target must see q(.) where a draft may be rejected, because the
  residual max(0, p - q) needs the whole row. We send the draft's q rows for
  the drafted positions only (k rows of V float32, draft -> target; in two-actor
  SpS they go straight from the draft actor to the target actor as a chained
  ObjectRef, not through the driver), and the target's p never leaves the
  target, except in PEARL when every draft of a round was accepted: then the
  one row p after the last draft comes back to check the first token the
  draft made meanwhile. The alternative, sending only q(x_i) scalars and
  fetching a q row after a rejection, costs a second round trip on every
  rejection, which with a shallow draft is most rounds.
"""

from __future__ import annotations

import os
import time

import ray

import kernels
from actors.devices import placed_device
from decoding.drafters.artifacts import draft_adapter, is_artifact
from decoding.in_process import build_drafter
from decoding.loop.metrics import peak_rss_mb, reset_peak_rss
from decoding.methods import METHOD_TABLE, TARGET_WITH_DRAFTER, WORKER_ROLES
from decoding.model.adapter import ModelAdapter
from decoding.model.costs import forward_costs
from decoding.model.loading import load_model, resolve_device, set_threads
from decoding.sampling import SamplingParams
from decoding.schedules.two_sided import (
    RUN_WIDTHS,
    DraftRequest,
    DraftResult,
    DraftSide,
    RunRequest,
    RunResult,
    VerifyRequest,
    VerifyResult,
    VerifySide,
)

# a worker whose process dies is started again by Ray in the same placement-group bundle, loading its model again
# (its handle and actor id stay): a Serve replica keeps serving on it instead of being replaced with new workers
# (serving.placed_worker). Calls in flight at the death fail (ActorUnavailableError: the generation is lost); calls are
# never retried. Once the restarts are spent, the next death is final (ActorDiedError).
WORKER_RESTARTS = 3


@ray.remote(max_restarts=WORKER_RESTARTS, max_task_retries=0)
class ModelActor:
    """One model and its cache. ``role``: "target" (full model) or "draft" (``draft_model`` or the first ``draft_layers``;
    for ``triforce`` the target model again, hosting the middle level over its own cache, and the bottom drafter).
    Restarted after a crash (``WORKER_RESTARTS``) with the same arguments: every generation starts with a prefill, so a
    restarted worker needs nothing else."""

    def __init__(self, role: str, cfg_json: str, threads: int | None = None):
        from decoding.config import SpecConfig

        if role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {WORKER_ROLES}, got {role!r}")
        cfg = SpecConfig.from_json(cfg_json)
        self.role = role
        self.threads = set_threads(threads)
        kernels.install()
        self.device = str(resolve_device(placed_device(cfg.device)))  # auto: the GPU Ray gave this worker, else CPU
        t0 = time.perf_counter()
        # the draft worker's model: TriForce's middle level is the target itself (its bottom drafter comes with it),
        # else the separate draft model or the target's first draft_layers layers
        plan = METHOD_TABLE[cfg.method].actors
        with_drafter = plan is not None and plan.draft_worker == TARGET_WITH_DRAFTER
        draft = role == "draft" and not with_drafter
        # a separate model directory is loaded on its own; a distilled-draft artifact (shipped, or named) and the
        # target's first layers are built over the target (decoding.drafters.artifacts.draft_adapter)
        own_model = draft and cfg.draft_model not in (None, "layers") and not is_artifact(cfg.draft_model)
        loaded = load_model(cfg.draft_model if own_model else cfg.model, cfg.dtype, self.device, cfg.quant)
        self.tokenizer = loaded.tokenizer
        self.eos = loaded.eos_token_ids
        if draft and not own_model:
            self.adapter = draft_adapter(cfg, loaded, self.device)
        else:
            self.adapter = ModelAdapter(loaded.model, compile=cfg.compile)
        sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
        if role == "target":  # its runs alone verify prompt lookup's chains by the measured cost of a width
            runs_cost = lambda: forward_costs(self.adapter, cfg.model, cfg.dtype, widths=RUN_WIDTHS, tree_widths=())  # noqa: E731
            self.side = VerifySide(self.adapter, sampling, cost=runs_cost)
        elif with_drafter:
            self.side = DraftSide(build_drafter(cfg, loaded, self.device), sampling, target=self.adapter)
        else:
            self.side = DraftSide.of_model(self.adapter, sampling, cfg.confidence_threshold)
        self.load_s = time.perf_counter() - t0
        self._vocab = self.tokenizer.get_vocab() if own_model else None

    # ---- facts for the driver and the stats --------------------------------------------------
    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {
            "role": self.role,
            "actor_id": ctx.get_actor_id(),
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "device": self.device,
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "threads": self.threads,
            "layers": self.adapter.num_layers,
            "load_s": round(self.load_s, 3),
        }

    def model_facts(self) -> dict:
        return {"eos_token_ids": self.eos, "max_context": self.adapter.max_context}

    def vocab(self) -> dict | None:
        return self._vocab if self._vocab is not None else self.tokenizer.get_vocab()

    def ping(self, payload=None):
        """An empty round trip (or an echo of ``payload``) to measure the RPC cost."""
        return payload

    # ---- the decoding operations --------------------------------------------------------------
    def prefill(self, prompt: list[int], max_len: int, seed: int = 0, sampling: SamplingParams | None = None, threads=None, defer=False):
        """Start a generation: fill the cache, seed this worker's generator, take the generation's sampling params.
        ``threads`` (target): its prefill's torch threads; ``defer`` (draft): its prefill waits for its first draft."""
        reset_peak_rss()  # peak_rss_mb then reports this generation's peak
        if self.role == "target":
            return self.side.prefill(prompt, max_len, seed, sampling, threads)
        return self.side.prefill(prompt, max_len, seed, sampling, defer)

    def verify(self, req: VerifyRequest, chained: DraftResult | None = None) -> VerifyResult:
        return self.side.verify(req, chained)

    def run(self, req: RunRequest) -> RunResult:
        """The target decoding alone for a while (the draft worker rests: k=auto found its drafts do not pay)."""
        return self.side.run(req)

    def draft(self, req: DraftRequest) -> DraftResult:
        return self.side.draft(req)

    def peak_rss_mb(self) -> float | None:
        """This worker's peak resident memory since the latest prefill (MiB; None off Linux)."""
        return peak_rss_mb()

    def level_stats(self) -> dict:
        """TriForce's lower levels in the latest generation (draft worker); {} otherwise."""
        return self.side.level_stats() if self.role == "draft" else {}
