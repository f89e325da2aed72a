"""Distillation objectives: pure functions of student logits and teacher targets.

Terms (names as in `distill.config.OBJECTIVES`), with p the teacher and q the student distribution per position:

    forward_kl  KL(p || q)                         mode covering; the classic KD loss
    reverse_kl  KL(q || p)                         mode seeking (MiniLLM, GKD)
    jsd         generalized JSD with `beta`        Agarwal et al. 2024 (GKD), TRL's convention, see `generalized_jsd`
    tv          0.5 sum_v |p_v - q_v|              1 - TV is the speculative acceptance rate (DistillSpec, Zhou et al.
                                                   2024), so minimising TV maximises expected acceptance
    ce          -log q(label)                      sequence-level KD (Kim & Rush 2016): NLL of teacher-written tokens

`distill_loss` is the one entry point: a weighted mix of terms, fp32 log-softmax, an explicit (B, T) bool mask,
sums normalised by a caller-given global token count, chunked over positions so the fp32 (B, T, V) probabilities
exist one chunk at a time: with the student's logits, activation checkpointing (rebuilt in backward); with its
hidden states and head (the training path), each chunk's gradient computed in the forward (`_FusedHeadSums`), in
closed form for ce and for forward_kl against a sparse teacher (`_support_sums_and_grad`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from distill.config import OBJECTIVES

KD_TERMS = ("forward_kl", "reverse_kl", "jsd", "tv")
# Smallest mass of the top-k "rest" bucket: 1 - sum(probs) is only accurate to ~1e-7 in fp32, and a positive floor
# keeps log(rest) and its gradient finite when the top-k covers (nearly) all of the mass.
REST_FLOOR = 1e-12
# A finite stand-in for log 0 in dense teacher logits built from a sparse teacher: finite, so 0 * (finite) keeps the
# KL terms finite where -inf would give 0 * inf = NaN; its exp() (1.6e-38, < 1e-33 over any vocabulary) is as good as
# 0. Not lower: below -87.3 fp32 exp() leaves its vectorised path (-1e4 cost 43 ms per (128, 8193) chunk on one core
# here, -87 2.7 ms), and the softmaxes of the loss took a fifth of an EAGLE-3 training step.
LOG_ZERO = -87.0


@dataclass
class TeacherTargets:
    """The teacher's view of each position: full logits (teacher online) or top-k log-probs (offline cache)."""

    logits: Tensor | None = None
    """(B, T, V) teacher logits, any float dtype; leave None when using the top-k cache."""
    topk_logprobs: Tensor | None = None
    """(B, T, K) teacher log-probs at temperature 1 of its K most likely tokens (the offline cache)."""
    topk_indices: Tensor | None = None
    """(B, T, K) integer token ids of `topk_logprobs`, distinct within a position."""
    support_logits: Tensor | None = None
    """(B, T, K) teacher logits at the K ids of `support_ids`, every other id at probability ~0 (dense logits that
    read LOG_ZERO x max(1, 1 / T) there after kd_temperature T), renormalised over the support (no "rest" bucket,
    unlike `topk_logprobs`). Entries <= LOG_ZERO are padding (their ids may repeat)."""
    support_ids: Tensor | None = None
    """(B, T, K) integer ids of `support_logits`; distinct within a position but for LOG_ZERO padding."""

    def __post_init__(self) -> None:
        pairs = {
            "logits": (self.logits, self.logits),
            "(topk_logprobs, topk_indices)": (self.topk_logprobs, self.topk_indices),
            "(support_logits, support_ids)": (self.support_logits, self.support_ids),
        }
        given = [name for name, (a, b) in pairs.items() if a is not None or b is not None]
        if len(given) != 1:
            raise ValueError(f"TeacherTargets takes exactly one of {', '.join(pairs)}; got {given or 'none'}")
        if any(x is None for x in pairs[given[0]]):
            raise ValueError(f"TeacherTargets: {given[0]} come together")

    @property
    def sparse(self) -> bool:
        return self.support_logits is not None


