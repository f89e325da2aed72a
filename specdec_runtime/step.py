"""What one decode step reads and returns, shared by the chain step (engine.py) and the tree step (tree_step.py).

Every row of the batch a step sees is still decoding: finished rows leave the batch (`select`) before the next step,
so no forward computes a row that has nothing left to emit.
"""

from dataclasses import dataclass, replace

import torch

from .kv import HFState
from .llama import StaticState
from .metrics import PhaseTimer
from .sampling import DraftRule, SamplingParams


class TimedState:
    """A cache state whose forwards count as one phase of the timer; the steps use it as the state itself."""

    def __init__(self, state: HFState | StaticState, timer: PhaseTimer, phase: str):
        self.state, self.timer, self.phase = state, timer, phase

    @property
    def model(self) -> torch.nn.Module:
        return self.state.model

    @property
    def lengths(self) -> torch.Tensor:
        return self.state.lengths

    def extend(
        self, tokens: torch.Tensor, counts: torch.Tensor, last_only: bool = False, new_rows: int | None = None
    ) -> torch.Tensor:
        with self.timer.span(self.phase):
            return self.state.extend(tokens, counts, last_only, new_rows)

    def draft_step(self, x: torch.Tensor) -> torch.Tensor:
        with self.timer.span(self.phase):
            return self.state.draft_step(x)

    def propose(self, gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self.timer.span(self.phase):
            return self.state.propose(gamma)

    def tree_forward(self, tokens: torch.Tensor, positions: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        with self.timer.span(self.phase):
            return self.state.tree_forward(tokens, positions, seen)

    def rollback(self, drop: torch.Tensor) -> None:
        self.state.rollback(drop)

    def tree_commit(self, cols: torch.Tensor, counts: torch.Tensor) -> None:
        self.state.tree_commit(cols, counts)

    def select(self, keep: list[int]) -> None:
        self.state.select(keep)


State = HFState | StaticState | TimedState


@dataclass(frozen=True)
class Decoding:
    """Fixed for a whole generate call: both caches and the sampling applied to both models."""

    target: State
    draft: State | None
    """None for target-only decoding."""
    sampling: SamplingParams
    rule: DraftRule
    generator: torch.Generator | None


@dataclass(frozen=True)
class Verdict:
    """A step's outcome per row."""

    x: torch.Tensor
    """(B, G) the drafted tokens (chain) or the accepted path's tokens (tree); only the first n count."""
    n: torch.Tensor
    """(B,) accepted draft tokens."""
    nxt: torch.Tensor
    """(B,) the correction (or bonus) token the target emits after them."""
    refeed: torch.Tensor
    """(B,) the last accepted draft is missing from the draft's cache, so it is fed again before nxt."""
    drafted: torch.Tensor | None = None
    """(B,) tokens each row proposed, where rows propose different numbers (a lookup draft); None: the step's all."""


@dataclass
class Feed:
    """Tokens a step feeds first: the ones each cache has not seen yet."""

    target: torch.Tensor
    """(B,) the last emitted token."""
    draft: torch.Tensor
    """(B, 2) right-aligned: the last accepted draft when the draft's cache lacks it, then the last emitted token."""
    draft_counts: torch.Tensor
    """(B,) real tokens in `draft`: 1, or 2 after a refeed."""
    width: int = 1
    """Columns of `draft` a step feeds: 2 only while some row holds 2 (the loop learns it at its host sync)."""
    draft_rows: int = 1
    """Rows an EAGLE-3 head computes when fed `draft` (`new_rows` of kv.py's extend): the most drafts any row
    accepted last step + 1, since it recomputes the accepted ones from the target's states (eagle3_state.py); the
    loop learns it at its host sync, so the head reads nothing back."""

    @classmethod
    def first(cls, first_tokens: torch.Tensor) -> "Feed":
        """The feed after prefill: each row's first token (B,), sampled from the target's prefill, in no cache yet."""
        ones = torch.ones_like(first_tokens)
        return cls(first_tokens, torch.stack([first_tokens] * 2, 1), ones)

    @property
    def draft_tokens(self) -> torch.Tensor:
        return self.draft[:, -self.width :]  # (B, width)

    def advance(self, verdict: Verdict, drafting: bool) -> "Feed":
        """The feed of the next step."""
        nxt, B = verdict.nxt, verdict.nxt.shape[0]
        if not drafting:
            return replace(self, target=nxt)
        if not verdict.x.shape[1]:  # a lookup step in which no row proposed: the draft lacks nxt only
            return replace(self, target=nxt, draft=nxt[:, None].expand(B, 2), draft_counts=torch.ones_like(nxt))
        last = verdict.x.gather(1, (verdict.n - 1).clamp_min(0)[:, None])[:, 0]  # (B,) last accepted draft
        draft = torch.where(verdict.refeed[:, None], torch.stack([last, nxt], 1), nxt[:, None].expand(B, 2))
        return replace(self, target=nxt, draft=draft, draft_counts=1 + verdict.refeed.long())

    def select(self, keep: torch.Tensor) -> "Feed":
        """The rows `keep` (B',) of this feed, in that order."""
        return replace(self, target=self.target[keep], draft=self.draft[keep], draft_counts=self.draft_counts[keep])
