"""Tree speculative decoding as SGLang serves EAGLE-3, on transformers' forward and DynamicCache (batch 1, greedy).

SGLang's `--speculative-num-steps S --speculative-eagle-topk K --speculative-num-draft-tokens N`. One round:
  draft   catch the drafter up on the target's features of the newly accepted positions (Eagle3Chain.extend),
          then grow a tree: step 1 takes the top-K tokens after the current one; each later step expands the K
          frontier nodes by their top-K children and keeps the K best by cumulative log-probability. Of all
          K + (S-1)K^2 nodes drafted, the N-1 best by cumulative log-probability are verified. The drafter runs
          each frontier node seeing its cache (the accepted prefix), its ancestors and itself, at prefix + depth.
  verify  [current, *selected nodes] in one target forward with a 4D tree mask, position ids prefix + depth.
  accept  the longest root-to-leaf path the target agrees with, plus its own next token (the bonus); the target's
          KV cache then keeps the prefix and that path only, and the drafter is extended with the path's features.
With K = 1 and N = S + 1 the tree is the chain and a round is eyrie.decoding.common's. A reference path: the
host builds the tree node by node; eyrie.decoding.static does not decode trees.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers.cache_utils import DynamicLayer

from eyrie.decoding.common import SpecResult, emit, finished
from eyrie.decoding.transformers_path import Eagle3Chain, TransformersVerifier, cache_keyword
from eyrie.drafter.model import Eagle3Drafter


@dataclass(frozen=True)
class TreeShape:
    """SGLang's three EAGLE flags, checked as SGLang would need them."""

    steps: int  # --speculative-num-steps
    topk: int  # --speculative-eagle-topk
    draft_tokens: int  # --speculative-num-draft-tokens: the current token and N - 1 drafts

    def __post_init__(self):
        for flag, value in (("num-steps", self.steps), ("eagle-topk", self.topk), ("num-draft-tokens", self.draft_tokens)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"--speculative-{flag} must be an integer, got {value!r}")
        if self.steps < 1:
            raise ValueError(f"--speculative-num-steps must be >= 1, got {self.steps}")
        if self.topk < 1:
            raise ValueError(f"--speculative-eagle-topk must be >= 1, got {self.topk}")
        if self.draft_tokens < 2:
            raise ValueError(f"--speculative-num-draft-tokens must be >= 2 (the current token and one draft), got {self.draft_tokens}")
        if self.draft_tokens - 1 > self.nodes:
            raise ValueError(
                f"--speculative-num-draft-tokens {self.draft_tokens} verifies {self.draft_tokens - 1} drafts, but "
                f"--speculative-num-steps {self.steps} with --speculative-eagle-topk {self.topk} drafts only "
                f"{self.nodes} nodes (K + (S - 1) * K^2)"
            )

    @property
    def nodes(self) -> int:
        """Nodes drafted per round: K at step 1, then the K^2 children of the K frontier nodes at each later step."""
        return self.topk + (self.steps - 1) * self.topk**2


@dataclass
class Candidates:
    """Every node drafted in a round, in drafting order (depth-major), so a parent always precedes its children."""

    tokens: list[int] = field(default_factory=list)  # target ids
    parents: list[int] = field(default_factory=list)  # index of the parent node; -1: the current token (the root)
    depths: list[int] = field(default_factory=list)  # 1 for the root's children
    scores: list[float] = field(default_factory=list)  # cumulative log-probability along the path

    def add(self, token: int, parent: int, depth: int, score: float) -> int:
        for column, value in ((self.tokens, token), (self.parents, parent), (self.depths, depth), (self.scores, score)):
            column.append(value)
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """The nodes from depth 1 down to `node`."""
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


# expand(tree, frontier) -> (len(frontier), V) log-probabilities of the next token after each frontier node.
Expand = Callable[[Candidates, list[int]], torch.Tensor]


