"""Trained drafting parts: Kangaroo adapters, Medusa and Hydra heads, a feature-level (EAGLE) head, distilled drafts.

Small models have little layer redundancy (SmolLM2-135M: exiting after layer
L <= 20 agrees with the full model on 4-13% of tokens), so the self-speculative
and shallow-draft methods need trained parts. Each recipe here is a small
module that reuses the target's frozen embedding, final norm, LM head and
rotary embedding, and the drafter that runs it in the one decoding loop. What
each recipe is trained on (its objective, the losses, VocabTrim's ranking) and
the training loop live in ``training/`` (``training/objectives.py``); artifacts
in ``decoding/drafters/artifacts.py``.

| recipe   | module                                   | drafts from                                 | paper |
|----------|------------------------------------------|---------------------------------------------|-------|
| kangaroo | one decoder block after exit layer L     | the target's first L layers (shared cache)  | Kangaroo (Liu et al. 2024) |
| medusa   | K residual blocks, one per future offset | the target's last hidden state              | Medusa (Cai et al. 2024) |
| hydra    | K sequentially dependent MLP heads       | last hidden state + drafted tokens          | Hydra (Ankner et al. 2024) |
| feature  | fc(2H -> H) + one decoder block          | features f_p and token x_{p+1}, autoregress | EAGLE (Li et al. 2024) |
| distill  | the target's first D layers, fine-tuned  | token ids (a separate small draft model)    | Goel et al. 2024 (TVD++) |

Every drafter only proposes; the target verifies, so greedy output equals AR
whatever the drafter learned.

Positions (one drafting round, pending token x_{n-1} at slot n-1): the loop
hands drafters ``state.target_hidden``, the target's last-layer hidden states
f_p of the positions it just kept, ending at p = n-2 (f_{n-2} predicted x_{n-1}).
Medusa head i on f_{n-2} predicts x_{n-1+i}; Hydra head i also reads the
embeddings of x_{n-1}..x_{n-2+i}; the feature head reads (f_p, x_{p+1}) and
predicts f_{p+1}.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from decoding.drafters.base import DecodeState, Drafter, Proposal
from decoding.drafters.draft_model import DraftModelDrafter
from decoding.drafters.drafting import draft_chain, draft_tree, max_nodes_of
from decoding.drafters.eagle import EagleDrafter, EagleNet, VocabHead
from decoding.drafters.early_exit import EarlyExitDrafter
from decoding.errors import ConfigError
from decoding.model.adapter import KVCache, ModelAdapter
from decoding.trees.shapes import Dynamic, Tree

# ---- the target's frozen shared parts ---------------------------------------------------------


class Shared:
    """The target's embedding, final norm, LM head and rotary embedding (frozen, never saved with a drafter)."""

    def __init__(self, hf_model, keep: torch.Tensor | None = None):
        base = hf_model.model
        self.config = hf_model.config
        self.embed, self.norm, self.lm_head, self.rotary = base.embed_tokens, base.norm, hf_model.lm_head, base.rotary_emb
        self.layers = base.layers
        self.hidden_size = hf_model.config.hidden_size
        # training over a token subset (the data's most frequent tokens): teacher and student logits are [.., M]
        self.head_rows = None if keep is None else self.lm_head.weight.detach()[keep]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [.., H] -> [.., V] (or [.., M] over ``keep``), differentiable
        if self.head_rows is not None:
            return self.norm(hidden) @ self.head_rows.T
        return self.lm_head(self.norm(hidden))


# ---- modules ------------------------------------------------------------------------------------


