"""Drive a two-sided schedule (``decoding.schedules.two_sided``) over a target worker and a draft worker.

``ActorExecutor`` turns a schedule's requests into actor calls:

- PEARL (parallel): submit ``target.verify`` and ``draft.draft`` together,
  then wait for both: one driver round trip per round;
- SpS (sequential): submit ``draft.draft``, then ``target.verify`` with the
  draft's ObjectRef as an argument, so Ray hands the drafts from worker to
  worker; the driver waits once.

``transport="compiled"`` runs the same two shapes as Ray compiled graphs
(``experimental_compile``): shared-memory channels set up once, no per-call
task submission.

Every wait has a timeout; a worker that dies or stops answering raises
``WorkerDied`` / ``WorkerTimeout`` naming the worker and the token reached,
never a hang.
"""

from __future__ import annotations

import copy
import time

import ray
import torch
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from decoding.config import SpecConfig
from decoding.decoder import DecoderBase, GenerationLost, context_error, decode, encode
from decoding.errors import ConfigError
from decoding.loop.goodput import RoundGate
from decoding.loop.prefill import ContextTooLong
from decoding.methods import ACTOR_TRANSPORTS, WORKER_ROLES, OnActors, on_actors
from decoding.sampling import SamplingParams
from decoding.schedules.two_sided import DraftRequest, RunRequest, TwoSidedGeneration, VerifyRequest, generate_two_sided, round_summary


class WorkerError(GenerationLost):
    """A model worker failed during a generation."""


class WorkerDied(WorkerError):
    pass


class WorkerTimeout(WorkerError):
    pass


class ActorExecutor:
    """Runs schedule requests on two ``ModelActor`` handles (actors.model_actor) with timeouts and clear failures."""

    def __init__(
        self, target, draft, timeout_s: float = 120.0, transport: str = "calls", parallel: bool = True, actor_ids: dict | None = None
    ):
        if transport not in ACTOR_TRANSPORTS:
            raise ConfigError("actor_transport", f"unknown transport {transport!r}; choose from {', '.join(ACTOR_TRANSPORTS)}")
        self.target, self.draft = target, draft
        self.actor_ids = dict(actor_ids or {})  # role -> the actor's id (hex), as the worker reports it in info()
        self.timeout_s = timeout_s
        self.transport = transport
        self.position = 0  # tokens committed so far, for error messages
        self._dag = self._compile(parallel) if transport == "compiled" else None

    # ---- compiled graphs ------------------------------------------------------------------------
    def _compile(self, parallel: bool):
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as inp:
            if parallel:
                dag = MultiOutputNode([self.target.verify.bind(inp[0]), self.draft.draft.bind(inp[1])])
            else:
                dag = self.target.verify.bind(inp[0], self.draft.draft.bind(inp[1]))
        return dag.experimental_compile()

    def teardown(self) -> None:
        if self._dag is not None:
            try:
                self._dag.teardown()
            except Exception:  # noqa: BLE001 - a dead worker can make teardown raise; nothing left to free
                pass
            self._dag = None

    # ---- waiting with a deadline ----------------------------------------------------------------
    def _role_of(self, err: RayActorError) -> str:
        actor_id = getattr(err, "actor_id", None)
        for role in WORKER_ROLES:
            if actor_id and actor_id == self.actor_ids.get(role):
                return f"{role} worker"
        return "a model worker"

    def wait(self, refs, what: str):
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except (GetTimeoutError, ray.exceptions.RayChannelTimeoutError):
            raise WorkerTimeout(
                f"no answer from the {what} within {self.timeout_s:.0f}s (rpc_timeout_s) after {self.position} generated tokens"
            ) from None
        except RayActorError as e:
            raise WorkerDied(f"the {self._role_of(e)} died during generation after {self.position} generated tokens: {e}") from e
        except ray.exceptions.RayChannelError as e:  # compiled graph whose worker died
            raise WorkerDied(f"a model worker died during generation after {self.position} generated tokens: {e}") from e

    # ---- the executor interface of generate_two_sided ------------------------------------------
    def prefill(self, prompt: list[int], max_len: int, seed: int, sampling=None, threads: int | None = None) -> int:
        """Both workers' prefills at once; ``threads``: the target's on them, the draft model's deferred to its first
        draft (the workers share those cores)."""
        self.position = 0
        target = self.target.prefill.remote(prompt, max_len, seed, sampling, threads)
        refs = [target, self.draft.prefill.remote(prompt, max_len, seed + 1, sampling, defer=threads is not None)]
        first, _ = self.wait(refs, "workers' prefill")[0]
        return first

    def run(self, req: RunRequest):
        """The target worker alone (a plain call, also beside a compiled graph: the driver waits for each in turn)."""
        result = self.wait(self.target.run.remote(req), "target worker")
        self.position += len(result.tokens)
        return result

    def step(self, treq: VerifyRequest, dreq: DraftRequest, parallel: bool):
        if self._dag is not None:
            out = self.wait(self._dag.execute(treq, dreq), "compiled graph")
            result = (out[0], out[1]) if parallel else (out, None)
        elif parallel:
            t, d = self.wait([self.target.verify.remote(treq), self.draft.draft.remote(dreq)], "target and draft workers")
            result = (t, d)
        else:
            ref = self.target.verify.remote(treq, self.draft.draft.remote(dreq))
            result = (self.wait(ref, "draft -> target chain"), None)
        self.position += len(result[0].tokens)
        return result