def dense_from_support(support_logits: Tensor, support_ids: Tensor, vocab: int, fill: float = LOG_ZERO) -> Tensor:
    """(..., K) logits at `support_ids` -> (..., vocab) fp32 dense logits, `fill` at every other id and at padding
    entries (<= LOG_ZERO); padding, its id possibly repeated, never overwrites a real entry (amax)."""
    values = support_logits.float()
    values = values.masked_fill(values <= LOG_ZERO, fill)
    dense = values.new_full((*values.shape[:-1], vocab), fill)
    return dense.scatter_reduce_(-1, support_ids.long(), values, reduce="amax")


def batch_inputs(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def teacher_forward(teacher, batch: dict[str, Tensor]) -> Tensor:
    """(B, T, V) teacher logits under inference_mode: the teacher never builds an autograd graph."""
    with torch.inference_mode():
        return teacher(**batch_inputs(batch), use_cache=False).logits


def teacher_targets(teacher, batch: dict[str, Tensor]) -> TeacherTargets:
    """The targets of a collated batch: the teacher's logits, or with `teacher` None the batch's cached top-k."""
    if teacher is None:
        return TeacherTargets(topk_logprobs=batch["topk_logprobs"], topk_indices=batch["topk_ids"])
    # An inference tensor; distill_loss copies it chunk by chunk where autograd needs a normal one.
    return TeacherTargets(logits=teacher_forward(teacher, batch))


# ----------------------------------------------------------------------------------------------------------------
# Divergences between two log-prob tensors over the last dim (full vocabulary or K+1 buckets); t = log p (teacher),
# s = log q (student). Each returns one value per position, shape (...,).


def forward_kl(t: Tensor, s: Tensor) -> Tensor:
    """KL(p || q) = sum_v p_v (log p_v - log q_v)."""
    return (t.exp() * (t - s)).sum(-1)


def reverse_kl(t: Tensor, s: Tensor) -> Tensor:
    """KL(q || p) = sum_v q_v (log q_v - log p_v)."""
    return (s.exp() * (s - t)).sum(-1)


def generalized_jsd(t: Tensor, s: Tensor, beta: float) -> Tensor:
    """Generalized JSD of GKD (Agarwal et al. 2024, eq. 1) in TRL's convention (`GKDTrainer.generalized_jsd_loss`):

        m = beta p + (1 - beta) q,   JSD_beta = beta KL(p || m) + (1 - beta) KL(q || m)

    with p the teacher and q the student. The formula vanishes at both ends, so like TRL the endpoints are defined
    as the limits up to scale: beta = 0 returns forward KL(p || q) (JSD_beta / beta -> KL(p || q) as beta -> 0)
    and beta = 1 returns reverse KL(q || p) (JSD_beta / (1 - beta) -> KL(q || p) as beta -> 1).
    """
    if beta == 0:
        return forward_kl(t, s)
    if beta == 1:
        return reverse_kl(t, s)
    m = torch.logaddexp(t + math.log(beta), s + math.log1p(-beta))  # log m, no (2, ..., V) stack
    return beta * forward_kl(t, m) + (1 - beta) * forward_kl(s, m)


def total_variation(t: Tensor, s: Tensor) -> Tensor:
    """TV(p, q) = 0.5 sum_v |p_v - q_v| = 1 - sum_v min(p_v, q_v), one minus the acceptance probability."""
    return 0.5 * (t.exp() - s.exp()).abs().sum(-1)


def bucket_logprobs(logprobs: Tensor) -> Tensor:
    """(..., K) log-probs of K distinct tokens -> (..., K+1) log-probs, the last bucket holding the rest of the mass."""
    rest = (1 - logprobs.exp().sum(-1, keepdim=True)).clamp(min=REST_FLOOR)  # (..., 1)
    return torch.cat([logprobs, rest.log()], dim=-1)


# ----------------------------------------------------------------------------------------------------------------
# The loss


def _kd_logprobs(
    s1: Tensor, teacher_logits: Tensor | None, topk_logprobs: Tensor | None, topk_indices: Tensor | None, kd_t: float
) -> tuple[Tensor, Tensor]:
    """Teacher and student log-probs at `kd_t` over the vocabulary (N, V) or over K+1 buckets (N, K+1)."""
    if teacher_logits is not None:
        t = F.log_softmax(teacher_logits if kd_t == 1 else teacher_logits.float() / kd_t, dim=-1, dtype=torch.float32)
        return t, (s1 if kd_t == 1 else F.log_softmax(s1 / kd_t, dim=-1))
    t = bucket_logprobs(topk_logprobs.float())  # (N, K+1)
    s = bucket_logprobs(s1.gather(-1, topk_indices.long()))  # (N, K+1)
    # Renormalising p^(1/T) over the buckets also absorbs the rest floor and bf16 rounding of the cache.
    return F.log_softmax(t / kd_t, dim=-1), F.log_softmax(s / kd_t, dim=-1)


def _term(name: str, t: Tensor | None, s: Tensor | None, s1: Tensor, labels: Tensor | None, beta: float) -> Tensor:
    """One term per position (N,); t, s: KD log-probs at kd_temperature, s1: student log-probs at temperature 1."""
    match name:
        case "forward_kl":
            return forward_kl(t, s)
        case "reverse_kl":
            return reverse_kl(t, s)
        case "jsd":
            return generalized_jsd(t, s, beta)
        case "tv":
            return total_variation(t, s)
        case "ce":
            return -s1.gather(-1, labels[:, None])[:, 0]
    raise ValueError(f"unknown objective {name!r}; valid objectives: {', '.join(OBJECTIVES)}")


def _chunk_sums(
    student: Tensor,
    topk_logprobs: Tensor | None,
    topk_indices: Tensor | None,
    labels: Tensor | None,
    mask: Tensor,
    lm_head_weight: Tensor | None,
    *,
    teacher_logits: Tensor | None,
    names: tuple[str, ...],
    kd_temperature: float,
    beta: float,
    sparse: bool = False,
) -> Tensor:
    """Sum over the chunk's valid positions of each term in `names`: (len(names),). With `sparse` the top-k slots
    hold a sparse teacher's support logits and ids (`TeacherTargets.support_logits`)."""
    if teacher_logits is not None and teacher_logits.is_inference() and torch.is_grad_enabled():
        # Autograd cannot save an inference tensor; a copy of this chunk only (recomputed in backward) is enough.
        teacher_logits = teacher_logits.clone()
    logits = student if lm_head_weight is None else student @ lm_head_weight.T  # (N, D) -> (N, V)
    if sparse and topk_logprobs is not None:
        # Dense over this chunk only. Off the support (and at padding) the fill reads LOG_ZERO x max(1, 1 / T) after
        # / kd_temperature, as in `_support_sums_and_grad`: probability ~0 at any T (LOG_ZERO / T would leak
        # V x exp(LOG_ZERO / T) of the mass at large T, and LOG_ZERO itself outweigh real entries at small T).
        fill = LOG_ZERO * max(kd_temperature, 1.0)
        teacher_logits = dense_from_support(topk_logprobs, topk_indices, logits.shape[-1], fill)
        topk_logprobs = topk_indices = None
    s1 = F.log_softmax(logits, dim=-1, dtype=torch.float32)  # (N, V) student log-probs at temperature 1
    t = s = None
    if any(name in KD_TERMS for name in names):
        t, s = _kd_logprobs(s1, teacher_logits, topk_logprobs, topk_indices, kd_temperature)
    if labels is not None:
        labels = labels.masked_fill(~mask, 0).long()  # masked positions may hold -100
    # where(), not multiplication: masked positions contribute an exact 0 and a zero gradient.
    return torch.stack([torch.where(mask, _term(name, t, s, s1, labels, beta), 0.0).sum() for name in names])


def _support_sums_and_grad(
    logits: Tensor,
    support_logits: Tensor | None,
    support_ids: Tensor | None,
    labels: Tensor | None,
    mask: Tensor,
    term_weights: Tensor,
    *,
    names: tuple[str, ...],
    kd_temperature: float,
) -> tuple[Tensor, Tensor]:
    """`_chunk_sums` for forward_kl and ce against a sparse teacher (`TeacherTargets.support_logits`), and the
    gradient of sum_i w_i sums_i w.r.t. `logits` (n, V), in closed form: with q = softmax(z / T) and p the teacher's
    distribution at T over its K support ids, d KL(p || q) / dz = (q - p) / T, and d -log softmax(z)_y / dz =
    softmax(z) - onehot(y). Beside one softmax over V per term nothing costs more than K per row, where autograd
    through the dense terms (`_chunk_sums`) makes a dozen passes over (n, V) and builds the dense teacher.
    -> (sums (len(names),), grad (n, V) in logits' dtype)."""
    z, grad, sums = logits.float(), None, []
    keep = mask[:, None].float()  # (n, 1): masked rows contribute an exact 0 and a zero gradient
    for name, weight in zip(names, term_weights):
        # One fused log_softmax, then its exp in place: fewer passes over (n, V) than logsumexp and a subtraction.
        if name == "forward_kl":
            T, ids = kd_temperature, support_ids.long()
            s = F.log_softmax(z if T == 1 else z / T, dim=-1)  # (n, V) the student's log-probs at T
            tz = support_logits.float()
            # padding reads LOG_ZERO x max(1, 1 / T) after the temperature, as the dense path's fill (`_chunk_sums`)
            pad = LOG_ZERO * max(1.0, 1.0 / T)
            t = F.log_softmax(tz if T == 1 else torch.where(tz <= LOG_ZERO, pad, tz / T), dim=-1)  # (n, K)
            p = t.exp()
            term = (p * (t - s.gather(-1, ids))).sum(-1)  # (n,)
            g = s.exp_().scatter_add_(-1, ids, -p).mul_(keep * (weight / T))  # (q - p) w / T
        elif name == "ce":
            s1 = F.log_softmax(z, dim=-1)
            y = labels.masked_fill(~mask, 0).long()[:, None]  # masked positions may hold -100
            term = -s1.gather(-1, y)[:, 0]
            g = s1.exp_().scatter_add_(-1, y, -torch.ones_like(y, dtype=s1.dtype)).mul_(keep * weight)
        else:
            raise ValueError(f"no closed form for objective term {name!r}")
        sums.append(torch.where(mask, term, 0.0).sum())
        grad = g if grad is None else grad.add_(g)
    return torch.stack(sums), grad.to(logits.dtype)


class _FusedHeadSums(torch.autograd.Function):
    """Sums of the terms over chunks of rows whose logits are `hidden @ weight.T`, with the gradient computed in the
    forward pass (the fused linear loss of Liger-Kernel and Apple's Cut Cross-Entropy, on any device).

    Per chunk the logits are computed once, the terms and their gradient w.r.t. the chunk's logits come from a local
    autograd graph over the elementwise ops only, and that gradient goes straight into the hidden states' and the
    head's gradients (two GEMMs); then the chunk's fp32 (rows, V) tensors are freed. The checkpointed path
    (`_chunk_sums` under `checkpoint`) computes each chunk's logits and elementwise terms twice (forward, then
    again in backward) and differentiates through the recomputation: one head GEMM and one pass of the terms more.

    forward -> (the weighted total sum_i w_i sums_i, which carries the gradient; the per-term sums (n,), for the
    metrics, non-differentiable). The weights must be the ones the caller's loss applies: the gradient is computed
    for the weighted total and only scaled in backward. With `closed_form` (`_support_sums_and_grad` bound to the
    objective) each chunk's sums and gradient come from it instead of the local autograd graph.
    """

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, teacher: list, chunks: list, fn, term_weights: Tensor, closed_form=None
    ):
        """hidden (M, D), weight (V, D); teacher: [the teacher's (N, V) logits or None] (in a list: an inference
        tensor, never an autograd input); chunks: per chunk of M's rows in order (its row indices into N, top-k
        log-probs or support logits, their ids, labels, mask (n,)); fn: `_chunk_sums` bound to the objective."""
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.zeros_like(hidden) if need_h else None  # (M, D)
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None  # (V, D), fp32 accumulation
        sums, start = [], 0
        w = weight.detach()
        for rows, *tensors in chunks:  # tensors: top-k log-probs, top-k ids, labels, mask (n,)
            h = hidden[start : start + rows.shape[0]].detach()  # (n, D): the chunk's rows
            # index_select of an inference tensor (the teacher's) gives a normal one, which autograd may save
            teacher_logits = None if teacher[0] is None else teacher[0].index_select(0, rows)  # (n, V), one chunk
            if closed_form is not None:  # under autocast the logits in its dtype, as the head would run
                chunk_sums, grad = closed_form(h @ w.T, *tensors, term_weights)  # (len(names),), (n, V)
            else:
                with torch.enable_grad():
                    logits = (h @ w.T).requires_grad_()  # (n, V)
                    chunk_sums = fn(logits, *tensors, None, teacher_logits=teacher_logits)  # (len(names),)
                    (grad,) = torch.autograd.grad((chunk_sums * term_weights).sum(), logits)  # (n, V)
            if need_h:
                grad_h[start : start + h.shape[0]] = (grad @ w).to(hidden.dtype)
            if need_w and grad.dtype == h.dtype == grad_w.dtype:
                # In place: no (V, D) product to allocate and add, half the time of the line below on a CPU
                grad_w.addmm_(grad.T, h)
            elif need_w:  # under autocast: the product in the chunk's dtype, accumulated in fp32
                grad_w += (grad.T @ h).float()
            sums.append(chunk_sums.detach())
            start += h.shape[0]
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        per_term = torch.stack(sums).sum(0) if sums else term_weights.new_zeros(len(term_weights))
        ctx.mark_non_differentiable(per_term)
        return (per_term * term_weights).sum(), per_term

    @staticmethod
    def backward(ctx, grad_total: Tensor, _grad_per_term: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return (
            None if grad_h is None else grad_h * grad_total,
            None if grad_w is None else grad_w * grad_total,
            None,
            None,
            None,
            None,
            None,
        )


def _check_shapes(
    B: int, T: int, V: int, teacher: TeacherTargets | None, labels: Tensor | None, mask: Tensor, names: tuple[str, ...]
) -> None:
    if mask.dtype != torch.bool or tuple(mask.shape) != (B, T):
        raise ValueError(f"mask must be a (B, T) = {(B, T)} bool tensor, got {mask.dtype} {tuple(mask.shape)}")
    if "ce" in names and (labels is None or tuple(labels.shape) != (B, T)):
        raise ValueError(f"objective 'ce' needs labels of shape (B, T) = {(B, T)}")
    if not any(name in KD_TERMS for name in names):
        return
    if teacher is None:
        raise ValueError(f"objective terms {[n for n in names if n in KD_TERMS]} need teacher targets")
    if teacher.logits is not None and tuple(teacher.logits.shape) != (B, T, V):
        raise ValueError(f"teacher logits {tuple(teacher.logits.shape)} do not match the student's {(B, T, V)}")
    if teacher.topk_logprobs is not None:
        lp, idx = teacher.topk_logprobs, teacher.topk_indices
        if lp.shape != idx.shape or tuple(lp.shape[:2]) != (B, T):
            raise ValueError(
                f"top-k logprobs {tuple(lp.shape)} and indices {tuple(idx.shape)} must be (B, T, K), (B, T) = {B, T}"
            )
        if idx.is_floating_point():
            raise ValueError("top-k indices must be an integer tensor")
    if teacher.support_logits is not None:
        lp, idx = teacher.support_logits, teacher.support_ids
        if lp.shape != idx.shape or tuple(lp.shape[:2]) != (B, T) or idx.is_floating_point():
            raise ValueError(
                f"support logits {tuple(lp.shape)} and integer ids {tuple(idx.shape)} must be (B, T, K), "
                f"(B, T) = {B, T}"
            )


def distill_loss(
    student_logits: Tensor | None,
    teacher: TeacherTargets | None,
    labels: Tensor | None,
    mask: Tensor,
    objective: dict[str, float] | str,
    *,
    kd_temperature: float = 1.0,
    beta: float = 0.5,
    num_items: int | Tensor | None = None,
    chunk_size: int = 128,
    student_hidden: Tensor | None = None,
    lm_head_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted mix of distillation terms over the valid positions of a batch.

    Args:
        student_logits: (B, T, V) student logits; position t predicts `labels[:, t]` (already shifted).
            None when `student_hidden` and `lm_head_weight` are given instead.
        teacher: teacher logits (B, T, V) or the top-k cache (B, T, K); may be None for a pure `ce` objective.
        labels: (B, T) token ids, read only by `ce` and only where `mask` is True (-100 elsewhere is fine).
        mask: (B, T) bool, True at the trained positions (the prompt's too with distill.loss_on_prompt).
        objective: a term name or {name: weight}; names in `distill.config.OBJECTIVES`. Weight-0 terms are still
            computed and reported in the metrics.
        kd_temperature: softens teacher and student inside the KD terms (not `ce`). With teacher logits the loss at
            T equals the loss at 1 on logits / T; no T^2 factor (Hinton et al. 2015 use one to keep gradient
            magnitudes; put it in the weight). With the top-k cache, both sides are first bucketed at temperature 1
            into the K teacher tokens plus one "rest" bucket (mass 1 - sum of the K probs), then each bucketed
            distribution is raised to 1/T and renormalised over the K+1 buckets. This is exact for T = 1 (and for
            K = V) and treats the tail as one token otherwise, as no cache can know the tail's shape.
        beta: the generalized JSD weight (see `generalized_jsd`), used only by `jsd`.
        num_items: the count to normalise sums by; under gradient accumulation and multi-process training pass the
            global count of valid tokens of the optimizer step. Default: mask.sum(). Clamped to >= 1, so an empty
            mask gives a zero loss with a (zero) gradient path instead of NaN.
        chunk_size: positions (rows of the flattened B*T) per chunk. With student logits each chunk is checkpointed
            when gradients are on, so its fp32 (chunk_size, V) tensors are rebuilt in backward instead of kept for
            every chunk.
        student_hidden, lm_head_weight: (B, T, D) final hidden states and (V, D) head weight (no bias); the logits
            are then computed chunk by chunk over the valid rows only and the full (B, T, V) student logits never
            exist; with gradients on, each chunk's gradient is computed in the forward (`_FusedHeadSums`).

    Returns:
        (loss, metrics): the weighted scalar loss and {term name: its detached normalised value}.
    """
    # Names, weights and hyperparameter ranges come checked from `DistillConfig`; only the tensors are checked here.
    weights = {objective: 1.0} if isinstance(objective, str) else objective
    names = tuple(weights)
    if (student_logits is None) == (student_hidden is None) or (student_hidden is None) != (lm_head_weight is None):
        raise ValueError("pass either student_logits, or student_hidden together with lm_head_weight")
    student = student_logits if student_logits is not None else student_hidden
    if student.dim() != 3:
        raise ValueError(f"student logits / hidden states must be (B, T, V) / (B, T, D), got {tuple(student.shape)}")
    B, T = student.shape[:2]
    V = student_logits.shape[-1] if student_logits is not None else lm_head_weight.shape[0]
    _check_shapes(B, T, V, teacher, labels, mask, names)
    N = B * T

    def rows(x: Tensor | None) -> Tensor | None:
        return None if x is None else x.reshape(N, *x.shape[2:])  # (B, T, ...) -> (N, ...)

    teacher = teacher if any(name in KD_TERMS for name in names) else None
    teacher_logits = rows(teacher.logits) if teacher else None
    sparse = teacher is not None and teacher.sparse
    tensors = [
        rows(student),
        rows(teacher.support_logits if sparse else teacher.topk_logprobs) if teacher else None,
        rows(teacher.support_ids if sparse else teacher.topk_indices) if teacher else None,
        rows(labels) if "ce" in names else None,
        rows(mask),
    ]
    fn = functools.partial(_chunk_sums, names=names, kd_temperature=kd_temperature, beta=beta, sparse=sparse)
    closed_form = None
    if set(names) <= {"forward_kl", "ce"} and (sparse or teacher is None):
        closed_form = functools.partial(_support_sums_and_grad, names=names, kd_temperature=kd_temperature)
    recompute = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (student, lm_head_weight))
    count = mask.sum() if num_items is None else torch.as_tensor(num_items, device=mask.device)
    count = count.clamp(min=1)
    term_weights = torch.tensor(list(weights.values()), dtype=torch.float32, device=mask.device)
    if recompute and lm_head_weight is not None:
        total, sums = _fused_head_sums(
            tensors, teacher_logits, lm_head_weight, fn, term_weights, chunk_size, closed_form
        )
        return total / count.to(total.dtype), {name: (sums[i] / count).detach() for i, name in enumerate(names)}
    sums = []
    # split(), not one slice per chunk: a slice's backward writes its gradient into a zero-filled (N, V) tensor per
    # chunk (N / chunk_size full-size fills and adds), split's backward concatenates the chunks' gradients once.
    pieces = [[None] * len(range(0, max(N, 1), chunk_size)) if x is None else x.split(chunk_size) for x in tensors]
    teacher_pieces = teacher_logits.split(chunk_size) if teacher_logits is not None else None
    for c, chunk in enumerate(zip(*pieces)):
        # The teacher's logits are bound, not passed: a checkpoint saves its inputs, and the teacher's (made under
        # inference_mode, never requiring grad) then need no full-size copy.
        bound = functools.partial(fn, teacher_logits=None if teacher_pieces is None else teacher_pieces[c])
        chunk = [*chunk, lm_head_weight]
        sums.append(checkpoint(bound, *chunk, use_reentrant=False) if recompute else bound(*chunk))
    total = torch.stack(sums).sum(0)  # (len(names),)

    per_term = total / count.to(total.dtype)
    loss = (per_term * term_weights).sum()
    return loss, {name: per_term[i].detach() for i, name in enumerate(names)}


def _fused_head_sums(
    tensors: list,
    teacher_logits: Tensor | None,
    lm_head_weight: Tensor,
    fn,
    term_weights: Tensor,
    chunk_size: int,
    closed_form=None,
) -> tuple[Tensor, Tensor]:
    """The training path with the head applied in the loss: only the rows the mask keeps (a prompt's positions cost
    nothing), in chunks through `_FusedHeadSums` -> (weighted total, per-term sums (n,))."""
    student, topk_logprobs, topk_indices, labels, mask = tensors  # (N, ...) rows each
    keep = mask.nonzero().squeeze(1)  # (M,) the valid rows; one host sync per loss
    picked = [None if x is None else x.index_select(0, keep) for x in (topk_logprobs, topk_indices, labels)]
    valid = mask.new_ones(keep.shape[0])  # (M,)
    chunks = []
    for start in range(0, keep.shape[0], chunk_size):
        part = [None if x is None else x[start : start + chunk_size] for x in picked]
        chunks.append((keep[start : start + chunk_size], *part, valid[start : start + chunk_size]))
    hidden = student.index_select(0, keep)  # (M, D)
    return _FusedHeadSums.apply(hidden, lm_head_weight, [teacher_logits], chunks, fn, term_weights, closed_form)


# ----------------------------------------------------------------------------------------------------------------
# Validation metrics (temperature 1, no gradients)


@torch.no_grad()
def expected_acceptance_from_logits(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor,
    *,
    draft_rule: Literal["sample", "greedy"] = "sample",
    num_items: int | Tensor | None = None,
    chunk_size: int = 128,
) -> Tensor:
    """Expected acceptance of the student as a draft, averaged over valid positions (a 0-dim fp32 tensor).

    `sample`: sum_v min(p_v, q_v) = 1 - TV(p, q), the probability that speculative sampling accepts a token drawn
    from q (Leviathan et al. 2023). `greedy`: p(argmax q), the acceptance of a draft that proposes its argmax.
    The sum is divided by `num_items` (default mask.sum(), clamped to >= 1), so the per-batch values of a
    validation set add up to its mean when the global count is passed.
    """
    B, T, V = student_logits.shape
    student, teacher, valid = student_logits.reshape(-1, V), teacher_logits.reshape(-1, V), mask.reshape(-1)
    total = torch.zeros((), device=student.device)
    for start in range(0, B * T, chunk_size):
        p = F.softmax(teacher[start : start + chunk_size], dim=-1, dtype=torch.float32)  # (N, V)
        s = student[start : start + chunk_size]
        if draft_rule == "greedy":
            accept = p.gather(-1, s.argmax(-1, keepdim=True))[:, 0]
        else:
            accept = torch.minimum(p, F.softmax(s, dim=-1, dtype=torch.float32)).sum(-1)
        total += torch.where(valid[start : start + chunk_size], accept, 0.0).sum()
    count = mask.sum() if num_items is None else torch.as_tensor(num_items, device=mask.device)
    return total / count.float().clamp(min=1)


@torch.no_grad()
def greedy_match(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, *, num_items: int | Tensor | None = None
) -> Tensor:
    """Fraction of valid positions where the student's argmax equals the teacher's (greedy top-1 agreement)."""
    match = (student_logits.argmax(-1) == teacher_logits.argmax(-1)) & mask  # (B, T)
    count = mask.sum() if num_items is None else torch.as_tensor(num_items, device=mask.device)
    return match.sum().float() / count.float().clamp(min=1)


@torch.no_grad()
def topk_agreement_sums(
    student_logits: Tensor, topk_logprobs: Tensor, topk_ids: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """Sums over valid positions of the acceptance sum min(p, q) and of top-1 agreement, from the teacher cache.

    The acceptance is taken over K+1 buckets (the teacher's top-k tokens and one bucket for the rest of the mass),
    the view the cached loss trains on: an upper bound of sum_v min(p_v, q_v), exact once the top-k holds p's mass.
    """
    s = torch.log_softmax(student_logits.float(), dim=-1).gather(-1, topk_ids.long())  # (B, T, K)
    p, q = bucket_logprobs(topk_logprobs.float()).exp(), bucket_logprobs(s).exp()  # (B, T, K+1)
    accept = torch.minimum(p, q).sum(-1)  # (B, T)
    teacher_top1 = topk_ids.gather(-1, topk_logprobs.argmax(-1, keepdim=True))[..., 0]  # (B, T)
    agree = student_logits.argmax(-1) == teacher_top1
    return accept[mask].sum(), agree[mask].sum().float()


@torch.no_grad()
def validation_sums(
    student_logits: Tensor,
    teacher: TeacherTargets,
    labels: Tensor,
    mask: Tensor,
    objective: dict[str, float] | str,
    *,
    kd_temperature: float = 1.0,
    beta: float = 0.5,
    chunk_size: int = 128,
) -> tuple[Tensor, list[str]]:
    """One batch's validation row: sums over valid positions of [loss, expected acceptance, greedy top-1 match,
    token count, each objective term], fp32, to add up over batches and processes; and the terms' names.

    The acceptance is sum_v min(p, q) at temperature 1 from the teacher's logits, or the K+1-bucket view of the
    offline cache (`topk_agreement_sums`).
    """
    loss, terms = distill_loss(
        student_logits,
        teacher,
        labels,
        mask,
        objective,
        kd_temperature=kd_temperature,
        beta=beta,
        num_items=1,
        chunk_size=chunk_size,
    )  # num_items=1: sums
    if teacher.logits is None:
        accept, agree = topk_agreement_sums(student_logits, teacher.topk_logprobs, teacher.topk_indices, mask)
    else:
        accept = expected_acceptance_from_logits(
            student_logits, teacher.logits, mask, num_items=1, chunk_size=chunk_size
        )
        agree = greedy_match(student_logits, teacher.logits, mask, num_items=1)
    return torch.stack([loss, accept, agree, mask.sum().float(), *terms.values()]).float(), list(terms)