class DraftNet(nn.Module):
    """Trainable decoder blocks (copies of target layers) over the target's shared embedding, norm, head and rotary.

    Shaped like a Hugging Face causal LM (``model.embed_tokens``, ``model.layers``,
    ``model.norm``, ``model.rotary_emb``, ``lm_head``, ``config``), so
    :class:`~decoding.model.adapter.ModelAdapter` runs it with its own KV cache. The
    shared parts are attributes, not submodules: ``state_dict()`` and
    ``parameters()`` hold only what was trained. ``fuse`` (the feature head's
    fc over [f_p; e(x_{p+1})]) is present when ``fuse=True``; with ``draft_vocab``
    > 0 the head is a trainable :class:`~decoding.drafters.eagle.VocabHead` over
    that many tokens instead of the target's.
    """

    def __init__(self, hf_model, init_layers: list[int], fuse: bool = False, draft_vocab: int = 0):
        super().__init__()
        shared = Shared(hf_model)
        self.config = copy.deepcopy(hf_model.config)
        self.config.num_hidden_layers = len(init_layers)
        self.model = nn.Module()
        blocks = []
        for i, src in enumerate(init_layers):
            block = copy.deepcopy(shared.layers[src])
            block.self_attn.layer_idx = i  # our KV cache is indexed by the draft's own layer number
            block.requires_grad_(True)
            blocks.append(block)
        self.model.layers = nn.ModuleList(blocks)
        for name, part in (("embed_tokens", shared.embed), ("norm", shared.norm), ("rotary_emb", shared.rotary)):
            object.__setattr__(self.model, name, part)
        if draft_vocab:  # a trainable head over the data's draft_vocab most frequent tokens (VocabTrim, trained)
            self.lm_head = VocabHead(shared.lm_head, torch.arange(min(draft_vocab, shared.lm_head.out_features)))
        else:
            object.__setattr__(self, "lm_head", shared.lm_head)
        object.__setattr__(self, "shared", shared)
        h = shared.hidden_size
        if fuse:
            self.fuse = nn.Linear(2 * h, h, bias=True, dtype=shared.embed.weight.dtype)
            with torch.no_grad():  # start as f_p + e(x_{p+1})
                self.fuse.weight.copy_(torch.cat([torch.eye(h), torch.eye(h)], 1))
                self.fuse.bias.zero_()

    def run(self, hidden: torch.Tensor, start: int | torch.Tensor = 0) -> torch.Tensor:
        """Differentiable causal forward of the blocks, no cache: [B, T, H] at positions start.. (an int, or [B]: one
        start per row) -> [B, T, H]."""
        bsz, t = hidden.shape[:2]
        first = torch.as_tensor(start, device=hidden.device).reshape(-1, 1)
        positions = (first + torch.arange(t, device=hidden.device)[None]).expand(bsz, t)
        cos_sin = self.model.rotary_emb(hidden, positions)
        for block in self.model.layers:
            hidden = block(hidden, attention_mask=None, position_ids=positions, past_key_values=None, position_embeddings=cos_sin)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        return hidden

    def fused(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # [B, T, H], [B, T] -> [B, T, H]
        return self.fuse(torch.cat([features, self.model.embed_tokens(tokens)], -1))


class MedusaHeads(nn.Module):
    """K residual blocks f -> f + SiLU(W_i f + b_i) (Medusa-1), each followed by the shared norm + LM head.

    W_i starts at zero, so every head starts as the target's own next-token head.
    """

    def __init__(self, hidden_size: int, num_heads: int, dtype=torch.float32):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size, dtype=dtype) for _ in range(num_heads))
        for b in self.blocks:
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, f: torch.Tensor, i: int) -> torch.Tensor:  # [.., H] -> [.., H] for head i (0-based)
        return f + F.silu(self.blocks[i](f))


class HydraHeads(nn.Module):
    """K sequentially dependent heads: z_0 = f_p, z_i = z_{i-1} + MLP_i([z_{i-1}; e(x_{p+i})]); head i reads z_i.

    The last linear of each MLP starts at zero (z_i = f_p at first).
    """

    def __init__(self, hidden_size: int, num_heads: int, dtype=torch.float32):
        super().__init__()
        h = hidden_size
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(2 * h, h, dtype=dtype), nn.SiLU(), nn.Linear(h, h, dtype=dtype)) for _ in range(num_heads)
        )
        for m in self.mlps:
            nn.init.zeros_(m[2].weight)
            nn.init.zeros_(m[2].bias)

    @property
    def num_heads(self) -> int:
        return len(self.mlps)

    def forward(self, z: torch.Tensor, token_embedding: torch.Tensor, i: int) -> torch.Tensor:  # [.., H], [.., H] -> [.., H]
        return z + self.mlps[i](torch.cat([z, token_embedding], -1))