class TwoSidedSequence:
    """A sequence of the two-worker runtime: what :meth:`ActorDecoder.run` starts it with, and how it ended.

    ``on_step`` as the loop's (a returned finish reason ends it after that round's tokens); :meth:`cancel` ends it at
    its next round."""

    batchable = False

    def __init__(self, prompt_ids, max_new_tokens: int, seed: int, on_step=None, tag=None, adaptive: bool = False):
        self.prompt_ids, self.max_new_tokens, self.seed, self.on_step, self.tag = prompt_ids, max_new_tokens, seed, on_step, tag
        self.adaptive = adaptive  # k=auto: the schedule's RoundGate stops drafting where it does not pay
        self.generation: TwoSidedGeneration | None = None
        self._cancelled: str | None = None
        self.delivered = 0  # tokens handed to on_step: none, and a lost generation can run again unseen

    def step(self, tokens: list[int]) -> str | None:
        self.delivered += len(tokens)
        reason = self.on_step(tokens) if self.on_step else None
        return reason or self._cancelled

    def cancel(self, reason: str = "cancelled") -> None:
        self._cancelled = self._cancelled or reason

    @property
    def finish_reason(self) -> str | None:
        return self.generation.finish_reason if self.generation is not None else self._cancelled

    def result(self) -> TwoSidedGeneration | None:
        return self.generation


# the fields a fork may change: what each generation sends the workers, not what they loaded
FORKABLE = ("temperature", "top_p", "top_k", "seed", "k", "max_new_tokens")


