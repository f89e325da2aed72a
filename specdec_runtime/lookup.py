"""Drafts that need no training (issue 26): prompt lookup (`NgramDraft`, vLLM's `ngram`) and suffix decoding
(`SuffixDraft`, after SuffixDecoding, Oliaro et al. 2024), both proposed from tokens alone.

    generate(target, NgramDraft(prompt_lookup_max=4, prompt_lookup_min=2), prompts, num_draft_tokens=4)
    suffix = SuffixDraft()                     # keeps the responses of earlier calls: pass the same object again
    generate(target, suffix, prompts, num_draft_tokens=8)

A lookup proposes up to gamma tokens per row, or none (`lookup_step`). The target verifies the batch's longest
proposal and each row accepts at most its own (`sampling.verify`'s `limit`), so a row without a proposal decodes one
token exactly as target-only decoding does, and a step where no row proposes is a plain decode step (width 1). The
proposal is a function of the tokens so far: q is one-hot on it, rejection sampling stays exact at any temperature,
and past a row's proposal q is 0, so the token there is drawn from p itself (the draft rules coincide).

The n-gram match runs on the device over the whole batch; the suffix structures are host-side tries (as every engine
keeps them), fed the emitted tokens at the step's host read. Either costs the draft phase of the in-run timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .errors import UserError
from .kv import hole_layout
from .sampling import verify, warp_logits
from .step import Decoding, Feed, Verdict

__all__ = ["LOOKUP_KINDS", "NgramDraft", "SuffixDraft", "is_lookup_spec", "lookup_draft", "lookup_state", "lookup_step"]

LOOKUP_KINDS = ("ngram", "suffix")


@dataclass(frozen=True)
class NgramDraft:
    """Prompt lookup as vLLM's `ngram`: the longest suffix of the context (prompt and emitted tokens) of
    prompt_lookup_max down to prompt_lookup_min tokens that occurred earlier, at its earliest occurrence, proposes the
    tokens that followed it (at most gamma, at most up to the context's end)."""

    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    kind = "ngram"

    def __post_init__(self):
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise UserError(
                f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max (got {self.prompt_lookup_min}, "
                f"{self.prompt_lookup_max}); e.g. ngram:max=4,min=2"
            )

    def knobs(self) -> dict:
        return {"prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min}


@dataclass(eq=False)
class SuffixDraft:
    """Suffix decoding: every suffix of the context (at most max_depth tokens) found in a suffix trie of this request's
    context or in one of the responses of earlier requests (this object's, across `generate` calls, as emitted)
    proposes its most frequent continuation token by token while the path's empirical probability stays >=
    min_token_prob, at most max_spec_factor x the match length tokens (and gamma); the best-scoring one is drafted.

    A request's own earlier response (the same prompt in an earlier call: a benchmark's repeat) is discounted for
    that row alone, so a repeat cannot look its answer up while the other rows still can."""

    max_depth: int = 24
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    max_cached_requests: int = 1000
    _global: _Node = field(default=None, init=False, repr=False)
    _responses: dict = field(default_factory=dict, init=False, repr=False)  # prompt -> response, oldest first
    _running: list = field(default_factory=list, init=False, repr=False)  # the last call's (prompt, context)

    kind = "suffix"

    def __post_init__(self):
        if self.max_depth < 1 or self.max_spec_factor <= 0 or not 0 <= self.min_token_prob <= 1:
            raise UserError(
                f"suffix needs max_depth >= 1, max_spec_factor > 0 and 0 <= min_token_prob <= 1 (got {self.max_depth}, "
                f"{self.max_spec_factor}, {self.min_token_prob}); e.g. suffix:depth=24,factor=1.0,prob=0.1"
            )
        if self.max_cached_requests < 0:
            raise UserError(f"suffix needs max_cached_requests >= 0 (got {self.max_cached_requests})")
        self._global = _Node()

    def knobs(self) -> dict:
        return {
            "max_depth": self.max_depth,
            "max_spec_factor": self.max_spec_factor,
            "min_token_prob": self.min_token_prob,
            "max_cached_requests": self.max_cached_requests,
        }

    def begin(self, prompts: list[list[int]]) -> list[tuple[list[int], list[int] | None]]:
        """A new call: file the last call's responses -> per row, its context list (the prompt; the state appends the
        emitted tokens to it) and the earlier response to the same prompt, which that row must not look up."""
        for prompt, context in self._running:
            self._remember(prompt, context[len(prompt) :])
        self._running = []
        rows = []
        for prompt in map(tuple, prompts):
            context = list(prompt)
            self._running.append((prompt, context))
            rows.append((context, self._responses.get(prompt)))
        return rows

    def finish(self, responses: list[list[int]]) -> None:
        """The call's emitted tokens per prompt (prompt order), filed at the next call instead of the rows' contexts,
        which may hold accepted drafts past a stop token and lack the last emitted token."""
        self._running = [(prompt, list(prompt) + list(out)) for (prompt, _), out in zip(self._running, responses)]

    def _remember(self, prompt: tuple, response: list[int]) -> None:
        """The newest response to a prompt replaces its older one; past max_cached_requests the oldest leaves."""
        old = self._responses.pop(prompt, None)
        if old is not None:
            _insert(self._global, old, self.max_depth, -1)
        if self.max_cached_requests == 0 or not response:
            return
        self._responses[prompt] = response
        _insert(self._global, response, self.max_depth, +1)
        while len(self._responses) > self.max_cached_requests:
            _insert(self._global, self._responses.pop(next(iter(self._responses))), self.max_depth, -1)


def is_lookup_spec(spec: str) -> bool:
    """Whether a draft named on the command line or in a config is a zero-training draft (`lookup_draft`)."""
    return spec.partition(":")[0] in LOOKUP_KINDS


def lookup_draft(spec: str) -> NgramDraft | SuffixDraft:
    """'ngram', 'ngram:max=4,min=2', 'suffix', 'suffix:depth=24,factor=1.0,prob=0.1,cached=1000' -> the draft (the
    CLI's and the eval's spelling of a zero-training draft)."""
    kind, _, args = spec.partition(":")
    names = {
        "ngram": {"max": ("prompt_lookup_max", int), "min": ("prompt_lookup_min", int)},
        "suffix": {
            "depth": ("max_depth", int),
            "factor": ("max_spec_factor", float),
            "prob": ("min_token_prob", float),
            "cached": ("max_cached_requests", int),
        },
    }
    if kind not in names:
        raise UserError(
            f"unknown zero-training draft {spec!r}; use ngram[:max=N,min=N] or "
            "suffix[:depth=N,factor=F,prob=P,cached=N]"
        )
    kwargs = {}
    for item in filter(None, args.split(",")):
        key, _, value = item.partition("=")
        if key not in names[kind]:
            raise UserError(f"{kind} takes {', '.join(names[kind])} (got {key!r} in {spec!r})")
        name, cast = names[kind][key]
        try:
            kwargs[name] = cast(value)
        except ValueError:
            raise UserError(f"{kind}: {key}={value!r} is not a {cast.__name__} (in {spec!r})") from None
    return NgramDraft(**kwargs) if kind == "ngram" else SuffixDraft(**kwargs)


# ---------------------------------------------------------------------------------------------------- the states


class NgramState:
    """The batch's tokens (B, S) on the device; `propose` matches every row at once."""

    def __init__(self, draft: NgramDraft, batch_size: int, max_len: int, device: torch.device):
        self.draft = draft
        # positions 0..max_len - 1, then a trash column for holes: a boolean-mask write would read the mask back to the
        # host (a sync per step on CUDA); no window the match accepts reaches it (it lies past every row's length)
        self.tokens = torch.zeros(batch_size, max_len + 1, dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)

    def extend(self, tokens: torch.Tensor, counts: torch.Tensor, last_only: bool = False, new_rows=None) -> None:
        """Append each row's real tokens (its last counts[b] columns); the prefill's call brings the prompts."""
        valid, positions = hole_layout(counts, self.lengths, tokens.shape[1])
        rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
        self.tokens[rows, torch.where(valid, positions, self.tokens.shape[1] - 1)] = tokens
        self.lengths = self.lengths + counts

    def propose(self, gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> x (B, gamma) and limit (B,): each row's proposal is x[b, :limit[b]] (0: none)."""
        B, S = self.tokens.shape
        dev, L = self.tokens.device, self.lengths
        start = torch.full((B,), -1, dtype=torch.long, device=dev)  # where the proposal starts; -1: no match yet
        for n in range(self.draft.prompt_lookup_max, self.draft.prompt_lookup_min - 1, -1):
            if S <= n:
                continue
            suffix = self.tokens.gather(1, (L[:, None] - n + torch.arange(n, device=dev)).clamp_min(0))  # (B, n)
            windows = self.tokens.unfold(1, n, 1)  # (B, S - n + 1, n): window j covers j .. j + n - 1
            j = torch.arange(windows.shape[1], device=dev)
            # an earlier occurrence: it ends before the context's last token, so at least one token follows it
            hit = (windows == suffix[:, None]).all(-1) & (j + n < L[:, None]) & (L[:, None] >= n)
            first = torch.where(hit, j, S).min(1).values  # earliest occurrence, as vLLM
            start = torch.where((start < 0) & (first < S), first + n, start)
        limit = torch.where(start >= 0, (L - start).clamp(max=gamma), 0)
        x = self.tokens.gather(1, (start.clamp_min(0)[:, None] + torch.arange(gamma, device=dev)).clamp(max=S - 1))
        return x, limit

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, device=self.lengths.device)
        self.tokens, self.lengths = self.tokens[index], self.lengths[index]


class _Node:
    """A suffix-trie node: how often its substring occurred, and the nodes one token longer."""

    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, _Node] = {}


def _insert(root: _Node, tokens: list[int], depth: int, sign: int) -> None:
    """Add (sign +1) or remove (-1) every substring of at most `depth` tokens of `tokens`; a substring no response
    holds any more leaves the trie (with all below it), so the trie holds the cached responses only."""
    for i in range(len(tokens)):
        node = root
        for t in tokens[i : i + depth]:
            child = node.children.get(t)
            if child is None:
                child = node.children[t] = _Node()
            child.count += sign
            if child.count <= 0:  # its continuations occurred with it: none of them is left either
                del node.children[t]
                break
            node = child


Place = tuple[_Node, "_Node | None"]
"""A substring's node in a trie, and its node in a trie of occurrences to discount (None: nothing to discount)."""


def _count(place: Place) -> int:
    node, minus = place
    return node.count - (minus.count if minus is not None else 0)


def _child(place: Place, token: int) -> Place | None:
    """The place one token longer, None where that substring does not occur (after the discount)."""
    node, minus = place
    child = node.children.get(token)
    if child is None:
        return None
    out = (child, minus.children.get(token) if minus is not None else None)
    return out if _count(out) > 0 else None


def _step(active: list[Place], token: int, depth: int) -> list[Place]:
    """The places of a context's suffixes (active[d]: the suffix of d tokens; where a suffix does not occur no longer
    one does, so the list stays indexed by length) after appending token."""
    out = active[:1]
    for place in active[:depth]:
        child = _child(place, token)
        if child is None:
            break
        out.append(child)
    return out


def _grow(active: list[Place], token: int, depth: int) -> list[Place]:
    """`_step` on a request's own trie, which files the new suffixes as it goes (every one of them occurs now)."""
    out = active[:1]
    for node, _ in active[:depth]:
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = _Node()
        child.count += 1
        out.append((child, None))
    return out


def _speculate(place: Place, budget: int, min_prob: float) -> tuple[list[int], float]:
    """From a match's place: the most frequent continuation while its path probability stays >= min_prob, at most
    budget tokens -> (tokens, score = the expected tokens accepted, the sum of the path probabilities)."""
    out, prob, score = [], 1.0, 0.0
    while len(out) < budget:
        children = [(t, c) for t in place[0].children if (c := _child(place, t)) is not None]
        if not children:
            break
        token, child = max(children, key=lambda tc: _count(tc[1]))  # ties: the first seen
        prob *= _count(child) / sum(_count(c) for _, c in children)
        if prob < min_prob:
            break
        out.append(token)
        score += prob
        place = child
    return out, score


class SuffixState:
    """Per row: the context (a list on the host), the places of its suffixes in its own suffix trie and in the draft's
    trie of earlier responses (discounting the row's own earlier response, built as a trie of its own)."""

    def __init__(self, draft: SuffixDraft, prompts: list[list[int]], device: torch.device):
        self.draft, self.device, D = draft, device, draft.max_depth
        self.contexts, self.own, self.shared = [], [], []
        for context, withheld in draft.begin(prompts):
            minus = _Node()
            if withheld is not None:
                _insert(minus, withheld, D, +1)
            self.contexts.append(context)
            self.own.append([(_Node(), None)])
            self.shared.append([(draft._global, minus)])
            prompt, context[:] = list(context), []
            self._append(len(self.contexts) - 1, prompt)
        self.prefilled = False  # the prefill's call brings the prompts, filed above

    def _append(self, b: int, tokens: list[int]) -> None:
        D = self.draft.max_depth
        for t in tokens:
            self.contexts[b].append(t)
            self.own[b] = _grow(self.own[b], t, D)
            self.shared[b] = _step(self.shared[b], t, D)

    def extend(self, tokens: torch.Tensor, counts: torch.Tensor, last_only: bool = False, new_rows=None) -> None:
        """Append each row's real tokens (its last counts[b] columns): one read of them to the host."""
        if not self.prefilled:
            self.prefilled = True
            return
        for b, (row, c) in enumerate(zip(tokens.tolist(), counts.tolist())):
            self._append(b, row[len(row) - c :])

    def propose(self, gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
        draft, proposals = self.draft, []
        for own, shared in zip(self.own, self.shared):
            best, best_score = [], 0.0
            for active in (own, shared):
                # every matched suffix length, deepest first (ties keep the deeper): a long match near max_depth has
                # little room left below it in the depth-limited trie, where a shorter one can continue further
                for match in range(len(active) - 1, 0, -1):
                    budget = min(gamma, int(draft.max_spec_factor * match))
                    tokens, score = _speculate(active[match], budget, draft.min_token_prob)
                    if score > best_score:
                        best, best_score = tokens, score
            proposals.append(best)
        limit = torch.tensor([len(p) for p in proposals], dtype=torch.long)
        x = torch.tensor([p + [0] * (gamma - len(p)) for p in proposals], dtype=torch.long).view(-1, gamma)
        return x.to(self.device), limit.to(self.device)

    def select(self, keep: list[int]) -> None:
        self.contexts = [self.contexts[i] for i in keep]
        self.own = [self.own[i] for i in keep]
        self.shared = [self.shared[i] for i in keep]


def lookup_state(draft, prompts, max_len: int, device: torch.device):
    if isinstance(draft, NgramDraft):
        return NgramState(draft, len(prompts), max_len, device)
    return SuffixState(draft, [list(p) for p in prompts], device)


# ------------------------------------------------------------------------------------------------------ the step


def lookup_step(dec: Decoding, feed: Feed, *, gamma: int) -> Verdict:
    """One step with a zero-training draft: file the last emitted token, propose up to gamma tokens per row, verify
    the longest proposal in one target forward (one token when no row proposes), keep each row's accepted prefix.

    The proposal's length is read on the host (the width of the verify forward); the target ends at each row's
    accepted length and the draft's context holds exactly the emitted tokens (nothing to roll back)."""
    dec.draft.extend(feed.draft_tokens, feed.draft_counts)  # the last emitted token
    x, limit = dec.draft.propose(gamma)  # (B, gamma), (B,)
    G = int(limit.max())
    x = x[:, :G]
    V = dec.target.model.config.vocab_size
    proposed = torch.arange(G, device=x.device) < limit[:, None]  # (B, G)
    q = F.one_hot(x, V).float() * proposed[..., None]  # q one-hot on the proposal, 0 past it
    width = torch.full_like(feed.target, G + 1)
    logits = dec.target.extend(torch.cat([feed.target[:, None], x], 1), width)  # (B, G + 1, V)
    p = warp_logits(logits, dec.sampling)
    n, nxt = verify(p, q, x, dec.generator, dec.sampling.greedy, limit=limit)
    if G:
        dec.target.rollback(G - n)
        cols = (torch.arange(G, device=x.device) + n[:, None] - G).clamp_min(0)  # accepted drafts, right-aligned
        dec.draft.extend(x.gather(1, cols), n)
    return Verdict(x, n, nxt, refeed=torch.zeros_like(proposed[:, 0] if G else n, dtype=torch.bool), drafted=limit)