# ---- drafters -------------------------------------------------------------------------------------


class KangarooDrafter(EarlyExitDrafter):
    """Kangaroo: the target's first L layers (writing the target's cache), then an adapter block, then the shared head.

    The adapter has its own one-layer KV cache over every committed position. A drafting step feeds it pending and
    the drafts (their layer-L hidden states are the ones verification continues from, so the accepted ones stay). The
    positions no draft fed, the prompt's and those of plain steps (k=auto drafts only where it pays), come from the
    target's own forward: it keeps their hidden states after L layers (``feature_layers``), and the adapter catches up
    on them lazily, in one forward when it next drafts, and a request that never drafts pays nothing for the adapter.
    Before, every request paid an extra pass over layers [0, L) of its prompt at its start (4% of a 128-token answer
    to a 769-token prompt on this CPU), and drafted after plain steps over adapter keys its cache never held.
    Drafting stops when the top-1 probability falls below ``confidence_threshold`` (Kangaroo's double early exit).
    """

    name = "kangaroo"

    def __init__(self, net: DraftNet, exit_layer: int, confidence_threshold: float = 0.0):
        super().__init__(exit_layer, confidence_threshold)
        self.net = ModelAdapter.shared(net)
        self.cache: KVCache | None = None
        self.feature_layers = (exit_layer,)  # a plain step's (and the prompt's) hidden states after L layers
        self.fed, self.queue, self.drafted = 0, [], False  # positions 0..fed-1 are in the adapter's cache; the rest queued

    def start(self, state: DecodeState) -> None:
        self.cache = self.net.new_cache(state.tokens.shape[0], state.max_len)
        self.fed, self.queue, self.drafted = 0, [state.target_features[self.exit_layer]], False
        self.feature_layers = (self.exit_layer,)

    def propose(self, state: DecodeState, k: int) -> Proposal:
        n = state.tokens.shape[1]
        if self.queue:  # catch up: positions fed..n-2, in one forward
            self.net.forward(self.cache, self.fed, hidden=torch.cat(self.queue, 1))
        self.queue, self.fed = [], n - 1
        proposal = super().propose(state, k)
        # verification continues from the proposal's hidden states at layer L: they are this step's features
        self.drafted, self.feature_layers = True, ()
        return proposal

    def update(self, state: DecodeState, num_accepted: int) -> None:
        if self.drafted:  # pending and the accepted drafts were fed while drafting
            self.fed = state.tokens.shape[1] - 1
        else:
            self.queue.append(state.target_features[self.exit_layer])
        self.cache.rollback(self.fed)
        self.drafted, self.feature_layers = False, (self.exit_layer,)

    def exit_logits(self, state: DecodeState, hidden: torch.Tensor, slot: int, need_logits: bool):
        out = self.net.forward(self.cache, slot, hidden=hidden)  # always: the adapter's KV at this slot is needed later
        return self.net.logits(out)[:, -1] if need_logits else None


