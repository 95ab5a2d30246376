"""Suffix decoding proposer (Oliaro et al. 2024, "SuffixDecoding", arXiv:2411.04975; vLLM's
``suffix`` method).

Two token tries of bounded depth ``D`` (``suffix_decoding_max_tree_depth``) hold every
substring of length <= D of their text, each node counting how often its substring occurred:

* a per-request trie over the request's prompt and output so far;
* a global trie over the outputs of the most recent finished requests (at most
  ``suffix_decoding_max_cached_requests`` of them; the oldest is removed, counts and all, when a
  new one comes in).

Every step a request's pattern is the longest tail of its context (at most ``D - 1`` tokens)
that occurred before with a continuation. From the pattern's node the draft follows the most
frequent child while the product of the branch frequencies (child count / sum of the children's
counts) stays >= ``suffix_decoding_min_token_prob``, for at most
``min(num_speculative_tokens, max_spec_factor * pattern length)`` tokens. The tree (request or
global) whose draft has the larger expected accepted length wins.

The per-request trie keeps the "active" nodes (one per suffix length of the text inserted so
far), so an appended token costs O(D) dict steps and the pattern nodes are ready without a walk.

The reference implementation (Arctic Inference) is a C++ extension shipped only as a source
distribution that needs a compiler toolchain; this pure-Python version keeps the same
parameters and behaviour for this engine's scale.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Counts every substring of length <= ``max_depth`` of the sequences added to it.

    Args:
        max_depth: longest substring stored (``D``).

    Attributes:
        num_nodes: nodes in the trie, root excluded (the memory bound's unit).
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 0
        # Nodes of the suffixes (lengths 1..D) of the stream appended so far, shortest first.
        self._active: list[_Node] = []

    def append(self, token: int) -> None:
        """Extend the current stream by one token (updates every suffix's node)."""
        nxt = []
        for node in [self.root] + self._active[:self.max_depth - 1]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
                self.num_nodes += 1
            child.count += 1
            nxt.append(child)
        self._active = nxt

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(t)

    def end_stream(self) -> None:
        """Start a new, independent stream (the next token has no left context)."""
        self._active = []

    def remove_sequence(self, tokens: Sequence[int]) -> None:
        """Undo ``extend(tokens)`` of a whole stream: decrement every substring's count and
        drop nodes that reach zero."""
        n = len(tokens)
        for start in range(n):
            node = self.root
            path = []
            for t in tokens[start:start + self.max_depth]:
                child = node.children.get(t)
                if child is None:
                    break
                path.append((node, t, child))
                node = child
            for _parent, _t, child in path:
                child.count -= 1
            for parent, t, child in reversed(path):
                if child.count <= 0 and parent.children.get(t) is child:
                    del parent.children[t]
                    self.num_nodes -= _subtree_size(child)

    def active_node(self, length: int) -> Optional[_Node]:
        """Node of the current stream's suffix of ``length`` tokens (1-based), or None."""
        return self._active[length - 1] if 0 < length <= len(self._active) else None

    def find(self, pattern: Sequence[int]) -> Optional[_Node]:
        """Node of ``pattern`` (walk from the root), or None."""
        node = self.root
        for t in pattern:
            node = node.children.get(t)
            if node is None:
                return None
        return node


def _subtree_size(node: _Node) -> int:
    n, stack = 0, [node]
    while stack:
        x = stack.pop()
        n += 1
        stack.extend(x.children.values())
    return n


def _expand(node: _Node, max_len: int, min_prob: float) -> tuple[list[int], float]:
    """Greedy most-frequent-child walk; returns (draft, expected accepted tokens)."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while len(draft) < max_len and node.children:
        total = sum(c.count for c in node.children.values())
        tok, child = max(node.children.items(), key=lambda kv: kv[1].count)
        prob *= child.count / total
        if prob < min_prob:
            break
        draft.append(tok)
        score += prob
        node = child
    return draft, score


class SuffixProposer:
    """Drafts from suffix tries (see the module docstring).

    Args:
        num_speculative_tokens: most drafts per step.
        max_tree_depth: trie depth ``D`` (vLLM ``suffix_decoding_max_tree_depth``, 24).
        max_cached_requests: finished outputs kept in the global trie (vLLM
            ``suffix_decoding_max_cached_requests``); 0 disables the global trie.
        max_spec_factor: drafts <= this times the pattern length.
        min_token_prob: stop drafting when the estimated probability falls below it.
    """

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int = 24,
                 max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1) -> None:
        self.k = num_speculative_tokens
        self.depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        # req_id -> (its trie, tokens inserted, index where its output starts)
        self._local: dict[str, tuple[SuffixTrie, list[int], int]] = {}
        self.global_trie = SuffixTrie(max_tree_depth)
        # req_id -> output tokens held in the global trie (oldest first).
        self._cached: OrderedDict[str, list[int]] = OrderedDict()

    # ------------------------------------------------------------------ state
    def _sync(self, req_id: str, token_ids: Sequence[int], prompt_len: int) -> SuffixTrie:
        st = self._local.get(req_id)
        if st is None or len(st[1]) > len(token_ids):
            st = (SuffixTrie(self.depth), [], prompt_len)
            self._local[req_id] = st
        trie, seen, _ = st
        if len(seen) < len(token_ids):
            new = token_ids[len(seen):]
            trie.extend(new)
            seen.extend(new)
        return trie

    def propose(self, req_id: str, token_ids: Sequence[int], new_ids: Sequence[int],
                prompt_len: int, max_tokens: Optional[int] = None) -> list[int]:
        """Draft tokens to follow ``token_ids + new_ids``.

        Args:
            req_id: the request.
            token_ids: its committed tokens (prompt + output).
            new_ids: tokens sampled this step (not yet committed).
            prompt_len: prompt length (the output, from there, goes to the global trie).
            max_tokens: cap on the draft length.
        """
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        if k <= 0:
            return []
        # NOTE: new_ids are inserted too: the scheduler commits them unless a stop ends the
        # request, and then the request's trie is dropped anyway.
        trie = self._sync(req_id, list(token_ids) + list(new_ids), prompt_len)
        ctx_len = len(token_ids) + len(new_ids)
        best: tuple[list[int], float] = ([], 0.0)
        max_pat = min(self.depth - 1, ctx_len)
        for m in range(max_pat, 0, -1):
            node = trie.active_node(m)
            # The pattern's own (latest) occurrence has no continuation yet: it must have
            # occurred before for a child to exist.
            if node is not None and node.children:
                best = _expand(node, min(k, int(self.max_spec_factor * m) or 1, self.depth - m),
                               self.min_token_prob)
                break
        if self._cached:
            ctx = (list(token_ids) + list(new_ids))[-max_pat:]
            for m in range(len(ctx), 0, -1):
                node = self.global_trie.find(ctx[len(ctx) - m:])
                if node is not None and node.children:
                    cand = _expand(node, min(k, int(self.max_spec_factor * m) or 1, self.depth - m),
                                   self.min_token_prob)
                    if cand[1] > best[1]:
                        best = cand
                    break
        return best[0]

    def remove(self, req_id: str, finished: bool = True) -> None:
        """Drop a request's trie; a finished request's output joins the global trie (the
        oldest cached output is evicted past ``max_cached_requests``)."""
        st = self._local.pop(req_id, None)
        if st is None or not finished or self.max_cached_requests <= 0:
            return
        output = st[1][st[2]:]
        if not output:
            return
        self.global_trie.extend(output)
        self.global_trie.end_stream()
        self._cached[req_id] = output
        while len(self._cached) > self.max_cached_requests:
            _, old = self._cached.popitem(last=False)
            self.global_trie.remove_sequence(old)

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached)

    @property
    def num_requests(self) -> int:
        return len(self._local)
