"""Hugging Face ``generate()`` as the peer of ``specray bench``: plain, prompt lookup, a shallow assistant made of
the target's first layers, early exit; each assisted mode at specray's knobs and at HF's own documented defaults; and
transformers' fast mode, a static KV cache (``cache_implementation="static"``), alone and under prompt lookup.

On a CUDA device transformers compiles the forward over a static cache (``torch.compile``, mode "reduce-overhead":
CUDA graphs) by itself; elsewhere it runs the static cache eagerly. The compiled graphs are shaped by the cache's
length, so the peer sizes it in buckets (:func:`static_bucket`) and pays each bucket's compilation in an untimed
call before the first timed one that needs it.

>>> static_bucket(90), static_bucket(256), static_bucket(700)
(256, 256, 1024)
"""

from __future__ import annotations

import copy
import json
import time

from decoding.config import SpecConfig

PEER_MODES = (
    "hf-plain",
    "hf-prompt-lookup",
    "hf-prompt-lookup-default",
    "hf-assistant",
    "hf-assistant-default",
    "hf-early-exit",
    "hf-early-exit-default",
    "hf-static",
    "hf-static-prompt-lookup",
)
STATIC_MODES = ("hf-static", "hf-static-prompt-lookup")  # a static KV cache: compiled (CUDA graphs) on a CUDA device
STATIC_SLACK = 16  # static cache positions kept free past a generation's last token (room for a verified draft)
# Hugging Face's own settings for its assisted modes (the prompt-lookup guide's prompt_lookup_num_tokens=10, the
# generation config's num_assistant_tokens=20, constant schedule, assistant_confidence_threshold=0.4)
HF_PROMPT_LOOKUP_DEFAULT = {"prompt_lookup_num_tokens": 10}
HF_ASSIST_DEFAULT = {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.4}


class HFPeer:
    """Hugging Face ``generate()`` on the very model object specray uses, in its plain and assisted modes.

    Each assisted mode runs twice: with specray's knobs (draft length k, n-gram
    size, draft layers, exit layer; constant draft length, no confidence stop),
    so the two sides draft the same way, and as ``*-default`` with HF's own
    documented settings (``HF_PROMPT_LOOKUP_DEFAULT``, ``HF_ASSIST_DEFAULT``; the
    assistant and exit layer stay specray's, HF has no default for them). Every
    "over HF" figure divides by the best of these modes.
    """

    def __init__(self, decoder, cfg: SpecConfig, modes: list[str] | None = None):
        """``modes``: the subset of ``PEER_MODES`` to run (default all this model supports)."""
        self.model = decoder.loaded.model
        self.cfg = cfg
        self.eos = decoder.loaded.eos_token_ids
        depth = len(decoder.target.layers)
        assist = {"num_assistant_tokens": cfg.k, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
        self.modes = {
            "hf-plain": {},
            "hf-prompt-lookup": {"prompt_lookup_num_tokens": cfg.k, "max_matching_ngram_size": cfg.ngram_max},
            "hf-prompt-lookup-default": dict(HF_PROMPT_LOOKUP_DEFAULT),
            "hf-static": {"cache_implementation": "static"},
            "hf-static-prompt-lookup": {
                "cache_implementation": "static",
                "prompt_lookup_num_tokens": cfg.k,
                "max_matching_ngram_size": cfg.ngram_max,
            },
        }
        self.static_len: dict[str, int] = {}  # mode -> the static cache length warmed so far (grown by buckets)
        self.assistants = {}
        if cfg.draft_layers < depth:
            for mode, knobs in (("hf-assistant", assist), ("hf-assistant-default", HF_ASSIST_DEFAULT)):
                self.assistants[mode] = shallow_assistant(self.model, cfg.draft_layers)
                self.assistants[mode].generation_config.update(**knobs)
                self.modes[mode] = {"assistant_model": self.assistants[mode]}
        if cfg.exit_layer < depth:
            self.modes["hf-early-exit"] = {"assistant_early_exit": cfg.exit_layer, "_assist": assist}
            self.modes["hf-early-exit-default"] = {"assistant_early_exit": cfg.exit_layer, "_assist": dict(HF_ASSIST_DEFAULT)}
        if modes is not None:
            self.modes = {m: v for m, v in self.modes.items() if m in modes}
            self.assistants = {m: a for m, a in self.assistants.items() if m in modes}

    @property
    def assistant(self):  # the assistant at specray's knobs
        return self.assistants.get("hf-assistant")

    def describe(self, mode: str) -> str:
        kw = {k: v for k, v in self.modes[mode].items() if k != "assistant_model"}
        if mode in STATIC_MODES:
            kw["_compiled"] = self.model.device.type == "cuda"  # transformers compiles a static cache's forward on CUDA
        if mode in self.assistants:
            kw["assistant_model"] = f"first {self.cfg.draft_layers} layers of the target"
            kw["_assist"] = {k: getattr(self.assistants[mode].generation_config, k) for k in HF_ASSIST_DEFAULT}
        return json.dumps(kw, sort_keys=True, default=str)

    def probe(self, ids, max_new_tokens: int) -> dict:
        skipped = {}
        for mode in list(self.modes):
            try:
                self.generate(mode, ids, max_new_tokens)
            except Exception as e:  # an assisted mode this model or transformers version does not support
                skipped[mode] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                del self.modes[mode]
        return skipped

    def generate(self, mode: str, ids, max_new_tokens: int) -> tuple[list[int], float]:
        import torch

        kw = dict(self.modes[mode])
        assist = kw.pop("_assist", None)
        sampling = (
            {"do_sample": True, "temperature": self.cfg.temperature, "top_p": self.cfg.top_p, "top_k": self.cfg.top_k or None}
            if self.cfg.temperature > 0
            else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        )
        gen_cfg = self.model.generation_config
        saved = {k: getattr(gen_cfg, k, None) for k in (assist or {})}
        if assist:  # early exit drafts with the model itself, so the knobs live on its own generation config
            gen_cfg.update(**assist)
        ids = ids.to(self.model.device)  # the model's device (SpecConfig.device); prompts are encoded on the CPU
        if mode in STATIC_MODES:
            self._warm_static(mode, ids, max_new_tokens)
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    eos_token_id=self.eos,
                    pad_token_id=self.eos[0] if self.eos else None,
                    **sampling,
                    **kw,
                )
                tokens = out[0, ids.shape[1] :].tolist()  # reading the tokens waits for a GPU, so the time is the generation's
            wall = time.perf_counter() - t0
        finally:
            for k, v in saved.items():
                setattr(gen_cfg, k, v)
        return tokens, wall

    def _warm_static(self, mode: str, ids, max_new_tokens: int) -> None:
        """Before a static-cache generation that needs a longer cache than this mode has run with: untimed
        generations that make transformers' static cache the bucket's length (it keeps the longest it has made and
        sizes later ones to it) and compile the mode's forward there (on CUDA), so the timed call reuses its graphs.
        The bucket leaves ``STATIC_SLACK`` positions past the generation: transformers sizes a static cache to the
        generation's last position, and its assisted decoding verifies drafts past it (transformers 5.24 writes one
        key past the cache and fails)."""
        need = ids.shape[1] + max_new_tokens + STATIC_SLACK
        context = getattr(self.model.config, "max_position_embeddings", None) or need
        bucket = max(ids.shape[1] + max_new_tokens, min(static_bucket(need), context))
        if bucket <= self.static_len.get(mode, 0):
            return
        self._untimed(ids, bucket - max_new_tokens, max_new_tokens, cache_implementation="static")  # the cache's size
        if set(self.modes[mode]) != {"cache_implementation"}:  # an assisted mode: its own shapes compile too
            self._untimed(ids, max(1, bucket - max_new_tokens - STATIC_SLACK), max_new_tokens, **self.modes[mode])
        self.static_len[mode] = bucket

    def _untimed(self, ids, length: int, max_new_tokens: int, **kw) -> None:
        """A greedy generation of exactly ``max_new_tokens`` from ``length`` copies of the prompt's first token."""
        import torch

        filler = ids[:, :1].expand(1, length).contiguous()  # [1, length]
        with torch.inference_mode():
            self.model.generate(
                input_ids=filler,
                attention_mask=torch.ones_like(filler),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=self.eos[0] if self.eos else None,
                **kw,
            )