class _HiddenHeadDrafter(Drafter):
    """Drafters that start from the target's last hidden state f_{n-2} (``state.target_hidden``).

    With a ``tree`` shape (static, Sequoia, DySpec) they draft token trees: a
    node's next-token logits come from the head of its depth (Medusa) or from
    its parent's state and its own token (Hydra), so one head call per depth
    level covers every node of that level.
    """

    reads_tokens = True  # it reads ``state.tokens`` at its steps

    def __init__(self, heads: nn.Module, confidence_threshold: float = 0.0, tree: Tree | Dynamic | None = None):
        self.heads = heads
        self.threshold = confidence_threshold
        self.num_heads = heads.num_heads
        self.tree = tree
        self.lm_head = None  # a TrimmedHead (VocabTrim) replaces the target's head when set

    def max_nodes(self, k: int) -> int:
        return max_nodes_of(self.tree, min(k, self.num_heads))

    def logits(self, state: DecodeState, z: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, V]
        t = state.target
        return (self.lm_head or t.lm_head)(t.norm(z)).float()

    @torch.inference_mode()
    def propose(self, state: DecodeState, k: int) -> Proposal:
        f = state.target_hidden[:, -1]  # [B, H] f_{n-2}
        k = min(k, self.num_heads)
        if self.tree is None:
            tokens, probs = self._chain(state, f, k)
            return Proposal(tokens=tokens, probs=probs)
        root, level = self._tree(state, f)

        def step(toks, lo, hi, tree):  # logits [B, hi-lo, V] of nodes lo..hi-1, one head call per depth among them
            depth, parents = tree.depth.tolist(), tree.parents.tolist()
            out = [None] * (hi - lo)
            for d in sorted({depth[i] for i in range(lo, hi)}):
                cols = [i - lo for i in range(lo, hi) if depth[i] == d]
                if d >= self.num_heads:  # the last head's depth is never expanded: its logits are not read
                    rows = torch.zeros(root.shape[0], len(cols), root.shape[-1], dtype=root.dtype, device=root.device)
                else:
                    rows = level(toks[:, cols], [lo + c for c in cols], d, [parents[lo + c] for c in cols])
                for j, c in enumerate(cols):
                    out[c] = rows[:, j]
            return torch.stack(out, 1)

        tokens, probs, tree, _ = draft_tree(step, root, self.tree, k, state, feed_last=False)
        return Proposal(tokens=tokens, probs=probs, tree=tree)

    def _chain(self, state, f, k):  # -> (tokens [B, j], probs [B, j, V] | None)
        raise NotImplementedError

    def _tree(self, state, f):
        """(root logits [B, V], level(tokens [B, t], nodes, depth, parents) -> logits [B, t, V] for t nodes of one depth < num_heads)."""
        raise NotImplementedError


class MedusaDrafter(_HiddenHeadDrafter):
    """Medusa: head i drafts x_{n-1+i} from f_{n-2}; a chain takes each head's top token, a tree its top candidates."""

    name = "medusa"

    def _chain(self, state, f, k):
        def step(tok, i, need_logits):
            return self.logits(state, self.heads(f, i + 1)) if need_logits else None

        tokens, probs, _ = draft_chain(step, self.logits(state, self.heads(f, 0)), k, state, self.threshold, feed_last=False)
        return tokens, probs

    def _tree(self, state, f):
        def level(toks, nodes, depth, parents):  # every node of one depth has the same draft distribution
            return self.logits(state, self.heads(f, depth))[:, None].expand(-1, len(nodes), -1)

        return self.logits(state, self.heads(f, 0)), level


class HydraDrafter(_HiddenHeadDrafter):
    """Hydra: head i reads z_{i-1} and the embedding of the token before its target (pending, then each draft)."""

    name = "hydra"

    def _chain(self, state, f, k):
        t = state.target
        z = [self.heads(f, t.embed(state.tokens[:, -1]), 0)]

        def step(tok, i, need_logits):
            if not need_logits:
                return None
            z.append(self.heads(z[-1], t.embed(tok), i + 1))
            return self.logits(state, z[-1])

        tokens, probs, _ = draft_chain(step, self.logits(state, z[0]), k, state, self.threshold, feed_last=False)
        return tokens, probs

    def _tree(self, state, f):
        t = state.target
        z = {0: self.heads(f, t.embed(state.tokens[:, -1]), 0)}  # node -> its state (root: z_0)

        def level(toks, nodes, depth, parents):  # z_node = head_depth(z_parent, e(token of the node))
            out = self.heads(torch.stack([z[p] for p in parents], 1), t.embed(toks), depth)  # [B, t, H]
            z.update({node: out[:, j] for j, node in enumerate(nodes)})
            return self.logits(state, out)

        return self.logits(state, z[0]), level