def grow_tree(shape: TreeShape, first: torch.Tensor, expand: Expand, to_target=lambda ids: ids) -> Candidates:
    """SGLang's draft loop (select_top_k_tokens): `first` (V,) holds the log-probabilities after the current token.

    SGLang multiplies probabilities; summing log-probabilities ranks the same up to rounding.
    """
    tree, k = Candidates(), shape.topk
    scores, ids = first.float().topk(k)
    frontier = [tree.add(t, -1, 1, s) for t, s in zip(to_target(ids).tolist(), scores.tolist())]
    for depth in range(2, shape.steps + 1):
        top, ids = expand(tree, frontier).float().topk(k, dim=-1)  # (K, K): the top-K children of each frontier node
        cumulative = torch.tensor([tree.scores[n] for n in frontier])[:, None] + top
        targets, cumulative = to_target(ids).tolist(), cumulative.tolist()
        children = [tree.add(targets[i][j], frontier[i], depth, cumulative[i][j]) for i in range(k) for j in range(k)]
        # All K^2 children stay candidates for verification; only the best K are expanded further.
        frontier = sorted(children, key=lambda n: (-tree.scores[n], n))[:k]
    return tree


def select_nodes(tree: Candidates, count: int) -> list[int]:
    """The `count` best nodes by cumulative log-probability, in drafting order (SGLang sorts its top-k indices).

    A child's score is its parent's plus a log-probability <= 0, so with ties going to the earlier (shallower)
    node every selected node's parent is selected too.
    """
    chosen = sorted(sorted(range(len(tree.tokens)), key=lambda n: (-tree.scores[n], n))[:count])
    kept = set(chosen)
    assert all(tree.parents[n] == -1 or tree.parents[n] in kept for n in chosen), "the selected tree is not ancestor-closed"
    return chosen


@dataclass
class VerifyTree:
    """What the target verifies: [current, *selected nodes], each node's parent as an index into this list."""

    tokens: list[int]
    parents: list[int]  # -1 for the current token
    depths: list[int]  # 0 for the current token

    @classmethod
    def of(cls, current: int, tree: Candidates, chosen: list[int]) -> VerifyTree:
        row = {-1: 0, **{node: i + 1 for i, node in enumerate(chosen)}}
        return cls(
            [current] + [tree.tokens[n] for n in chosen],
            [-1] + [row[tree.parents[n]] for n in chosen],
            [0] + [tree.depths[n] for n in chosen],
        )


def tree_mask(parents: list[int]) -> torch.Tensor:
    """(n, n) bool, True where row i may attend to column j: j is i or one of its ancestors (parents precede children)."""
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent != -1:
            mask[i] |= mask[parent]
    return mask


def accept_path(tree: VerifyTree, predicted: list[int]) -> list[int]:
    """Rows of the longest root-to-leaf path whose every token is the target's prediction after its parent."""
    agreed, best = [True], 0
    for i in range(1, len(tree.tokens)):
        parent = tree.parents[i]
        agreed.append(agreed[parent] and tree.tokens[i] == predicted[parent])
        if agreed[i] and tree.depths[i] > tree.depths[best]:
            best = i
    path = []
    while best > 0:
        path.append(best)
        best = tree.parents[best]
    return path[::-1]


class TreeDraftSession(Protocol):
    """What tree decoding needs from a drafter: the chain's extend, and a tree instead of a chain."""

    aux_layer_ids: list[int]

    def extend(self, aux_hidden: torch.Tensor, next_ids: list[int], start: int) -> None: ...

    def draft_tree(self, shape: TreeShape) -> Candidates: ...


