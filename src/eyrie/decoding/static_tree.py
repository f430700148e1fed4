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
from eyrie.decoding.static import StaticLlama
from eyrie.decoding.static_common import compiled_pieces, needed_capacity, rotary_at, round_up, span_for, spans_up_to
from eyrie.decoding.static_drafter import StaticEagle3
from eyrie.decoding.tree import TreeShape
from eyrie.drafter.model import Eagle3Drafter


class StaticTree:
    """The buffers and graphs of tree rounds of one shape, for one drafter on one target.

    With the target's compile=True the verify's layers run fused like greedy steps and chain rounds (two compiled
    pieces per layer, shared by every layer and span, eyrie.decoding.static.StaticLlama.step_function), and so does
    the tree's own work, in pieces of fixed shapes: the extend with the root's top-K; a frontier step (the drafter's
    layer with its cache writes, attention, output, top-K, scores and sort: one piece, whatever the depth, as depths
    differ only in tensors passed in); the selection of the verified nodes with their masks; the accept with the next
    round's buffers. The target's attention and embedding and the accepted path's K/V move stay eager. At batch 1
    nearly every kernel costs ~2 us on an H200 however little it does, so fewer kernels is what pays; a frontier step
    is ~39 kernels, a quarter of them matrix products. Inductor took minutes over a whole tree round on the CPU, which
    is why the round is cut into pieces.
    """

    PIECES = ("_extend_top", "_step", "_select", "_accept")

    def __init__(self, drafter: StaticEagle3, shape: TreeShape):
        if shape.topk > drafter.drafter.shape.draft_vocab_size:
            raise ValueError(f"--speculative-eagle-topk {shape.topk} exceeds the draft vocabulary ({drafter.drafter.shape.draft_vocab_size})")
        self.drafter, self.target, self.shape = drafter, drafter.target, shape
        S, K, N = shape.steps, shape.topk, shape.draft_tokens
        device, target = drafter.device, drafter.target
        attention = drafter.drafter.midlayer.self_attn
        # The frontier's K/V slots: K per depth after the first, padded to a multiple of 8 (never visible). The softmax
        # over the prefix and these slots is sliced per block, and a row stride that is not a multiple of 8 bf16 values
        # sent the drafter's products over them to cuBLAS's unaligned kernels (cutlass "align2": 62 us in 15 calls per
        # (6, 10, 48) round on an H200, benchmarks/decode_floor.py --profile-round).
        nodes, tree_slots = shape.nodes, round_up(max(K * (S - 1), 1), 8)
        self.ext_aux = torch.zeros(1, S + 1, 3 * drafter.drafter.shape.target_hidden_size, device=device, dtype=target.dtype)
        self.ext_ids = torch.zeros(1, S + 1, dtype=torch.long, device=device)
        self.ext_start = torch.zeros(1, dtype=torch.long, device=device)
        self.ext_last = torch.zeros(1, dtype=torch.long, device=device)
        self.tree_keys = torch.zeros(1, attention.heads, tree_slots, attention.head_dim, device=device, dtype=drafter.dtype)
        self.tree_values = torch.zeros_like(self.tree_keys)
        # Constant layout of the drafted nodes: step 1's K, then each later step's K^2 children, frontier-major.
        depths = [1] * K + [d for d in range(2, S + 1) for _ in range(K * K)]
        self.node_depths = torch.tensor(depths, device=device)
        self.eye = torch.eye(max(K, N), dtype=torch.bool, device=device)
        self.rows = torch.arange(N, device=device)
        self.depth_range = torch.arange(1, S + 1, device=device)
        self.root = self.rows == 0
        # Per frontier step (depth 1..S-1), tensors of one shape, so the step's piece compiles once for every depth:
        # the position offset, the tree slots the frontier writes (visible to itself), the index of its first child.
        slot = torch.arange(tree_slots, device=device)
        slot_depth = slot // K + 1  # the depth whose frontier owns a tree slot (S and beyond: padding, owned by none)
        node_slot = slot[None, :] % K == torch.arange(K, device=device)[:, None]  # (K, tree slots): each node's slot at every depth
        self.frontier_depth = [torch.full((K,), depth, device=device) for depth in range(1, S)]
        self.own_slots = [node_slot & (slot_depth == depth)[None] for depth in range(1, S)]
        self.child_offset = [torch.full((1,), K + (depth - 1) * K * K, device=device) for depth in range(1, S)]
        self.frontier_slots = [torch.arange((depth - 1) * K, depth * K, device=device) for depth in range(1, S)]
        # Step 1's frontier: the root's K children, whose parent is `nodes` (row_of[nodes] is row 0, the current
        # token), node indices 0..K-1, no ancestors among the tree slots.
        self.root_parents = torch.full((K,), nodes, device=device)
        self.first_nodes = torch.arange(K, device=device)
        self.no_ancestry = torch.zeros(K, tree_slots, dtype=torch.bool, device=device)
        self.extend_offsets = torch.arange(S + 1, device=device)
        self.round_out = torch.zeros(S + 2, dtype=torch.long, device=device)  # [accepted, *tokens of the path and the bonus]
        self.graphs: dict[int, Replay] = {}
        self.nodes = nodes
        self._fused = compiled_pieces(self, self.PIECES, target.compile_mode) if target.compile else {}

    def piece(self, name: str, *args):
        """This tree's piece `name`, fused or eager as the drafter's pieces are (StaticEagle3.piece)."""
        return self.drafter.piece(name, *args, owner=self)

    # ---- drafting

    def _extend_top(self, aux, ids, start, last_row, offsets, *cache):
        """The extend (StaticEagle3._extend), then the root's top K: (step 1's frontier: the root's output for each
        of the K nodes (1, K, H), cumulative scores (K,), target ids (K,); the root's position (1,))."""
        out_root, last = self.drafter._extend(aux, ids, start, last_row, offsets, *cache)
        scores, ids = (top[0] for top in self.drafter._top(out_root, self.shape.topk))
        frontier = out_root.expand(1, self.shape.topk, -1).contiguous()  # contiguous: every depth's _step compiles once
        return frontier, scores, self.drafter.drafter.draft_ids_to_target(ids), last

    def _step(self, hidden, tokens, last, depth, own_slot_ids, prefix_keys, prefix_values, prefix_slots, cos_table, sin_table,
              tree_keys, tree_values, ancestry, own, scores, nodes, child_offset):
        """One frontier step: the K frontier nodes (outputs at their parents hidden (1, K, H), target ids `tokens`
        (K,), at position last + depth) run the drafter's layer, writing their K/V to tree slots `own_slot_ids`, and
        attend to the accepted prefix (the drafter's whole cache, masked by position), their ancestors (`ancestry`
        (K, tree slots)) and themselves (`own`); their top-K children are scored. Returns every child (target ids,
        parent nodes, cumulative scores: (K^2,) each, frontier-major) and the next frontier: the best K children by
        cumulative score, ties to the earlier (stable sort), as (hidden, ancestry, scores, nodes, target ids)."""
        K, drafter = self.shape.topk, self.drafter.drafter
        positions = last + depth
        rotary = rotary_at(cos_table, sin_table, positions)
        x, cos, sin = drafter.layer_inputs(hidden, tokens[None], positions[None], rotary)
        q, k, v = self.drafter.products.project(x, cos, sin)  # (1, h, K, hd)
        tree_keys.index_copy_(2, own_slot_ids, k)
        tree_values.index_copy_(2, own_slot_ids, v)
        seen = (prefix_slots <= last)[None, None, None, :].expand(1, 1, K, prefix_slots.shape[0])
        blocks = [(prefix_keys, prefix_values, seen), (tree_keys, tree_values, (ancestry | own)[None, None])]
        out = self.drafter.products.layer_output(hidden, drafter.midlayer.self_attn.attend(q, blocks))
        top, child_ids = self.drafter._top(out, K)  # (K, K)
        cumulative = (scores[:, None] + top).flatten()
        child_tokens = drafter.draft_ids_to_target(child_ids).flatten()
        parents = nodes.repeat_interleave(K)
        best = torch.sort(-cumulative, stable=True).indices[:K]  # children index i * K + j; ties to the earlier
        owner = best // K
        return (child_tokens, parents, cumulative,
                out.index_select(1, owner), (ancestry | own).index_select(0, owner), cumulative.index_select(0, best),
                child_offset + best, child_tokens.index_select(0, best))

    def _grow(self, frontier, scores, tokens, last):
        """(target ids, parent node (`nodes` for the root), cumulative log-probability) of every node in drafting
        order, each as a list of one tensor per depth; from step 1's frontier (_extend_top)."""
        hidden, ancestry, nodes = frontier, self.no_ancestry, self.first_nodes
        drafted, parents, all_scores = [tokens], [self.root_parents], [scores]
        for depth in range(1, self.shape.steps):
            step = self.piece("_step", hidden, tokens, last, self.frontier_depth[depth - 1], self.frontier_slots[depth - 1],
                              *self.drafter.cache, self.tree_keys, self.tree_values, ancestry, self.own_slots[depth - 1],
                              scores, nodes, self.child_offset[depth - 1])
            for column, value in zip((drafted, parents, all_scores), step[:3]):
                column.append(value)
            hidden, ancestry, scores, nodes, tokens = step[3:]
        return drafted, parents, all_scores

    # ---- the round

    def _select(self, tokens, parents, scores, token, current, slots):
        """The verify's inputs from the drafted nodes (tokens, parents, scores: lists of one tensor per depth, as
        _grow returns them): the N - 1 best by cumulative score, in drafting order, after the current token `token`
        (1, 1) at position `current` (1,). Returns (ids (1, N), cache slots (N,): current + row, parent row of each
        row (row 0 is its own), depth of each row, ancestry (N, N), mask over all cache slots `slots` (group * N,
        capacity), cos and sin (1, 1, N, hd) at position current + depth). The verify takes the mask's span columns,
        so that this piece compiles once per shape rather than once per span."""
        S, N, target = self.shape.steps, self.shape.draft_tokens, self.target
        tokens, parents, scores = torch.cat(tokens), torch.cat(parents), torch.cat(scores)
        chosen = torch.sort(torch.sort(-scores, stable=True).indices[: N - 1]).values
        row_of = torch.zeros(self.nodes + 1, dtype=torch.long, device=tokens.device)  # [nodes] (the root) stays row 0
        row_of[chosen] = self.rows[1:]
        verify_tokens = torch.cat([token[0], tokens.index_select(0, chosen)])  # (N,)
        verify_parents = torch.cat([self.rows[:1], row_of.index_select(0, parents.index_select(0, chosen))])
        verify_depths = torch.cat([self.rows[:1], self.node_depths.index_select(0, chosen)])
        ancestry = self.eye[:N, :N]
        for _ in range(S):  # depth <= S: S rounds of "my ancestors are my parent's and my parent"
            ancestry = self.eye[:N, :N] | ancestry.index_select(0, verify_parents)
        # Row r writes slot current + r and is rotated to position current + depth; it sees the prefix and its ancestors.
        relative = slots - current  # (capacity,)
        in_tree = (relative >= 0) & (relative < N)
        tree_row = relative.clamp(0, N - 1)
        visible = (relative < 0)[None] | (ancestry.index_select(1, tree_row) & in_tree[None])  # (N, capacity)
        positions = current + verify_depths
        distance = None
        if target.windowed:  # sliding windows count positions: a tree slot holds position current + its row's depth
            key_positions = torch.where(relative < 0, slots, current + verify_depths.index_select(0, tree_row))
            distance = (positions[:, None] - key_positions[None])[None]
        mask = target.masks_for(visible[None], distance)
        return verify_tokens[None], current + self.rows, verify_parents, verify_depths, ancestry, mask, target.rope_at(positions[None])

    def _accept(self, verify_tokens, predicted, verify_parents, verify_depths, ancestry, aux, current):
        """The deepest row whose whole path the target agrees with (the first at that depth), then the bonus; the next
        round's inputs (the extend's buffers, the target's token and position, round_out) are written here. Returns
        the cache slots the accepted path's K/V move from and to, (S,) each (past `accepted`: padding)."""
        S, target = self.shape.steps, self.target
        agreed = self.root
        for _ in range(S):  # row 0 is its own parent: `| root` keeps it agreed (no host scalar inside a graph)
            agreed = ((verify_tokens == predicted.index_select(0, verify_parents)) & agreed.index_select(0, verify_parents)) | self.root
        best = (verify_depths * agreed).argmax().view(1)  # the first of the deepest agreeing rows; row 0 when none agrees
        accepted = verify_depths.index_select(0, best)  # (1,): index_select, as a 0-d index would sync with the host
        on_path = ancestry.index_select(0, best)[0]
        depth_rows = (on_path[None] & (verify_depths[None] == self.depth_range[:, None])).long().argmax(1)
        path = torch.cat([self.rows[:1], depth_rows])  # (S + 1,): rows of depths 0..S (past `accepted`: padding)
        new = predicted.index_select(0, path)  # the path's own tokens, then the bonus
        moved = current + path[1:], current + self.depth_range  # before `current` (the target's position) moves on
        self.ext_aux.copy_(aux.index_select(1, path))
        self.ext_ids.copy_(new[None])
        self.ext_start.copy_(current)
        self.ext_last.copy_(accepted)
        target.token.copy_(new.index_select(0, accepted)[None])
        target.position.add_(accepted + 1)
        self.round_out[:1].copy_(accepted)
        self.round_out[1:].copy_(new)
        return moved

    def _round(self, span: int) -> None:
        target, drafter = self.target, self.drafter
        # Extend: the accepted positions' target features (rows past ext_last are padding the tree never sees).
        frontier, scores, tokens, last = self.piece("_extend_top", self.ext_aux, self.ext_ids, self.ext_start, self.ext_last,
                                                    self.extend_offsets, *drafter.cache)
        drafted = self._grow(frontier, scores, tokens, last)
        # A copy: compiled, _accept moves target.position on in place, and inductor read an argument that aliased it
        # after the move, so the next round's extend started accepted + 1 positions late (lossless, but fewer drafts
        # accepted: a (3, 2, 6) tree 1.22 where eager rounds accept 1.39, tests/decoding/test_static_tree.py).
        current = target.position.clone()
        ids, slots, verify_parents, verify_depths, ancestry, mask, rope = self.piece("_select", *drafted, target.token, current, target.slots)
        x, aux = target.run_layers(ids, slots, rope, mask, span, aux_layers=drafter.aux_layers, normed=False)
        predicted = target.head(x)[0]  # (N,): the target's token after each row
        moved_from, moved_to = self.piece("_accept", ids[0], predicted, verify_parents, verify_depths, ancestry, aux, current)
        target.move_slots(moved_from, moved_to)  # the path's K/V to slots current + 1.., every layer at once

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