class FeatureDrafter(Drafter):
    """EAGLE-style: one decoder block drafts autoregressively at the feature level.

    Its own KV cache covers the pairs (f_p, x_{p+1}) of every committed
    position p <= n-2 (fed lazily, from ``state.target_hidden``); a draft step
    feeds (f^_{p}, d) and reads f^_{p+1} through the shared norm + head.
    """

    reads_tokens = True  # it reads ``state.tokens`` at its steps

    name = "feature"

    def __init__(self, net: DraftNet, confidence_threshold: float = 0.0):
        self.net, self.adapter = net, ModelAdapter.shared(net)
        self.threshold = confidence_threshold
        self.cache: KVCache | None = None
        self.fed = 0
        self.queue: list[torch.Tensor] = []

    def start(self, state: DecodeState) -> None:
        self.cache = self.adapter.new_cache(state.tokens.shape[0], state.max_len)
        self.fed, self.queue = 0, [state.target_hidden]

    def update(self, state: DecodeState, num_accepted: int) -> None:
        self.queue.append(state.target_hidden)

    @torch.inference_mode()
    def propose(self, state: DecodeState, k: int) -> Proposal:
        a, tokens = self.adapter, state.tokens
        n = tokens.shape[1]
        f = torch.cat(self.queue, 1)  # [B, c, H] features of positions fed .. n-2
        self.queue = []
        out = a.forward(self.cache, self.fed, hidden=self.net.fused(f, tokens[:, self.fed + 1 : n]))
        self.fed = n - 1
        feats = [out[:, -1:]]

        def step(tok, i, need_logits):
            feats.append(a.forward(self.cache, n - 1 + i, hidden=self.net.fused(feats[-1], tok[:, None])))
            return a.logits(feats[-1])[:, -1]

        drafts, probs, _ = draft_chain(step, a.logits(feats[0])[:, -1], k, state, self.threshold, feed_last=False)
        return Proposal(tokens=drafts, probs=probs)


# ---- VocabTrim -------------------------------------------------------------------------------------


class TrimmedHead(nn.Module):
    """VocabTrim: the LM head restricted to the ``keep`` token ids; logits of other tokens are -inf.

    The head is about a fifth of SmolLM2's parameters and dominates a shallow
    draft's cost; drafting over the most frequent target tokens only cuts it.
    The draft distribution has support on ``keep`` only, which the lossless
    rules allow (a token the draft never proposes costs acceptance, not
    correctness). Behaves like the full head (``out_features`` = V).

    >>> head = nn.Linear(4, 6, bias=False)
    >>> trimmed = TrimmedHead(head, torch.tensor([5, 1]))
    >>> out = trimmed(torch.ones(1, 4))
    >>> out.shape, bool(torch.isinf(out[0, [0, 2, 3, 4]]).all()), torch.allclose(out[0, [5, 1]], head(torch.ones(1, 4))[0, [5, 1]])
    (torch.Size([1, 6]), True, True)
    """

    def __init__(self, lm_head: nn.Linear, keep: torch.Tensor):
        super().__init__()
        self.out_features = lm_head.out_features
        self.register_buffer("keep", keep.long())
        self.register_buffer("weight", lm_head.weight.detach()[self.keep].clone())

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [.., H] -> [.., V]
        sub = h @ self.weight.T  # [.., M]
        out = torch.full((*sub.shape[:-1], self.out_features), float("-inf"), dtype=sub.dtype, device=sub.device)
        return out.index_copy_(-1, self.keep, sub)


def trim_vocab(drafter: Drafter, head: TrimmedHead) -> Drafter:
    """Make a trained drafter draft with ``head`` instead of the target's full LM head."""
    for name in ("net", "adapter"):  # Kangaroo (net), feature head and distilled draft (adapter): a ModelAdapter
        if isinstance(getattr(drafter, name, None), ModelAdapter):
            # the drafter's own adapter: the module's shared one (ModelAdapter.shared) keeps the head other drafters use;
            # the layers' graphs and cache pool stay shared, the draft loops (which bake the head in) do not
            adapter = copy.copy(getattr(drafter, name))
            adapter.lm_head, adapter._loops = head, None
            setattr(drafter, name, adapter)
            if getattr(drafter, "loops", None) is not None:
                drafter.loops = adapter.loop_graphs()
            return drafter
    drafter.lm_head = head  # Medusa / Hydra
    return drafter