class Eagle3Tree(Eagle3Chain):
    """An Eagle3Drafter session drafting trees; `extend` is the chain's, so its cache only ever holds accepted positions.

    The tree's keys and values live beside the cache for one round and are dropped; the next extend computes the
    accepted positions from the target's features instead, as SGLang's draft-extend does.
    """

    def draft_tree(self, shape: TreeShape) -> Candidates:
        if shape.topk > self.drafter.shape.draft_vocab_size:
            raise ValueError(f"--speculative-eagle-topk {shape.topk} exceeds the draft vocabulary ({self.drafter.shape.draft_vocab_size})")
        self.slots, self.tree_keys, self.tree_values = [], None, None  # the frontier nodes run this round, their k and v
        self.outs = {-1: self.out[0, -1]}  # pre-norm output per node; the root's is the last extended position's
        first = torch.log_softmax(self.logits[0, -1].float(), dim=-1)
        return grow_tree(shape, first, self._expand, self.drafter.draft_ids_to_target)

    def _expand(self, tree: Candidates, nodes: list[int]) -> torch.Tensor:
        """One drafter step over the frontier: own output at the parent, embedding of the node, position prefix + depth.

        A node sees exactly its ancestors. SGLang's draft kernels give frontier lane b the keys lane b wrote at earlier
        steps (generate_draft_decode_kv_indices): the same when K = 1, not always once the frontier is re-ranked.
        """
        drafter, attention = self.drafter, self.drafter.midlayer.self_attn
        hidden = torch.stack([self.outs[tree.parents[n]] for n in nodes])[None]  # (1, K, H)
        ids = torch.tensor([[tree.tokens[n] for n in nodes]], device=self.device)
        positions = torch.tensor([[self.last + tree.depths[n] for n in nodes]], device=self.device)
        x, cos, sin = drafter.layer_inputs(hidden, ids, positions)
        q, k, v = attention.project(x, cos, sin)
        self.slots += nodes
        self.tree_keys = k if self.tree_keys is None else torch.cat([self.tree_keys, k], dim=2)
        self.tree_values = v if self.tree_values is None else torch.cat([self.tree_values, v], dim=2)
        # Each node sees the whole cache, then among this round's slots only its ancestors and itself: one key block,
        # laid out as the chain's cache would be, so K = 1 reproduces Eagle3Chain.draft exactly.
        ancestry = [set(tree.path(n)) for n in nodes]
        own = torch.tensor([[slot in path for slot in self.slots] for path in ancestry], device=self.device)
        mask = torch.cat([torch.ones(len(nodes), len(self.cache), dtype=torch.bool, device=self.device), own], dim=1)
        keys, values = torch.cat([self.cache.keys, self.tree_keys], dim=2), torch.cat([self.cache.values, self.tree_values], dim=2)
        out = drafter.layer_output(hidden, attention.attend(q, [(keys, values, mask[None, None])]))
        self.outs.update({n: out[0, i] for i, n in enumerate(nodes)})
        return torch.log_softmax(drafter.head(out)[0].float(), dim=-1)


