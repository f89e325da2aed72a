"""Sampling parameters, logit warping and the speculative accept/reject rule, as pure tensor functions.

The same `warp_logits` shapes the target's p and the draft's q (and the distillation trainer's acceptance estimate),
so target-only sampling, speculative sampling and the offline estimate all see one distribution.
"""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

DraftRule = Literal["sample", "greedy"]


@dataclass(frozen=True)
class SamplingParams:
    """Warping applied identically to the target's and the draft's logits."""

    temperature: float = 0.0
    """Softmax temperature; 0 means argmax (greedy) decoding."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p (nucleus); 1.0 keeps all."""

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature}); use 0 for greedy decoding")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (got {self.top_k}); use 0 to keep every token")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p}); use 1.0 to turn nucleus sampling off")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Logits (..., V) -> fp32 probabilities (..., V) after temperature, top-k, top-p (HF order); one-hot at T=0."""
    logits = logits.float()
    if sampling.greedy:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        logits = logits.masked_fill(outside_nucleus(logits, sampling.top_p), float("-inf"))
    return logits.softmax(-1)


NUCLEUS_CANDIDATES = 256
"""Most likely tokens a CPU top-p looks among before sorting the whole vocabulary (see `outside_nucleus`)."""


def outside_nucleus(logits: torch.Tensor, top_p: float, candidates: int = NUCLEUS_CANDIDATES) -> torch.Tensor:
    """Logits (..., V) -> (..., V) bool: the tokens outside the smallest set whose probability reaches top_p.

    A token is kept iff the tokens more likely than it hold less than top_p (so the most likely one always is). On
    the CPU a full sort of a 49k vocabulary costs ~9 ms per row on one core, more than a decode step's GEMMs at batch
    32, so the nucleus is looked for among the `candidates` most likely tokens first (`topk`); only the rows whose
    nucleus is larger are sorted in full (CUDA always sorts: one fast kernel, and no host sync).
    """
    V = logits.shape[-1]
    if logits.device.type == "cpu" and V > candidates:
        top, order = logits.softmax(-1).topk(candidates, dim=-1)  # (..., K) descending
        above = top.cumsum(-1) - top  # (..., K) mass of the more likely candidates
        drop = torch.ones_like(logits, dtype=torch.bool).scatter(-1, order, above >= top_p)
        wide = top.sum(-1) < top_p  # (...) rows whose nucleus reaches past the candidates: one host sync
        if bool(wide.any()):
            drop[wide] = outside_nucleus(logits[wide], top_p, candidates=V)  # (N, V): those rows, sorted
        return drop
    sorted_logits, order = logits.sort(-1)  # ascending
    drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
    drop[..., -1] = False  # always keep the most likely token
    return drop.scatter(-1, order, drop)


def sample(probs: torch.Tensor, generator: torch.Generator | None, greedy: bool = False) -> torch.Tensor:
    """Draw one token per row from unnormalised probs (..., V) -> (...); argmax when greedy."""
    if greedy:
        return probs.argmax(-1)
    if probs.device.type == "cpu":
        # Inverse CDF, one uniform per row: the race below draws V exponentials per row (~2 ms for 49k on one core).
        # u <= 1 - 2^-24 (float32) times the float64 total stays below it, so the token found has p > 0.
        cdf = probs.double().cumsum(-1)  # (..., V)
        u = torch.rand(cdf.shape[:-1] + (1,), device=probs.device, generator=generator).double()
        return torch.searchsorted(cdf, u * cdf[..., -1:], right=True)[..., 0]
    # Exponential race (gumbel-max): argmax p_v / E_v picks v with probability p_v / sum(p), with no host sync.
    race = torch.empty_like(probs).exponential_(1, generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return (probs / race).argmax(-1)


def verify(
    p: torch.Tensor,
    q: torch.Tensor,
    x: torch.Tensor,
    generator: torch.Generator | None,
    greedy: bool = False,
    limit: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative accept/reject for a batch (Leviathan et al. 2023, Chen et al. 2023), vectorised over gamma.

    p: (B, G+1, V) target probs at the G draft positions and the bonus position.
    q: (B, G, V) draft proposal probs (one-hot of x for draft_rule=greedy, which makes the residual p with x zeroed).
    x: (B, G) drafted tokens. G may be 0 (target-only decoding: sample straight from p).
    limit: (B,) drafts each row proposed (a lookup draft's, `lookup.py`): x[b, limit[b]:] is padding, never
        accepted, and q must be 0 there, so the token at a row's limit is drawn from p as at the bonus position.
    Returns n (B,) leading accepted draft tokens and the next token (B,): from norm(max(0, p - q)) at the first
    rejection, or from p at the bonus position when all G are accepted.
    """
    B, G = x.shape
    if G == 0:  # target-only decoding: the same draw as below (residual = p), without the (B, V) passes
        return torch.zeros(B, dtype=torch.long, device=p.device), sample(p[:, 0], generator, greedy)
    p_x = p[:, :G].gather(-1, x[..., None])[..., 0]  # (B, G)
    q_x = q.gather(-1, x[..., None])[..., 0]  # (B, G)
    u = torch.rand(B, G, device=p.device, generator=generator)
    accept = u * q_x < p_x  # u < p/q without dividing by q
    if limit is not None:
        accept &= torch.arange(G, device=p.device) < limit[:, None]
    n = accept.long().cumprod(1).sum(1)  # (B,)
    at_n = n[:, None, None].expand(B, 1, p.shape[-1])
    p_n = p.gather(1, at_n)[:, 0]  # (B, V)
    q_n = F.pad(q, (0, 0, 0, 1)).gather(1, at_n)[:, 0]  # (B, V); no draft mass at the bonus position
    residual = (p_n - q_n).clamp_min(0)
    # p == q leaves an all-zero residual, reachable only through float rounding of p/q; p is then the exact fallback.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)
    return n, sample(residual, generator, greedy)
