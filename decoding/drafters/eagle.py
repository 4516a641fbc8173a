"""A feature-level drafter in the manner of EAGLE-2/3: the target's own hidden states in, one decoder layer, a
trimmed vocabulary out.

Inputs (positions p of the committed text, the loop's convention: the pending token is x_{n-1} and the target's
hidden states exist for p <= n-2):

* ``g_p = fc_features([norm(h^a_p); norm(h^b_p); norm(h^c_p)])``: the target's hidden states after a low, a middle
  and its last layer (EAGLE-3 fuses several depths; ``norm`` is a parameter-free RMS normalisation, so the fused
  depths start on one scale), from ``DecodeState.target_features``;
* ``z_p = fc_in([e(x_{p+1}); g_p])``: with the embedding of the next token (EAGLE's token shift);
* one decoder layer over ``z`` with its own KV cache gives ``o_p``; the target's final norm and a head over the
  ``M`` most frequent tokens of the training data (VocabTrim) give the draft distribution of x_{p+2}.

Drafting feeds the drafter its own output: the first draft comes from ``o_{n-2}`` (true features of the committed
text); the next from ``z = fc_in([e(d_1); o_{n-2}])`` at slot n-1, and so on. The training (``training.objectives``,
recipe ``eagle``) unrolls exactly this: at step j the input feature at p is the step-(j-1) output at p-1 and the
query attends to the true-feature keys of positions <= p-j and to its own chain (EAGLE-3's training-time test).
After each verdict the drafted nodes' keys are dropped and the accepted positions are fed again with the target's
true features, so the cache only ever holds true-feature keys of committed text.

Trees: ``Dynamic`` shapes grow best-first by path probability (DySpec, as EAGLE-2's dynamic trees do by
reranking); every prefix of that order is a tree, and with a ``chooser`` (the host's measured verification-cost
curve, ``decoding.trees.hardware``) the verified prefix is the one with the most expected tokens per second of
verification, taking the draft's path probability as its acceptance estimate.

Context: the head attends over at most ``context`` positions of true features when it catches up (the training
window of the artifact's run, 384 for the shipped head: training shows it no more). Where more are unfed (a long
prompt, a long run of plain steps) its cache starts afresh at the last ``context`` of them, slot 0 holding position
``base``; rotary embeddings see only position differences, so the head computes what it would over those positions
at their own places. Measured on this CPU (first draft accepted at k=1, bfloat16, 96 tokens, the first four
summarization and RAG prompts of Spec-Bench, 660-870 tokens): 0.167 over the whole prompt, 0.176 over the last 384
positions, 0.184 over 128; on four shorter categories (three prompts each) 0.296 either way. The head draws little
from far context, so the catch-up over a long prompt was mostly cost: 31 ms of a 769-token prompt, three plain steps.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from decoding.drafters.base import DecodeState, Drafter, Proposal
from decoding.drafters.drafting import (
    block_place,
    draft_chain,
    draft_loops,
    draft_tree,
    greedy_chain_loop,
    greedy_levels_loop,
    loop_applies,
    max_nodes_of,
    one_token_place,
    tree_forward,
)
from decoding.model.adapter import KVCache, ModelAdapter
from decoding.timing import mark
from decoding.trees.shapes import Dynamic, Tree

EPS = 1e-6


def feature_norm(h: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMS normalisation over the last dim (each fused depth on the same scale)."""
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)


