"""Tree speculative decoding on the static KV cache: one CUDA-graph replay per round, SGLang's (S, K, N).

The same round as eyrie.decoding.tree (the host-built reference), with every shape fixed by (S, K, N) so the
whole round is one graph and the host reads one small tensor per round:

  extend  the drafter takes the target's features of the accepted positions (S + 1 rows, padded), as the chain does.
  grow    step 1 takes the top K after the current token; steps 2..S run the K frontier nodes in one drafter forward
          (own output at the parent, the node's token, position last + depth), each seeing the accepted prefix and,
          among this round's tree slots, its ancestors and itself; their top-K children (K^2) are scored by
          cumulative log-probability and the best K become the frontier. Ties go to the earlier node (stable sorts),
          as in the reference.
  verify  the N - 1 best nodes in drafting order after the current token, in one target forward: row r writes
          cache slot current + r, is rotated to position current + depth, and sees the prefix and its ancestors.
  accept  the deepest row whose whole path the target agrees with (the first at that depth), then the bonus; its
          path's K/V move to slots current + 1.. (one gather over every layer), so the cache is what a causal decode
          of the path gives, and the drafter's next extend gets the path's features.
"""

from __future__ import annotations

import functools
import time

import torch

from eyrie.decoding.common import SpecResult, emit, finished
from eyrie.decoding.graphs import Replay
from eyrie.decoding.static import StaticEagle3, StaticLlama, needed_capacity, span_for, spans_up_to
from eyrie.decoding.tree import TreeShape
from eyrie.drafter.model import Eagle3Drafter