# ---- recipes: module + drafter --------------------------------------------------------


class Recipe:
    """A recipe builds its module from the target, names the hidden layers its data needs and makes its drafter
    (its training objective: ``training.objectives.OBJECTIVES[name]``)."""

    name = ""
    knobs: dict = {}  # knob -> default; None = derived from the model (see defaults)
    drafts_trees = False  # its drafter takes a token-tree shape (else chains only)
    drafts = True  # a drafter (its artifact keeps the data's token ranking, VocabTrim); not the stop head's recipe

    def defaults(self, depth: int) -> dict:
        return dict(self.knobs)

    def check(self, knobs: dict, depth: int) -> dict:
        unknown = sorted(set(knobs) - set(self.knobs))
        if unknown:
            raise ConfigError(unknown[0], f"not a knob of recipe {self.name!r}; knobs: {', '.join(self.knobs) or 'none'}")
        out = {**self.defaults(depth), **knobs}
        for key, value in out.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(key, f"expected an integer, got {value!r}")
        return out

    def prepare(self, module: nn.Module, vocab: torch.Tensor) -> None:
        """Before training: a trimmed head drafts over the data's most frequent tokens (``vocab``, ranked)."""
        head = getattr(module, "lm_head", None)
        if isinstance(head, VocabHead):
            head.reset(vocab)

    def data_layers(self, knobs: dict, depth: int) -> list[int]:
        """Hidden states the data must hold: layer l = output of the first l layers (depth = final, pre-norm)."""
        return [depth]

    def build(self, hf_model, knobs: dict) -> nn.Module:
        raise NotImplementedError

    def drafter(self, module: nn.Module, knobs: dict, confidence_threshold: float, tree: Tree | Dynamic | None = None) -> Drafter:
        """The recipe's drafter; ``tree`` is the token-tree shape to draft (None: a chain)."""
        raise NotImplementedError

    def chain_only(self, tree) -> None:
        if tree is not None:
            trees = ", ".join(r.name for r in RECIPES.values() if r.drafts_trees)
            raise ConfigError("tree", f"the {self.name} drafter drafts chains only (trees: {trees})")


def _below_the_top(knobs: dict, field: str, depth: int) -> dict:
    """A recipe's layer knob names a layer below the target's top one."""
    if not 1 <= knobs[field] < depth:
        raise ConfigError(field, f"must be in 1..{depth - 1} for a {depth}-layer model, got {knobs[field]}")
    return knobs