class ActorDecoder(DecoderBase):
    """The two-worker runtime of :class:`decoding.decoder.Decoder`: a placed target worker and draft worker, driven by
    the method's two-sided schedule, one sequence at a time (each worker holds one cache). The target's tokenizer is
    copied here once: text and ids are converted in this process, without a round trip."""

    def __init__(self, cfg: SpecConfig, target, draft, placement: dict | None = None, on_close=None, plan: OnActors | None = None):
        """``plan``: how the method runs on the workers (``decoding.methods.on_actors``), when the caller has asked the
        table already (``cluster.placement.build_actor_decoder``, before placing anything); else asked here."""
        self.cfg = cfg
        self.plan = plan or on_actors(cfg)
        self.schedule = self.plan.schedule_of(cfg)  # the two-sided schedule (decoding.schedules.two_sided); TriForce's levels pick theirs
        self.target, self.draft = target, draft
        self.placement = dict(placement or {})
        self.sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
        self._on_close, self._fork = on_close, False
        self.gate = RoundGate()  # k=auto's: whether drafting pays, learnt over this decoder's generations (forks share it)
        self.runs = True  # k=auto's idle stretches as runs of the target worker alone (False: a round a token; benches)
        infos = {role: self.placement.get(role) or {} for role in WORKER_ROLES}  # the workers' info(), from placement
        actor_ids = {role: info["actor_id"] for role, info in infos.items() if "actor_id" in info}
        self.executor = ActorExecutor(
            target, draft, cfg.rpc_timeout_s, cfg.actor_transport, parallel=(self.schedule == "pearl"), actor_ids=actor_ids
        )
        facts = self.executor.wait(target.model_facts.remote(), "target worker")
        self.eos_token_ids, self.max_context = facts["eos_token_ids"], facts["max_context"]
        self.tokenizer = self.executor.wait(target.__ray_call__.remote(lambda actor: actor.tokenizer), "target worker")
        if cfg.draft_model:
            tv, dv = self.executor.wait([target.vocab.remote(), draft.vocab.remote()], "workers")
            if tv != dv:
                raise ConfigError("draft_model", f"{cfg.draft_model!r} does not share the target's tokenizer")
        self.placement["transport"] = cfg.actor_transport

    def fork(self, **changes) -> ActorDecoder:
        """The same workers with other sampling (or draft length) for one request; it closes nothing."""
        cfg = self.cfg.replace(**changes)
        for name in sorted(set(cfg.to_dict()) - set(FORKABLE)):
            if getattr(cfg, name) != getattr(self.cfg, name):
                raise ConfigError(name, "cannot change in a fork of a decoder on workers; open a new decoder")
        twin = copy.copy(self)
        twin.cfg, twin.sampling, twin._on_close, twin._fork = cfg, SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p), None, True
        return twin

    # ---- text <-> ids, with the target's tokenizer copied here ------------------------------------
    def encode(self, prompt: str | list[dict], chat: bool = False) -> torch.Tensor:
        return encode(self.tokenizer, prompt, chat)

    def decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids)

    # ---- generation --------------------------------------------------------------------------------
    def sequence(self, prompt_ids, max_new_tokens: int | None = None, seed: int | None = None, on_step=None, tag=None):
        """A two-sided sequence, k=auto where :meth:`DecoderBase.adaptive` says (the schedule's round gate)."""
        adaptive = self.adaptive(seed)
        seed = self.cfg.seed if seed is None else seed
        return TwoSidedSequence(prompt_ids, max_new_tokens or self.cfg.max_new_tokens, seed, on_step, tag, adaptive)

    def run_threads(self) -> int | None:
        """Torch threads for the target worker's runs alone, where both workers share one CPU node: its own and the
        resting draft worker's (on this 2-core machine the target decoded 11.5 tokens/s on one thread, 18.4 on two); None
        elsewhere (a GPU, or workers on two nodes)."""
        t, d = (self.placement.get(role) or {} for role in WORKER_ROLES)
        if not self.placement.get("same_node") or t.get("device") != "cpu" or not (t.get("threads") and d.get("threads")):
            return None
        return int(t["threads"]) + int(d["threads"])

    def batches(self, seq) -> bool:
        return False

    def run(self, seq: TwoSidedSequence) -> TwoSidedGeneration:
        try:
            seq.generation = generate_two_sided(
                self.executor,
                seq.prompt_ids,
                schedule=self.schedule,
                k=self.cfg.k,
                sampling=self.sampling,
                max_new_tokens=seq.max_new_tokens,
                eos_token_ids=self.eos_token_ids,
                seed=seq.seed,
                max_context=self.max_context,
                on_step=seq.step,
                ship_kv=self.plan.ship_kv,  # TriForce: the middle level reads the target's exact KV
                adaptive=seq.adaptive,
                gate=self.gate,
                runs=self.runs,
                run_threads=self.run_threads(),
                glance=self.cfg.glance,  # the target's runs alone verify prompt lookup's chains
            )
        except ContextTooLong as e:
            raise context_error(e) from None
        return seq.generation

    def stats(self, out: TwoSidedGeneration) -> dict:
        """The generation's figures, ``placement`` (the workers' nodes and devices), ``rpc`` (driver time vs each
        worker's compute per round), ``pearl`` (PEARL's schedule counts), the workers' peak RSS and, for a hierarchical
        drafter, ``levels``."""
        stats = out.stats.to_dict()
        stats["placement"] = dict(self.placement)
        stats["rpc"] = round_summary(out.rounds)
        if out.schedule_counts.get("pre_verify_rounds") is not None:
            stats["pearl"] = dict(out.schedule_counts, gamma=self.cfg.k)
        stats["rounds_without_drafts"] = out.schedule_counts.get("plain_rounds", 0)
        stats["alone"] = out.schedule_counts.get("alone", {})
        rss = self.executor.wait([self.target.peak_rss_mb.remote(), self.draft.peak_rss_mb.remote()], "workers")
        stats["peak_rss_mb"] = dict(zip(WORKER_ROLES, rss, strict=True))
        if self.plan.level_stats:
            stats["levels"] = self.executor.wait(self.draft.level_stats.remote(), "draft worker")
        return stats

    def worker_states(self, timeout_s: float = 2.0) -> dict[str, str]:
        """Each worker's state by an empty call: "alive" (it answered), "busy" (no answer within ``timeout_s``: it
        computes), "restarting" (Ray is starting it again after a crash: the call fails as unavailable) or "dead" (for
        good: its restarts are spent, or it was killed)."""
        refs = {role: getattr(self, role).ping.remote() for role in WORKER_ROLES}
        states = {}
        for role, ref in refs.items():
            try:
                ray.get(ref, timeout=timeout_s)
                states[role] = "alive"
            except GetTimeoutError:
                states[role] = "busy"
            except ActorUnavailableError:
                states[role] = "restarting"
            except RayActorError:
                states[role] = "dead"
        return states

    def refresh_placement(self) -> None:
        """Where each worker runs now (a restarted worker has a new process, on a new node after a node loss)."""
        infos = self.executor.wait([getattr(self, role).info.remote() for role in WORKER_ROLES], "workers")
        for role, info in zip(WORKER_ROLES, infos, strict=True):
            self.placement[role] = {**(self.placement.get(role) or {}), **info}
        self.placement["same_node"] = infos[0]["node_id"] == infos[1]["node_id"]  # run_threads reads it

    def rpc_probe(self, n: int = 50) -> dict:
        """Round-trip cost without compute: an empty call to one worker, and to both at once (PEARL's shape)."""
        self.executor.wait([self.target.ping.remote(), self.draft.ping.remote()], "workers")  # warm up
        t0 = time.perf_counter()
        for _ in range(n):
            self.executor.wait(self.target.ping.remote(), "target worker")
        one = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        for _ in range(n):
            self.executor.wait([self.target.ping.remote(), self.draft.ping.remote()], "workers")
        both = (time.perf_counter() - t0) / n
        return {"one_call_ms": 1e3 * one, "two_parallel_calls_ms": 1e3 * both}

    def close(self) -> None:
        if self._fork:
            return
        self.executor.teardown()
        for handle in (self.target, self.draft):
            try:
                ray.kill(handle)
            except Exception:  # noqa: BLE001 - already dead
                pass
        if self._on_close:
            self._on_close()
            self._on_close = None