def static_bucket(tokens: int) -> int:
    """The static cache length a generation of ``tokens`` (prompt + new) runs with: a power of two, at least 256."""
    return max(256, 1 << (int(tokens) - 1).bit_length())


def shallow_assistant(model, num_layers: int):
    """A causal LM made of the target's first ``num_layers`` layers, final norm and head; weights are shared, not copied."""
    import torch

    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:num_layers]
    with torch.device("meta"):
        asst = type(model)(cfg)
    base, src = asst.model, model.model
    base.embed_tokens, base.norm, base.rotary_emb = src.embed_tokens, src.norm, src.rotary_emb
    base.layers = torch.nn.ModuleList(list(src.layers[:num_layers]))
    asst.lm_head = model.lm_head
    asst.generation_config = copy.deepcopy(model.generation_config)
    asst.eval()
    left = [n for n, t in list(asst.named_parameters()) + list(asst.named_buffers()) if t.is_meta]
    if left:
        raise TypeError(f"cannot build a shallow assistant for {type(model).__name__}: unshared tensors {left[:3]}")
    return asst


def padded_batch_tokens_per_s(dec, batch: list, max_new_tokens: int) -> float:
    """transformers ``generate()`` on the prompts (each ids [1, T]) left-padded into one batch, greedy, on the decoder's
    own model object: tokens up to each row's EOS per wall second (the peer of specray's batched AR)."""
    import torch

    model, tok = dec.loaded.model, dec.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else dec.loaded.eos_token_ids[0]
    width = max(ids.shape[1] for ids in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, ids in enumerate(batch):
        input_ids[i, width - ids.shape[1] :] = ids[0]
        mask[i, width - ids.shape[1] :] = 1
    eos = list(dec.loaded.eos_token_ids)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad
        )
    wall = time.perf_counter() - t0
    new = out[:, width:].tolist()
    tokens = sum(next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) for row in new)
    return tokens / wall