class VocabHead(nn.Module):
    """A trainable LM head over ``vocab`` (target token ids, [M]); its logits over the full vocabulary are -inf
    outside ``vocab``, so it stands in for the target's head (``out_features`` = V)."""

    def __init__(self, lm_head: nn.Linear, vocab: torch.Tensor):
        super().__init__()
        self.out_features = lm_head.out_features
        object.__setattr__(self, "source", lm_head)  # the target's head (not a submodule): reset() starts from its rows
        self.register_buffer("vocab", vocab.long().clone())
        self.weight = nn.Parameter(lm_head.weight.detach()[self.vocab].clone())
        self.packed = None  # its weight packed like the target's (decoding.drafters.artifacts.pack_like_target)

    @torch.no_grad()
    def reset(self, vocab: torch.Tensor) -> None:
        """Draft over ``vocab`` (its first M ids, M = this head's size), starting from the target head's rows; a ranking
        shorter than M is followed by the unranked ids in id order (tokens the data never showed).

        >>> head = VocabHead(nn.Linear(4, 6, bias=False), torch.arange(4)); head.reset(torch.tensor([5, 2])); head.vocab.tolist()
        [5, 2, 0, 1]
        """
        size = self.vocab.shape[0]
        ranked = vocab[:size].long().cpu()
        if ranked.shape[0] < size:
            unseen = torch.ones(self.out_features, dtype=torch.bool)
            unseen[ranked] = False
            ranked = torch.cat([ranked, unseen.nonzero().flatten()[: size - ranked.shape[0]]])
        ids = ranked.to(self.vocab.device)
        self.vocab.copy_(ids)
        self.weight.copy_(self.source.weight.detach()[ids].to(self.weight.dtype))

    @torch.no_grad()
    def refresh(self, vocab: torch.Tensor) -> int:
        """Draft over the first M of a new ranking ``vocab`` as :meth:`reset` does, but keep the trained rows of the
        tokens it drafted already (the others start from the target head's rows); returns how many tokens are new.

        >>> target = nn.Linear(4, 6, bias=False); _ = target.weight.data.zero_()       # the target's rows: zeros
        >>> head = VocabHead(target, torch.tensor([5, 2])); _ = head.weight.data.fill_(7.0)  # trained rows: sevens
        >>> head.refresh(torch.tensor([2, 3])), head.vocab.tolist(), head.weight[:, 0].tolist()
        (1, [2, 3], [7.0, 0.0])
        """
        before = {int(t): i for i, t in enumerate(self.vocab.tolist())}
        trained = self.weight.detach().clone()
        self.reset(vocab)
        now = [(j, before[int(t)]) for j, t in enumerate(self.vocab.tolist()) if int(t) in before]
        if now:
            rows, old = zip(*now, strict=True)
            self.weight[list(rows)] = trained[list(old)]
        return self.vocab.shape[0] - len(now)

    def trimmed(self, h: torch.Tensor) -> torch.Tensor:  # [.., H] -> [.., M]
        return h @ self.weight.T if self.packed is None else self.packed(h)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [.., H] -> [.., V]
        sub = self.trimmed(h)
        out = torch.full((*sub.shape[:-1], self.out_features), float("-inf"), dtype=sub.dtype, device=sub.device)
        return out.index_copy_(-1, self.vocab, sub)