class KangarooRecipe(Recipe):
    name = "kangaroo"
    knobs = {"exit_layer": None, "draft_vocab": 0}  # draft_vocab > 0: a trained head over that many tokens

    def defaults(self, depth):
        return {"exit_layer": max(1, depth // 3), "draft_vocab": 0}

    def check(self, knobs, depth):
        return _below_the_top(super().check(knobs, depth), "exit_layer", depth)

    def data_layers(self, knobs, depth):
        return [knobs["exit_layer"], depth]

    def build(self, hf_model, knobs):
        return DraftNet(hf_model, [knobs["exit_layer"]], draft_vocab=knobs.get("draft_vocab", 0))  # a copy of the next target layer

    def drafter(self, module, knobs, confidence_threshold, tree=None):
        self.chain_only(tree)
        return KangarooDrafter(module, knobs["exit_layer"], confidence_threshold)


class DistillRecipe(Recipe):
    name = "distill"
    drafts_trees = True
    knobs = {"draft_layers": 4, "draft_vocab": 0}  # draft_vocab > 0: a trained head over that many tokens

    def check(self, knobs, depth):
        return _below_the_top(super().check(knobs, depth), "draft_layers", depth)

    def build(self, hf_model, knobs):
        return DraftNet(hf_model, list(range(knobs["draft_layers"])), draft_vocab=knobs.get("draft_vocab", 0))

    def drafter(self, module, knobs, confidence_threshold, tree=None):
        return DraftModelDrafter(ModelAdapter.shared(module), confidence_threshold, tree=tree)


class FeatureRecipe(Recipe):
    name = "feature"
    knobs = {"feature_weight_pct": 100}  # weight of the feature regression loss, percent of the logit loss

    def build(self, hf_model, knobs):
        return DraftNet(hf_model, [hf_model.config.num_hidden_layers - 1], fuse=True)

    def drafter(self, module, knobs, confidence_threshold, tree=None):
        self.chain_only(tree)
        return FeatureDrafter(module, confidence_threshold)


class HeadsRecipe(Recipe):
    """``num_heads`` heads on the last hidden state, the i-th predicting token t+i+1: Medusa's (independent) or Hydra's
    (each head also reads the tokens drafted before it); they draft trees."""

    drafts_trees = True
    knobs = {"num_heads": 4}
    heads: type[torch.nn.Module]
    drafter_class: type[Drafter]

    def build(self, hf_model, knobs):
        return self.heads(hf_model.config.hidden_size, knobs["num_heads"], hf_model.lm_head.weight.dtype)

    def drafter(self, module, knobs, confidence_threshold, tree=None):
        return self.drafter_class(module, confidence_threshold, tree)


class MedusaRecipe(HeadsRecipe):
    name, heads, drafter_class = "medusa", MedusaHeads, MedusaDrafter


class HydraRecipe(HeadsRecipe):
    name, heads, drafter_class = "hydra", HydraHeads, HydraDrafter


class EagleRecipe(Recipe):
    """The feature-level drafter of ``decoding.drafters.eagle``: the target's hidden states after ``low_layer``,
    ``mid_layer`` and its last layer fused, one decoder layer, a trained head over ``draft_vocab`` tokens; trained
    with ``ttt_steps`` unrolled steps of its own features (EAGLE-3's training-time test)."""

    name = "eagle"
    drafts_trees = True
    knobs = {"low_layer": None, "mid_layer": None, "draft_vocab": 8192, "ttt_steps": 3}

    def defaults(self, depth):
        low = max(1, min(2, depth // 4))  # EAGLE-3's low, middle and last depths (2, 15, 30 for SmolLM2-135M)
        return {"low_layer": low, "mid_layer": max(low + 1, depth // 2), "draft_vocab": 8192, "ttt_steps": 3}

    def check(self, knobs, depth):
        out = super().check(knobs, depth)
        if not 1 <= out["low_layer"] < out["mid_layer"] < depth:
            raise ConfigError("low_layer", f"need 1 <= low_layer < mid_layer < {depth}, got {out['low_layer']}, {out['mid_layer']}")
        if out["draft_vocab"] < 1 or out["ttt_steps"] < 1:
            raise ConfigError("draft_vocab", "draft_vocab and ttt_steps must be >= 1")
        return out

    def data_layers(self, knobs, depth):
        return [knobs["low_layer"], knobs["mid_layer"], depth]

    def build(self, hf_model, knobs):
        knobs = {**self.defaults(hf_model.config.num_hidden_layers), **knobs}
        layers = self.data_layers(knobs, hf_model.config.num_hidden_layers)
        return EagleNet(hf_model, tuple(layers), torch.arange(min(knobs["draft_vocab"], hf_model.lm_head.out_features)))

    def drafter(self, module, knobs, confidence_threshold, tree=None):
        return EagleDrafter(module, confidence_threshold, tree)


# the drafters' recipes; ``decoding.drafters.artifacts`` adds the stop head's (``stop``), which needs to read artifacts
RECIPES: dict[str, Recipe] = {
    r.name: r for r in (KangarooRecipe(), MedusaRecipe(), HydraRecipe(), FeatureRecipe(), DistillRecipe(), EagleRecipe())
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ConfigError("recipe", f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    return RECIPES[name]
