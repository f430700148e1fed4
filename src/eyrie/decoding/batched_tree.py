"""SGLang's (S, K, N) draft trees for every row of a batch, on the batched drafter cache (eyrie.decoding.batched_speculative).

The round eyrie.decoding.static_tree runs at batch 1, with every tensor given a leading row dimension:

  extend  the chain's extend (ChainDrafts.extend): the target's features of the last round's path, S + 1 rows.
  grow    step 1 takes each row's top K after the current token; steps 2..S run the K frontier nodes of every row in
          one drafter forward (position last + depth), writing K/V to the round's tree slots (after the extend's) and
          seeing the row's kept prefix, their ancestors among the tree slots and themselves; their K^2 children are
          scored by cumulative log-probability and the best K become the frontier (stable sorts: ties to the earlier).
  select  the N - 1 best nodes by cumulative score, in drafting order, after the current token: a Proposal (tokens,
          parent rows, depths, ancestry) that BatchedSpeculative verifies and accepts as it does a chain.

A child's score never exceeds its parent's (log-probabilities are <= 0) and ties go to the earlier node, so every
chosen node's parent is chosen too, as at batch 1. All shapes are fixed by (R, S, K, N): a round is one CUDA graph.
"""

from __future__ import annotations

import torch

from eyrie.decoding.batched_greedy import BatchedRows
from eyrie.decoding.batched_speculative import ChainDrafts, Proposal
from eyrie.decoding.static_common import span_for
from eyrie.decoding.topk import top_k
from eyrie.decoding.tree import TreeShape
from eyrie.drafter.model import Eagle3Drafter


class TreeDrafts(ChainDrafts):
    """Draft trees of one shape for every row: the chain's buffers and extend, then the tree's growth and selection."""

    def __init__(self, engine: BatchedRows, drafter: Eagle3Drafter, shape: TreeShape):
        super().__init__(engine, drafter)
        if shape.topk > drafter.shape.draft_vocab_size:
            raise ValueError(f"--speculative-eagle-topk {shape.topk} exceeds the draft vocabulary ({drafter.shape.draft_vocab_size})")
        self.shape = shape
        S, K = shape.steps, shape.topk
        self.tree_slots = max(K * (S - 1), 1)  # the frontier's K/V slots: K per depth after the first
        depths = [1] * K + [d for d in range(2, S + 1) for _ in range(K * K)]  # step 1's K, then each step's K^2 children
        self.node_depths = torch.tensor(depths, device=self.device)

    def steps(self, k: int) -> int:
        return self.shape.steps

    def rows_per_round(self, k: int) -> tuple[int, int]:
        """(target slots, drafter slots) a round writes: the N verified rows; the extend's S + 1, then the tree slots."""
        return self.shape.draft_tokens, self.shape.steps + 1 + self.tree_slots

    def allocate(self, capacity: int, k: int) -> None:
        super().allocate(capacity, self.shape.steps)  # the extend takes the path's S + 1 rows

    def span(self, k: int) -> int:
        return span_for(self.host_slot + self.rows_per_round(k)[1], self.capacity)

    def _top(self, out, k: int):
        """(log-probabilities, target ids) of the k likeliest draft tokens after each row of out (R, M, H): (R, M, k) each."""
        rows, width, _ = out.shape
        scores, ids = top_k(torch.log_softmax(self.drafter.head(out).float(), dim=-1).flatten(0, 1), k)
        return scores.view(rows, width, k), self.drafter.draft_ids_to_target(ids).view(rows, width, k)

    def draft(self, k: int, span: int) -> Proposal:
        S, K, N = self.shape.steps, self.shape.topk, self.shape.draft_tokens
        out, last = self.extend(span)
        scores, tokens = (t[:, 0] for t in self._top(out, K))  # step 1: the root's top K, (R, K) each
        rows, hidden_size = out.shape[0], out.shape[-1]
        hidden = out.expand(-1, K, -1)
        root = torch.full_like(tokens, self.shape.nodes)  # the root's node index: row 0 of the verify
        nodes = torch.arange(K, device=self.device).expand(rows, -1)
        tree_base = self.slot + (S + 1)
        relative = self.slots[:span] - tree_base  # (span,): which tree slot a drafter cache slot is, if any
        in_tree = (relative >= 0) & (relative < self.tree_slots)
        column = relative.clamp(0, self.tree_slots - 1)[None, None].expand(rows, K, -1)
        ancestry = torch.zeros(rows, K, self.tree_slots, dtype=torch.bool, device=self.device)  # tree slots each node sees
        frontier = torch.arange(K, device=self.device)
        drafted, parents, all_scores = [tokens], [root], [scores]
        for depth in range(1, S):
            own_slots = (depth - 1) * K + frontier  # (K,): this depth's tree slots
            own = own_slots[:, None] == torch.arange(self.tree_slots, device=self.device)[None]  # (K, tree slots): its own slot
            seen = ancestry | own
            visible = self.valid[:, None, :span] | (seen.gather(2, column) & in_tree)
            out = self._forward(hidden, tokens, (last + depth)[:, None].expand(-1, K), tree_base + own_slots, visible)  # (R, K, H)
            top, children = self._top(out, K)  # (R, K, K)
            cumulative = (scores[:, :, None] + top).flatten(1)  # (R, K^2), frontier-major
            child_tokens = children.flatten(1)
            drafted.append(child_tokens)
            parents.append(nodes.repeat_interleave(K, dim=1))
            all_scores.append(cumulative)
            best = torch.sort(-cumulative, dim=1, stable=True).indices[:, :K]  # (R, K): ties to the earlier child
            owner = best // K
            hidden = out.gather(1, owner[:, :, None].expand(-1, -1, hidden_size))
            ancestry = seen.gather(1, owner[:, :, None].expand(-1, -1, self.tree_slots))
            scores, tokens = cumulative.gather(1, best), child_tokens.gather(1, best)
            nodes = K + (depth - 1) * K * K + best
        self.slot.add_(S + 1)  # past the extend: the tree slots after it are scratch, reused next round
        return self._select(torch.cat(drafted, 1), torch.cat(parents, 1), torch.cat(all_scores, 1), N, S)

    def _select(self, tokens, parents, scores, count: int, steps: int) -> Proposal:
        """The count - 1 best nodes by cumulative score, in drafting order, after the current token (row 0)."""
        rows = tokens.shape[0]
        chosen = torch.sort(torch.sort(-scores, dim=1, stable=True).indices[:, : count - 1], dim=1).values  # (R, N - 1)
        verify_rows = torch.arange(1, count, device=self.device).expand(rows, -1)
        row_of = torch.zeros(rows, self.shape.nodes + 1, dtype=torch.long, device=self.device).scatter_(1, chosen, verify_rows)
        zero = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        verify_parents = torch.cat([zero, row_of.gather(1, parents.gather(1, chosen))], dim=1)  # (R, N); the root's children: row 0
        depths = torch.cat([zero, self.node_depths[chosen]], dim=1)
        eye = torch.eye(count, dtype=torch.bool, device=self.device).expand(rows, -1, -1)
        ancestry = eye
        for _ in range(steps):  # depth <= S: S rounds of "my ancestors are my parent's and my parent"
            ancestry = eye | ancestry.gather(1, verify_parents[:, :, None].expand(-1, -1, count))
        return Proposal(tokens.gather(1, chosen), verify_parents, depths, ancestry, steps)