class EagleNet(nn.Module):
    """``fc_features``, ``fc_in``, one decoder layer and a :class:`VocabHead`, over the target's frozen embedding,
    final norm and rotary embedding (attributes, not submodules: never trained or saved).

    Shaped like a Hugging Face causal LM (``model.layers``, ``model.embed_tokens``, ``model.norm``,
    ``model.rotary_emb``, ``lm_head``, ``config``), so ``ModelAdapter`` runs its layer with its own KV cache
    (the adapter's ``hidden=`` entry takes ``fc_in``'s output).
    """

    def __init__(self, hf_model, feature_layers: tuple[int, ...], vocab: torch.Tensor, init_layer: int | None = None):
        super().__init__()
        base = hf_model.model
        h = hf_model.config.hidden_size
        self.feature_layers = tuple(int(x) for x in feature_layers)
        self.config = copy.deepcopy(hf_model.config)
        self.config.num_hidden_layers = 1
        self.model = nn.Module()
        layer = copy.deepcopy(base.layers[len(base.layers) - 1 if init_layer is None else init_layer])
        layer.self_attn.layer_idx = 0  # indexes the drafter's own one-layer KV cache
        layer.requires_grad_(True)
        self.model.layers = nn.ModuleList([layer])
        for name in ("embed_tokens", "norm", "rotary_emb"):
            object.__setattr__(self.model, name, getattr(base, name))
        dtype = base.embed_tokens.weight.dtype
        self.fc_features = nn.Linear(len(self.feature_layers) * h, h, bias=False, dtype=dtype)
        self.fc_in = nn.Linear(2 * h, h, bias=True, dtype=dtype)
        with torch.no_grad():  # start as g = the last depth's normalised feature, z = e(x) + g
            self.fc_features.weight.zero_()
            self.fc_features.weight[:, -h:].copy_(torch.eye(h))
            self.fc_in.weight.copy_(torch.cat([torch.eye(h), torch.eye(h)], 1))
            self.fc_in.bias.zero_()
        self.lm_head = VocabHead(hf_model.lm_head, vocab)
        self.packed: dict = {}  # fc name -> its weight packed like the target's (artifacts.pack_like_target)

    def _fc(self, name: str, x: torch.Tensor) -> torch.Tensor:
        fc, packed = getattr(self, name), self.packed.get(name)
        if packed is None:
            return fc(x)
        return packed(x) if fc.bias is None else packed(x) + fc.bias

    def fuse(self, features: dict) -> torch.Tensor:
        """g [B, c, H] from the target's hidden states {layer: [B, c, H]} at ``feature_layers``."""
        return self._fc("fc_features", torch.cat([feature_norm(features[layer]) for layer in self.feature_layers], -1))

    def inputs(self, g: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """z [B, c, H] = fc_in([e(tokens); g]); tokens [B, c] are the tokens after g's positions."""
        return self._fc("fc_in", torch.cat([self.model.embed_tokens(tokens), g.to(self.fc_in.weight.dtype)], -1))


class EagleDrafter(Drafter):
    """Drafts chains, or trees of ``tree`` shape, from an :class:`EagleNet` (see the module docstring)."""

    reads_tokens = True  # it reads ``state.tokens`` at its steps

    name = "eagle"

    def __init__(
        self,
        net: EagleNet,
        confidence_threshold: float = 0.0,
        tree: Tree | Dynamic | None = None,
        chooser=None,
        loop_graphs: bool | None = None,
        context: int | None = None,
    ):
        self.net, self.adapter = net, ModelAdapter.shared(net)
        self.context = context  # the most unfed positions a catch-up feeds (None: all; the module docstring)
        self.loops = draft_loops(self.adapter, loop_graphs)  # greedy chains and level trees: one CUDA graph per shape
        self.feature_layers = net.feature_layers
        self.threshold = confidence_threshold
        self.tree = tree
        self.chooser = chooser  # decoding.trees.hardware.TreeChooser: size dynamic trees by verification cost
        self.cache: KVCache | None = None
        self.fed = 0  # positions base..fed-1 are in the drafter's cache, with true-feature keys, at slots 0..fed-1-base
        self.base = 0  # the position at the cache's slot 0 (> 0 once a catch-up skipped what ``context`` leaves out)
        self.queue: list[dict] = []
        self.last: dict = {}
        self._probs = None

    def max_nodes(self, k: int) -> int:
        return max_nodes_of(self.tree, k)

    def start(self, state: DecodeState) -> None:
        self.cache = self.adapter.new_cache(state.tokens.shape[0], state.max_len)
        self.fed, self.base, self.queue = 0, 0, [state.target_features]

    def update(self, state: DecodeState, num_accepted: int) -> None:
        self.queue.append(state.target_features)  # the positions kept: pending + accepted, fed again next time
        self.cache.rollback(self.fed - self.base)  # the drafted nodes' keys came from drafted features: dropped

    def _catch_up(self, state: DecodeState) -> torch.Tensor:
        """Feed positions fed..n-2 (the last ``context`` of them) with the target's features; returns o_{n-2} [B, 1, H]."""
        n = state.tokens.shape[1]
        features = self._queued()
        if self.context is not None and n - 1 - self.fed > self.context:  # start afresh at the last `context` positions
            skip = n - 1 - self.context - self.fed
            features = [f[:, skip:] for f in features]
            self.fed = self.base = n - 1 - self.context
            self.cache.rollback(0)
        inputs = self._catch_up_inputs(features, state.tokens[:, self.fed + 1 : n])
        out = self.adapter.forward(self.cache, self.fed - self.base, hidden=inputs)
        self._caught_up(n)
        return out[:, -1:]

    def _queued(self) -> list[torch.Tensor]:
        """The target's features of the positions kept since the last catch-up, per feature layer [B, n-1-fed, H]."""
        return [torch.cat([q[layer] for q in self.queue], 1) for layer in self.feature_layers]

    def _catch_up_inputs(self, features: list[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        """The head's inputs z [B, w, H] of the catch-up: the fused features and the tokens after their positions."""
        return self.net.inputs(self.net.fuse(dict(zip(self.feature_layers, features, strict=True))), tokens)

    def _caught_up(self, n: int) -> None:
        """Positions base..n-2 are fed: the queue is spent and the cache ends there."""
        self.queue, self.fed = [], n - 1
        self.cache.rollback(self.fed - self.base)

    def _trimmed(self) -> torch.Tensor | None:
        """The head's token ids [M] when it drafts over its own vocabulary (a trained VocabHead), else None."""
        head = self.adapter.lm_head
        return head.vocab if isinstance(head, VocabHead) else None

    def _logits(self, h: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
        """Draft logits of hidden states [B, t, H]: over the head's M tokens (indices into ``vocab``), else over V."""
        if vocab is None:
            return self.adapter.logits(h)
        return self.adapter.lm_head.trimmed(self.adapter.norm(h)).float()

    @torch.inference_mode()
    def propose(self, state: DecodeState, k: int) -> Proposal:
        a, n = self.adapter, state.tokens.shape[1]
        if self.tree is None and k > 1 and loop_applies(self, state):  # catch-up and chain as one graph
            tokens = self._caught_up_chain(state, k, self._trimmed())
            if tokens is not None:
                return Proposal(tokens=tokens)
        root = self._catch_up(state)
        self.caught_up = mark(root.device)
        if k <= 0:
            return Proposal.empty(state.tokens.shape[0], state.tokens.device)
        if self.tree is None:
            # greedy chains draft over the head's tokens; sampled ones need q over the whole vocabulary
            vocab = self._trimmed() if state.sampling.greedy else None
            if loop_applies(self, state) and k > 1:
                tokens = self._chain_loop(root, n, k, vocab)
                if tokens is not None:
                    return Proposal(tokens=tokens)
            prev = [root]

            def step(tok, i, need_logits):
                ids = tok if vocab is None else vocab[tok]
                prev.append(a.forward(self.cache, n - 1 + i - self.base, hidden=self.net.inputs(prev[-1], ids[:, None])))
                return self._logits(prev[-1], vocab)[:, -1]

            tokens, probs, _ = draft_chain(step, self._logits(root, vocab)[:, -1], k, state, self.threshold, feed_last=False)
            return Proposal(tokens=tokens if vocab is None else vocab[tokens], probs=probs)
        grown = self._levels_loop(root, n, k) if loop_applies(self, state) and self._levels() and k > 0 else None
        if grown is not None:
            ids, parents, path_p = grown
            self._probs = None
        else:
            tokens, parents, path_p = self.draft_tree(state, k, root)
            ids = torch.tensor([tokens], dtype=torch.long, device=state.tokens.device)
        if self.chooser is not None and isinstance(self.tree, Dynamic):
            keep = self.chooser.prefix(path_p)  # every prefix is a tree (best-first, or reranked levels)
            self.last = {"drafted": ids.shape[1], "verified": keep, "expected": 1 + sum(path_p[:keep])}
            ids, parents = ids[:, :keep], parents[:keep]
        return Proposal(tokens=ids, probs=self._probs, tree=Tree.from_parents([-1] + parents))

    # ---- the draft loop as one graph ---------------------------------------------------------------------------------
    def _levels(self) -> bool:
        return isinstance(self.tree, Dynamic) and self.tree.width > 0 and self._trimmed() is not None

    def _feed_one(self, vocab):
        a, net, cache = self.adapter, self.net, self.cache

        def feed(h, tok, slot):
            ids = tok if vocab is None else vocab[tok]
            place = one_token_place(slot, cache.max_len)
            return a.eager_forward(cache, None, net.inputs(h, ids[:, None]), 0, a.num_layers, slot[:, None], place, None)

        return feed

    def _greedy_chain(self, root: torch.Tensor, slot: torch.Tensor, k: int, vocab) -> torch.Tensor:
        """A loop's k greedy drafts [B, k] (token ids) from ``root``, the first fed at ``slot`` [B]."""
        tokens = greedy_chain_loop(lambda h: self._logits(h, vocab)[:, -1], self._feed_one(vocab), root, slot, k)
        return tokens if vocab is None else vocab[tokens]

    def _chain_loop(self, root: torch.Tensor, n: int, k: int, vocab) -> torch.Tensor | None:
        """Drafts [B, k] (token ids) of the greedy chain from ``root`` (o_{n-2}), replayed as one graph."""
        cache = self.cache

        def loop(root, slot):
            return self._greedy_chain(root, slot, k, vocab)

        slot = torch.full((root.shape[0],), n - 1 - self.base, dtype=torch.long, device=root.device)
        key = ("chain", cache.k_all.data_ptr(), tuple(cache.k_all.shape), root.shape[0], k, vocab is not None)
        return self.loops.run(key, loop, root, slot)

    def _caught_up_chain(self, state: DecodeState, k: int, vocab) -> torch.Tensor | None:
        """The catch-up (the target's features of the positions kept since the last draft, fed in one block) and the
        greedy chain from it, replayed as one graph: drafts [B, k]. Only when the catch-up is a step's usual width (at
        most k + 1 positions: the pending token and the accepted drafts), so the shapes stay few; None otherwise (after
        a prefill or steps without drafts) or where the capture failed, and the drafter's state is left untouched."""
        n, cache, a = state.tokens.shape[1], self.cache, self.adapter
        w = n - 1 - self.fed
        if not 1 <= w <= k + 1:
            return None

        def loop(fed, ids, *features):
            place = block_place(fed, w, cache.max_len)
            root = a.eager_forward(cache, None, self._catch_up_inputs(features, ids), 0, a.num_layers, place.slots, place, None)
            return self._greedy_chain(root[:, -1:], fed + w, k, vocab)

        fed = torch.full((state.tokens.shape[0],), self.fed - self.base, dtype=torch.long, device=state.tokens.device)
        key = ("caught-up-chain", cache.k_all.data_ptr(), tuple(cache.k_all.shape), fed.shape[0], k, w, vocab is not None)
        tokens = self.loops.run(key, loop, fed, state.tokens[:, self.fed + 1 : n], *self._queued())
        if tokens is not None:
            self._caught_up(n)
        return tokens

    def _levels_loop(self, root: torch.Tensor, n: int, k: int):
        """EAGLE-2's level tree (``draft_levels``) replayed as one graph: (ids [1, nodes], parents, path probabilities),
        the last two read back in one copy; None where the loop does not apply (several rows) or its capture failed."""
        if root.shape[0] != 1:
            return None
        a, net, cache, vocab, shape = self.adapter, self.net, self.cache, self._trimmed(), self.tree

        def feed(h, toks, place, positions):
            return a.eager_forward(cache, None, net.inputs(h, vocab[toks][None]), 0, a.num_layers, positions, place, None)

        def loop(root, root_slot):
            toks, parents, path = greedy_levels_loop(lambda h: self._logits(h, vocab)[0], feed, root, root_slot, shape, k, cache.max_len)
            return vocab[toks], torch.stack([parents.float(), path])

        root_slot = torch.full((1,), n - 2 - self.base, dtype=torch.long, device=root.device)
        key = ("levels", cache.k_all.data_ptr(), tuple(cache.k_all.shape), k, shape)
        out = self.loops.run(key, loop, root, root_slot)
        if out is None:
            return None
        ids, host = out[0], out[1].tolist()  # the one read of the draft: the tree's shape and its path probabilities
        return ids, [int(x) for x in host[0]], host[1]

    def draft_tree(self, state: DecodeState, k: int, root=None) -> tuple[list[int], list[int], list[float]]:
        """A token tree of up to ``k`` levels in ``self.tree``'s shape: (tokens, parents indexing [pending, nodes...],
        path probabilities) per node, in node order (for ``Dynamic`` shapes by non-increasing path probability: every
        prefix is a tree). Feeds the committed positions first unless ``root`` (o_{n-2}) is given. The candidates are
        the draft's top tokens (deterministic), so the head drafts over its own M tokens."""
        a, n = self.adapter, state.tokens.shape[1]
        if root is None:
            root = self._catch_up(state)
        vocab = self._trimmed() if isinstance(self.tree, Dynamic) or state.sampling.greedy else None
        outputs = {0: root}  # node -> its output feature [B, 1, H] (node 0: the pending token's pair at slot n-2)

        def tree_step(toks, lo, hi, tree):
            parents = tree.parents.tolist()
            g = torch.cat([outputs[parents[i]] for i in range(lo, hi)], 1)
            ids = toks if vocab is None else vocab[toks]
            h = tree_forward(a, self.cache, n - 2 - self.base, tree, lo, hi, hidden=self.net.inputs(g, ids))
            outputs.update({i: h[:, j : j + 1] for j, i in enumerate(range(lo, hi))})
            return self._logits(h, vocab)

        path_p: list[float] = []
        shape = self.tree or Dynamic(budget=k, width=8)
        tokens, probs, tree, _ = draft_tree(
            tree_step, self._logits(root, vocab)[:, -1], shape, k, state, feed_last=False, path_probs=path_p
        )
        self._probs = probs if vocab is None else None
        nodes = (tokens if vocab is None else vocab[tokens])[0].tolist()
        return nodes, tree.parents.tolist()[1:], path_p[1:] if path_p else [1.0] * len(nodes)