class TreeVerifier(TransformersVerifier):
    """TransformersVerifier (its prefill) plus a tree verify and a cache that keeps one path of the tree."""

    def __init__(self, target, aux_layer_ids):
        super().__init__(target, aux_layer_ids)
        attention = getattr(target.config, "_attn_implementation", None)
        if attention not in ("sdpa", "eager"):  # these read a custom 4D mask; other kernels may not apply it
            raise ValueError(f"tree verification needs attn_implementation 'sdpa' or 'eager', the target uses {attention!r}")

    def verify_tree(self, tree: VerifyTree, position: int) -> tuple[list[int], torch.Tensor]:
        """(predicted[i]: the target's token after row i, aux (1, n, 3H)) for the tree's rows after `position` cached ones."""
        device, dtype = self.target.device, self.target.dtype
        assert self.cache.get_seq_length() == position, "the cache must hold exactly the accepted prefix"
        n = len(tree.tokens)
        visible = torch.cat([torch.ones(n, position, dtype=torch.bool), tree_mask(tree.parents)], dim=1)
        # Additive float mask: transformers passes a 4D mask through untouched, and eager and sdpa both add it.
        additive = lambda seen: torch.zeros(1, 1, n, position + n, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min).to(device)
        mask = additive(visible)
        config = self.target.config.get_text_config(decoder=True)
        window, layer_types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
        if window is not None and (layer_types is None or "sliding_attention" in layer_types):
            # Sliding-window layers count positions, and a tree row sits at position + its depth, not at its row.
            depths = torch.tensor(tree.depths)
            keys = torch.cat([torch.arange(position), position + depths])
            windowed = additive(visible & ((position + depths)[:, None] - keys[None] < window))
            # Layer types: the model takes one mask per type; Mistral (no types) slides every layer.
            mask = windowed if layer_types is None else {"full_attention": mask, "sliding_attention": windowed}
        out = self.target(
            input_ids=torch.tensor([tree.tokens], device=device),
            position_ids=torch.tensor([[position + d for d in tree.depths]], device=device),
            attention_mask=mask,
            **{cache_keyword(self.target): self.cache},
            use_cache=True,
            output_hidden_states=True,
        )
        return out.logits[0].argmax(-1).tolist(), self._aux(out)

    def keep_rows(self, position: int, rows: list[int]) -> None:
        """Keep the prefix and these rows of the last tree, in order: the cache then is what a causal decode of the path gives.

        Gathering, not cropping and re-running the path: a row's keys and values depend only on its ancestors and its
        position, which are those of the path, so the gather is exact and costs no target forward.
        """
        index = torch.cat([torch.arange(position), position + torch.tensor(rows)]).to(self.target.device)
        for layer in self.cache.layers:
            if not isinstance(layer, DynamicLayer) or layer.is_sliding:
                raise TypeError(f"tree decoding gathers full-attention DynamicCache layers, not {type(layer).__name__}")
            layer.keys, layer.values = layer.keys.index_select(-2, index), layer.values.index_select(-2, index)


@torch.inference_mode()
def tree_speculative_decode(
    target,
    drafter: Eagle3Drafter | TreeDraftSession,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids,
    steps: int,
    topk: int,
    draft_tokens: int,
) -> SpecResult:
    """Greedy tree speculative decoding with SGLang's (S, K, N); the output equals greedy_decode's token for token.

    accepted_per_position[d]: rounds in which a node at depth d + 1 was accepted.
    """
    shape = TreeShape(steps, topk, draft_tokens)
    session = Eagle3Tree(drafter) if isinstance(drafter, Eagle3Drafter) else drafter
    verifier = TreeVerifier(target, session.aux_layer_ids)
    start_time = time.perf_counter()
    first, aux = verifier.prefill(prompt_ids)
    tokens = [first]
    forwards, lengths, accepted_per_depth = 1, [], [0] * steps
    pending = (aux, list(prompt_ids[1:]) + tokens, 0)  # as in common.speculative_rounds
    while not finished(tokens, max_new_tokens, stop_ids):
        current_position = len(prompt_ids) + len(tokens) - 1  # tokens[-1] is not in the target cache yet

        # Draft: the drafter takes the accepted positions' features, then grows a tree and N - 1 nodes are chosen.
        session.extend(*pending)
        candidates = session.draft_tree(shape)
        tree = VerifyTree.of(tokens[-1], candidates, select_nodes(candidates, draft_tokens - 1))

        # Verify: the whole tree in one target forward; predicted[i] is the target's token after row i.
        predicted, aux = verifier.verify_tree(tree, current_position)
        forwards += 1

        # Accept: the longest agreeing path, then the target's own token after its last node (the bonus).
        path = accept_path(tree, predicted)
        for depth in range(len(path)):
            accepted_per_depth[depth] += 1
        new = [tree.tokens[row] for row in path] + [predicted[path[-1] if path else 0]]
        emitted = emit(tokens, new, max_new_tokens, stop_ids)
        tokens += emitted
        lengths.append(len(emitted))
        rows = [0, *path]  # the current token and the accepted nodes
        verifier.keep_rows(current_position, rows)
        pending = (aux[:, rows], new, current_position)

    return SpecResult(tokens, time.perf_counter() - start_time, forwards, lengths, accepted_per_depth)