class StaticTree:
    """The buffers and graphs of tree rounds of one shape, for one drafter on one target.

    With the target's compile=True the verify's layers run fused like greedy steps and chain rounds (two compiled
    pieces per layer, shared by every layer and span, eyrie.decoding.static.StaticLlama.step_function), and so do the
    drafter's tree steps: its layer in the chain's two pieces (for K rows instead of 1) and its head with the
    log-softmax and top-K in a third (StaticEagle3._top). The sorts, the masks and the accept stay eager inside the
    graph: inductor took minutes per setting over a whole tree round on the CPU.
    """

    def __init__(self, drafter: StaticEagle3, shape: TreeShape):
        if shape.topk > drafter.drafter.shape.draft_vocab_size:
            raise ValueError(f"--speculative-eagle-topk {shape.topk} exceeds the draft vocabulary ({drafter.drafter.shape.draft_vocab_size})")
        self.drafter, self.target, self.shape = drafter, drafter.target, shape
        S, K, N = shape.steps, shape.topk, shape.draft_tokens
        device, target = drafter.device, drafter.target
        attention = drafter.drafter.midlayer.self_attn
        nodes, tree_slots = shape.nodes, K * (S - 1)
        self.ext_aux = torch.zeros(1, S + 1, 3 * drafter.drafter.shape.target_hidden_size, device=device, dtype=target.dtype)
        self.ext_ids = torch.zeros(1, S + 1, dtype=torch.long, device=device)
        self.ext_start = torch.zeros(1, dtype=torch.long, device=device)
        self.ext_last = torch.zeros(1, dtype=torch.long, device=device)
        self.tree_keys = torch.zeros(1, attention.heads, max(tree_slots, 1), attention.head_dim, device=device, dtype=drafter.dtype)
        self.tree_values = torch.zeros_like(self.tree_keys)
        # Constant layout of the drafted nodes: step 1's K, then each later step's K^2 children, frontier-major.
        depths = [1] * K + [d for d in range(2, S + 1) for _ in range(K * K)]
        self.node_depths = torch.tensor(depths, device=device)
        self.eye = torch.eye(max(K, N), dtype=torch.bool, device=device)
        self.rows = torch.arange(N, device=device)
        self.depth_range = torch.arange(1, S + 1, device=device)
        self.root = self.rows == 0
        self.round_out = torch.zeros(S + 2, dtype=torch.long, device=device)  # [accepted, *tokens of the path and the bonus]
        self.graphs: dict[int, Replay] = {}
        self.nodes = nodes

    def _verify(self, ids, slots, cos, sin, mask, span: int):
        """(the target's token after each row (1, N), aux (1, N, 3H)) of a tree verify (see _round)."""
        hidden, aux = self.target.run_layers(ids, slots, cos, sin, mask, span, aux_layers=self.drafter.aux_layers)
        return self.target.model.lm_head(hidden).argmax(-1), aux

    # ---- drafting

    def _frontier_step(self, hidden, tokens, ancestry, last, depth: int, span: int):
        """Run the K frontier nodes at depth `depth`: (pre-norm outputs (1, K, H), their ancestry with their own slots)."""
        K, drafter = self.shape.topk, self.drafter.drafter
        attention = drafter.midlayer.self_attn
        q, k, v = self.drafter.piece("_inputs", hidden, tokens[None], (last + depth).expand(K))  # (1, h, K, hd)
        first = (depth - 1) * K  # this step's tree slots
        self.tree_keys[:, :, first : first + K] = k
        self.tree_values[:, :, first : first + K] = v
        ancestry = ancestry.clone()
        ancestry[:, first : first + K] = self.eye[:K, :K]
        seen = self.drafter.slots[None, None, None, :span] <= last  # (1, 1, 1, span): the accepted prefix
        blocks = [
            (self.drafter.keys[:, :, :span], self.drafter.values[:, :, :span], seen.expand(1, 1, K, span)),
            (self.tree_keys, self.tree_values, ancestry[None, None]),
        ]
        return self.drafter.piece("_outputs", hidden, attention.attend(q, blocks)), ancestry

    def _top(self, out):
        """(log-probabilities, draft ids) of the K likeliest draft tokens after each row of out (1, T, H): (T, K) each."""
        return self.drafter.piece("_top", out, self.shape.topk)

    def _grow(self, out_root, last, span: int):
        """(target ids, parent node (`nodes` for the root), cumulative log-probability) of every node, in drafting order."""
        S, K, drafter = self.shape.steps, self.shape.topk, self.drafter.drafter
        scores, ids = (top[0] for top in self._top(out_root))
        # The root's children get parent `nodes`: row_of[nodes] is row 0, the current token.
        tokens, parents, all_scores = [drafter.draft_ids_to_target(ids)], [torch.full_like(ids, self.nodes)], [scores]
        frontier = torch.arange(K, device=ids.device)  # node indices, best first
        hidden = out_root.expand(1, K, -1)
        ancestry = torch.zeros(K, self.tree_keys.shape[2], dtype=torch.bool, device=ids.device)
        offset = K  # index of the next node
        for depth in range(1, S):
            node_tokens = torch.cat(tokens).index_select(0, frontier)
            out, ancestry = self._frontier_step(hidden, node_tokens, ancestry, last, depth, span)
            top, child_ids = self._top(out)  # (K, K)
            cumulative = (torch.cat(all_scores).index_select(0, frontier)[:, None] + top).flatten()
            tokens.append(drafter.draft_ids_to_target(child_ids).flatten())
            parents.append(frontier.repeat_interleave(K))
            all_scores.append(cumulative)
            best = torch.sort(-cumulative, stable=True).indices[:K]  # children index i * K + j; ties to the earlier
            frontier, owner = offset + best, best // K
            hidden, ancestry = out[:, owner], ancestry.index_select(0, owner)
            offset += K * K
        return torch.cat(tokens), torch.cat(parents), torch.cat(all_scores)

    # ---- the round

    def _round(self, span: int) -> None:
        S, N = self.shape.steps, self.shape.draft_tokens
        target, drafter = self.target, self.drafter
        # Extend: the accepted positions' target features (rows past ext_last are padding the tree never sees).
        hidden = drafter.drafter.project_aux(self.ext_aux.to(drafter.dtype))
        out = drafter.forward(hidden, self.ext_ids, self.ext_start + torch.arange(S + 1, device=drafter.device), span)
        out_root = out.index_select(1, self.ext_last)  # (1, 1, H)
        last = self.ext_start + self.ext_last  # position whose next token is target.token

        tokens, parents, scores = self._grow(out_root, last, span)
        # Select the N - 1 best nodes, kept in drafting order; map parents to verify rows (0 = the current token).
        chosen = torch.sort(torch.sort(-scores, stable=True).indices[: N - 1]).values
        row_of = torch.zeros(self.nodes + 1, dtype=torch.long, device=tokens.device)  # [nodes] (the root) stays row 0
        row_of[chosen] = self.rows[1:]
        verify_tokens = torch.cat([target.token[0], tokens.index_select(0, chosen)])  # (N,)
        verify_parents = torch.cat([self.rows[:1], row_of[parents.index_select(0, chosen)]])  # row 0 is its own parent
        verify_depths = torch.cat([self.rows[:1], self.node_depths.index_select(0, chosen)])
        ancestry = self.eye[:N, :N].clone()
        for _ in range(S):  # depth <= S: S rounds of "my ancestors are my parent's and my parent"
            ancestry = self.eye[:N, :N] | ancestry.index_select(0, verify_parents)

        # Verify: slot current + r, rotated to current + depth; the prefix and the row's ancestors are visible.
        current = target.position
        slots = current + self.rows
        relative = target.slots[:span] - current  # (span,)
        in_tree = (relative >= 0) & (relative < N)
        mask = (relative < 0)[None] | (ancestry.index_select(1, relative.clamp(0, N - 1)) & in_tree[None])  # (N, span)
        mask = mask.repeat(target.heads // target.kv_heads, 1)
        positions = current + verify_depths
        cos, sin = target.cos[positions][None, None], target.sin[positions][None, None]
        predicted, aux = self._verify(verify_tokens[None], slots, cos, sin, mask, span)
        predicted = predicted[0]  # (N,)

        # Accept: agreed[r] = the target predicted row r after its parent, all the way up.
        agreed = self.root
        for _ in range(S):  # row 0 is its own parent: `| root` keeps it agreed (no host scalar inside a graph)
            agreed = ((verify_tokens == predicted.index_select(0, verify_parents)) & agreed.index_select(0, verify_parents)) | self.root
        best = (verify_depths * agreed).argmax().view(1)  # the first of the deepest agreeing rows; row 0 when none agrees
        accepted = verify_depths.index_select(0, best)  # (1,): index_select, as a 0-d index would sync with the host
        on_path = ancestry.index_select(0, best)[0]
        depth_rows = (on_path[None] & (verify_depths[None] == self.depth_range[:, None])).long().argmax(1)
        path = torch.cat([self.rows[:1], depth_rows])  # (S + 1,): rows of depths 0..S (past `accepted`: padding)

        # The path's K/V to slots current + 1.., every layer at once (index_select copies before the write).
        for cache in (target.keys, target.values):
            cache.index_copy_(3, current + self.depth_range, cache.index_select(3, current + path[1:]))
        new = predicted.index_select(0, path)  # the token after each path row: the path's own tokens, then the bonus
        self.ext_aux.copy_(aux.index_select(1, path))
        self.ext_ids.copy_(new[None])
        self.ext_start.copy_(current)
        self.ext_last.copy_(accepted)
        target.token.copy_(new.index_select(0, accepted)[None])
        target.position.add_(accepted + 1)
        self.round_out[:1].copy_(accepted)
        self.round_out[1:].copy_(new)

    def _graph_for(self, span: int) -> Replay:
        if span not in self.graphs:
            self.target.token.zero_()
            self.target.position.zero_()  # warm-ups write slots from 0, later overwritten by the prefill
            self.ext_start.zero_()
            self.ext_last.zero_()
            self.graphs[span] = Replay(functools.partial(self.target.step_function(self._round), span), self.target.use_graphs,
                                       self.target.capture_failures)
        return self.graphs[span]

    def decode(self, prompt_ids: list[int], max_new_tokens: int, stop_ids) -> SpecResult:
        start_time = time.perf_counter()
        S, target, drafter = self.shape.steps, self.target, self.drafter
        for span in spans_up_to(target.capacity):  # captured before the prefill: their warm-ups write cache slots
            self._graph_for(span)
        first, count = drafter.start(prompt_ids, self)
        tokens = [first]
        forwards, lengths, accepted_per_depth = 1, [], [0] * S
        reach = max(self.shape.draft_tokens, S + 1)  # slots a round writes past the current token
        while not finished(tokens, max_new_tokens, stop_ids):
            current = count + len(tokens) - 1
            self.graphs[span_for(current + reach, target.capacity)]()
            out = self.round_out.tolist()  # the round's one host sync
            accepted = out[0]
            forwards += 1
            for depth in range(accepted):
                accepted_per_depth[depth] += 1
            emitted = emit(tokens, out[1 : accepted + 2], max_new_tokens, stop_ids)
            tokens += emitted
            lengths.append(len(emitted))
        return SpecResult(tokens, time.perf_counter() - start_time, forwards, lengths, accepted_per_depth)


def tree_decode(target: StaticLlama, drafter: Eagle3Drafter, prompt_ids: list[int], max_new_tokens: int, stop_ids,
                steps: int, topk: int, draft_tokens: int) -> SpecResult:
    """Greedy tree speculative decoding on the static cache; equals greedy decoding token for token."""
    if not isinstance(drafter, Eagle3Drafter):
        raise TypeError(f"the static decoder drafts trees with an Eagle3Drafter, not {type(drafter).__name__}; "
                        "use eyrie.decoding.tree.tree_speculative_decode on the transformers model for drafter doubles")
    shape = TreeShape(steps, topk, draft_tokens)
    if topk == 1 and draft_tokens == steps + 1:  # a chain of S drafts: the chain's round drafts the same tokens, in fewer kernels
        return target.speculative_decode(drafter, prompt_ids, max_new_tokens, stop_ids, steps)
    target.ensure_capacity(needed_capacity(len(prompt_ids), max_new_tokens, max(draft_tokens, steps + 1)))
    static_drafter = target.drafter_for(drafter)
    if shape not in static_drafter.trees:
        static_drafter.trees[shape] = StaticTree(static_drafter, shape)
    return static_drafter.trees[shape].decode(prompt_ids, max_new_tokens, stop_ids)
