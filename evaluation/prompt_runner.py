"""Run one prompt through several specray configurations back to back and build benchmark rows.

This is the specray half of ``specray bench`` (``evaluation.bench_run`` adds the
Hugging Face peer on top) and the measurement inside a Tune trial
(``tuning/trainable.py``): one decoder per named configuration
(``cluster.decoders.open_decoder``), those in process sharing one loaded model
(``decoding.model.loading`` caches per process), the baseline ``ar`` among them. The configurations run in an order
rotated per prompt (:func:`evaluation.bench_figures.method_order`) so no one of them
always runs first, and every greedy output is compared with the baseline's on
the same prompt (:func:`evaluation.bench_figures.compare_to_reference`).

Names are free-form labels (the bench uses method names; a trial uses
``ar`` and ``candidate``); the rows' ``method`` column carries the name.

>>> # runner = PromptRunner({"ar": SpecConfig(), "candidate": SpecConfig(method="ngram", k=6)})
>>> # runner.warmup(prompts[0])
>>> # gens, steps = runner.run_prompt(prompts[0], index=0)   # rows for evaluation.bench_figures.summarize_methods
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

from decoding.config import SpecConfig
from decoding.methods import method_of
from evaluation import bench_figures as bm
from evaluation.workloads import Prompt


class PromptRunner:
    """One decoder per named config (sharing one loaded model); runs a prompt through all of them."""

    def __init__(self, configs: Mapping[str, SpecConfig], worker: str = "local", baseline: str = bm.BASELINE):
        """Each config gets the decoder ``cluster.decoders.open_decoder`` opens for it (``pearl`` and
        ``placement=actors`` on two model workers); the baseline runs in process (its model also scores divergences)."""
        from cluster.decoders import open_decoder  # heavy imports after the cheap checks

        if baseline not in configs:
            raise ValueError(f"the configs must include the baseline {baseline!r}, got {sorted(configs)}")
        self.worker, self.baseline = worker, baseline
        self.decoders = {}
        try:
            for name, cfg in configs.items():
                self.decoders[name] = open_decoder(cfg, in_process=name == baseline)
        except BaseException:
            self.close()
            raise
        self.ar = self.decoders[baseline]
        self.cfg = self.ar.cfg  # max_new_tokens, temperature and dtype of the comparison
        self.configs = {name: d.cfg.to_json() for name, d in self.decoders.items()}
        self.chat = bool(getattr(self.ar.tokenizer, "chat_template", None))
        self.extras: dict[str, dict] = {}  # name -> peak_rss_mb and levels of its latest generation
        self.answers: dict[tuple, list[int]] = {}  # prompt ids -> the baseline's answer (for later turns' conversations)

    def close(self) -> None:
        """Release decoders that hold resources (actor workers); in-process decoders have nothing to release."""
        for dec in self.decoders.values():
            close = getattr(dec, "close", None)
            if close is not None:
                close()

    @property
    def names(self) -> list[str]:
        return list(self.decoders)

    def encode(self, prompt: Prompt):
        """Ids of the prompt; a later turn's conversation holds the baseline's greedy answers to the earlier turns
        (reused from its timed generation when that ran here, else generated now, untimed)."""
        if prompt.turn == 1:
            return self.ar.encode(prompt.prompt, chat=self.chat)
        answers = []
        for t in range(1, prompt.turn):
            turn = Prompt(prompt.question_id, prompt.category, prompt.turns, t)
            ids = self.encode(turn) if t == 1 else self._conversation(turn, answers)
            key = tuple(ids[0].tolist())
            if key not in self.answers:
                self.answers[key] = self.ar.generate_ids(ids, self.cfg.max_new_tokens).token_ids
            answers.append(self.ar.decode(self.answers[key]))
        return self._conversation(prompt, answers)

    def _conversation(self, prompt: Prompt, answers: list[str]):
        messages = prompt.messages(answers)
        if self.chat:
            return self.ar.encode(messages)
        return self.ar.encode("\n\n".join(m["content"] for m in messages))  # no chat template: the turns as plain text

    def warmup(self, prompt: Prompt, n: int = 1) -> None:
        """Untimed generations of every config, as long as a timed one: first-call costs stay out of the figures, the
        one-off ones a decoder pays within its first request too (SWIFT's layer search starts once 33 tokens are
        generated and tries one layer set a step; an 8-token warm-up left it to the first timed prompt, and put swift
        at 0.81x AR in writing)."""
        ids = self.encode(prompt)
        for _ in range(n):
            for dec in self.decoders.values():
                dec.generate_ids(ids, self.cfg.max_new_tokens)
        self.forget_text()  # the warm-up prompt is measured next: no drafter may copy its answer from the warm-up

    def forget_text(self) -> None:
        """Every in-process decoder forgets the text it generated so far (``SpecDecoder.forget_text``): a prompt run again
        (the warm-up's, a repeat of the set) must not be drafted from its own earlier answer. Before 2026-11-29 suffix
        decoding's cache copied them: 1.12x AR in the first repeat of the README's run, 1.72x in the second. Decoders on
        model workers (``placement=actors``) keep theirs."""
        for dec in self.decoders.values():
            forget = getattr(dec, "forget_text", None)
            if forget is not None:
                forget()

    def generate(self, name: str, ids) -> tuple[str, list[int], object]:
        """One timed generation: ("specray", new tokens, the ``Generation``); its peak RSS and levels go to ``extras``."""
        dec = self.decoders[name]
        bm.reset_peak_rss()
        g = dec.generate_ids(ids, self.cfg.max_new_tokens)
        if name == self.baseline:  # a later turn of this prompt reuses the answer (same config and seed as encode's)
            self.answers[tuple(ids[0].tolist())] = list(g.token_ids)
        self.extras[name] = {"peak_rss_mb": bm.peak_rss_mb(), "levels": json.dumps(levels(dec, ids.shape[1] + self.cfg.max_new_tokens))}
        return ("specray", g.token_ids, g)

    def rows(
        self,
        prompt: Prompt,
        ids,
        results: Mapping[str, tuple],
        names: Sequence[str],
        repeat: int = 0,
        describe_peer: Callable[[str], str] | None = None,
    ) -> tuple[list[dict], list[dict]]:
        """Generation and step rows from ``results`` (name -> (kind, tokens, Generation or peer wall seconds)).

        Greedy outputs are compared with the baseline's; AR's logit margins are
        computed (one forward) only when some output diverged.
        """
        ref = results[self.baseline][1]
        greedy = self.cfg.temperature == 0
        margins = None
        gens, steps = [], []
        for name in names:
            kind, tokens, res = results[name]
            fid = {}
            lossy = kind == "specray" and method_of(self.decoders[name].cfg.method).lossy
            if greedy and name != self.baseline:
                if margins is None and bm.first_divergence(tokens, ref) is not None:
                    margins = bm.reference_margins(self.ar.target, ids, ref)
                fid = bm.compare_to_reference(tokens, ref, margins or [], self.cfg.dtype, lossy=lossy)
            if lossy:  # EAD: labelled, and how much of the output the large model wrote
                fid.update(lossy=True, large_share=bm.large_share(len(tokens), res.steps))
            common = dict(repeat=repeat, worker=self.worker, new_tokens=len(tokens), **fid)
            if kind == "specray":
                s = res.stats
                gens.append(
                    bm.gen_row(
                        name,
                        prompt.prompt_id,
                        prompt.category,
                        kind="specray",
                        wall_s=s.wall_s,
                        prefill_s=s.prefill_s,
                        draft_s=s.draft_s,
                        verify_s=s.verify_s,
                        target_forwards=s.target_forwards,
                        steps=len(res.steps),
                        finish_reason=res.finish_reason,
                        config=self.configs[name],
                        **self.extras.get(name, {}),
                        **common,
                    )
                )
                steps += bm.step_rows(name, prompt.prompt_id, prompt.category, res.steps, repeat, self.worker, self.configs[name])
            else:
                config = describe_peer(name) if describe_peer else ""
                gens.append(bm.gen_row(name, prompt.prompt_id, prompt.category, kind="peer", wall_s=res, config=config, **common))
        return gens, steps

    def run_all(self, prompts: Sequence[Prompt], warmup: int = 1) -> tuple[list[dict], list[dict]]:
        """Every config on every prompt (after ``warmup`` untimed generations), progress to stderr; the generation
        rows and step rows of them all."""
        import sys

        self.warmup(prompts[0], warmup)
        gens, steps = [], []
        for i, prompt in enumerate(prompts):
            g, s = self.run_prompt(prompt, i)
            gens += g
            steps += s
            print(f"prompt {i + 1}/{len(prompts)} done", file=sys.stderr)
        return gens, steps

    def run_prompt(self, prompt: Prompt, index: int, repeat: int = 0) -> tuple[list[dict], list[dict]]:
        """Every config on one prompt, in the order rotated by ``index``; rows in config order."""
        ids = self.encode(prompt)
        results = {name: self.generate(name, ids) for name in bm.method_order(self.names, index)}
        return self.rows(prompt, ids, results, self.names, repeat)


def levels(decoder, length: int) -> dict:
    """KV bytes per level of a decoder's latest generation (``length`` tokens in the target's full cache) and, for a
    hierarchical drafter (TriForce), its middle level's steps: bottom drafts proposed and accepted by the middle."""
    target = getattr(decoder, "target", None)
    if not hasattr(target, "num_layers"):  # the model lives in a worker (actors): nothing to read here
        return {}
    out = {"kv_bytes": {"top": bm.kv_bytes_per_token(target) * (length + decoder.cfg.k + 1)}}
    if hasattr(decoder.drafter, "level_stats"):
        inner = decoder.drafter.level_stats()
        out["kv_bytes"].update(inner.pop("kv_bytes"))
        out.update(inner)
    return out
