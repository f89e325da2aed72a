"""Training an EAGLE-3 draft head (`draft.init: eagle3`): draft vocabulary, training-time-test loss, validation.

    draft, coverage = build_eagle3_student(teacher, cfg.draft, teacher_data.train, cand_dir)  # vocabulary counted once
    loss = eagle3_loss(draft, embed_weight, teacher, batch, num_items, cfg.draft, cfg.distill, aux_index)
    sums = eagle3_validation_sums(draft, embed_weight, teacher, batch, cfg.draft, cfg.distill, aux_index, ...)
    metrics = eagle3_validation_metrics(all_sums, cfg.draft.ttt_depth, coverage)   # sums added over the data

Alignment (EAGLE-3; SpecForge `OnlineEagle3Model`): draft row t reads the teacher's aux hidden states of token t and
the embedding of token t+1 at position t, and learns the teacher's distribution at position t+1 (the one that
predicted token t+2). Training-time test unrolls `draft.ttt_depth` steps: step j feeds step j-1's pre-norm output as
the hidden state, the ground-truth token t+1+j and position t+j, and attends the step-0 keys causally plus the
earlier steps' keys at the same row (`specdec_runtime.eagle3.ttt_mask`); its loss is weighted ttt_decay^j. The
objectives of `distill.objectives` run over the draft vocabulary: the teacher's logits restricted to it (so its
probabilities are renormalised over it) and positions whose teacher argmax lies outside it masked (SpecForge).

Validation measures the real thing instead: the draft's probabilities scattered to target ids (zero elsewhere)
against the teacher's full distribution, per unrolled position, and the chain tau those acceptances imply.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from distill.batches import IGNORE, collate
from distill.config import DistillConfig
from distill.data import AUX_HIDDEN as AUX_COLUMN
from distill.data import COMPLETE, load_teacher_data
from distill.objectives import (
    LOG_ZERO,
    TeacherTargets,
    distill_loss,
    expected_acceptance_from_logits,
    greedy_match,
    topk_agreement_sums,
)
from distill.students import HEAD_VARIANTS
from specdec_runtime.eagle3 import (
    Eagle3Cache,
    Eagle3Draft,
    default_aux_layers,
    target_aux_forward,
    target_ids,
    to_target_logits,
    ttt_mask,
)
from specdec_runtime.errors import UserError

VOCAB_FILE = "draft_vocab.json"  # <cand>/draft_vocab.json: the draft vocabulary, counted once per candidate


# ----------------------------------------------------------------------------------------------------------------
# Draft vocabulary and the student


def response_token_counts(train: Path, vocab_size: int) -> np.ndarray:
    """(V,) how often each id occurs among the response tokens of the training data (the tokens a head drafts when
    served, whatever positions its loss reads)."""
    ds = load_teacher_data(train).select_columns(["input_ids", "prompt_len"])
    counts = np.zeros(vocab_size, dtype=np.int64)
    for row in ds.iter(batch_size=256):
        for ids, p in zip(row["input_ids"], row["prompt_len"]):
            counts += np.bincount(np.asarray(ids[p:], dtype=np.int64), minlength=vocab_size)[:vocab_size]
    return counts


def choose_draft_vocab(counts: np.ndarray, size: int) -> tuple[list[int], float]:
    """The `size` most frequent ids (ties and never-seen fillers by ascending id), sorted ascending, and the share
    of the counted tokens they cover."""
    order = np.lexsort((np.arange(len(counts)), -counts))[:size]  # by count descending, then id
    ids = sorted(int(i) for i in order)
    total = int(counts.sum())
    return ids, float(counts[ids].sum() / total) if total else 1.0


def draft_vocab(train: Path, cand: Path, size: int, vocab_size: int, log: Callable[[str], object] = print) -> dict:
    """{"ids", "coverage", "size", "response_tokens"}: read from <cand>/draft_vocab.json when a previous run of the
    candidate wrote it (never rebuilt on resume), else counted from the training responses and written there."""
    path = cand / VOCAB_FILE
    if path.is_file():
        vocab = json.loads(path.read_text())
        log(f"eagle3: draft vocabulary of {vocab['size']} tokens from {path} (coverage {vocab['coverage']:.4f})")
        return vocab
    size = min(size, vocab_size)
    counts = response_token_counts(train, vocab_size)
    ids, coverage = choose_draft_vocab(counts, size)
    vocab = {"size": size, "coverage": coverage, "response_tokens": int(counts.sum()), "ids": ids}
    log(
        f"eagle3: draft vocabulary of {size} of {vocab_size} tokens covers {coverage:.4f} of the "
        f"{vocab['response_tokens']} training response tokens"
    )
    return vocab


def build_eagle3_student(teacher, draft_cfg, train: Path, cand: Path, *, is_main: bool = True, log=print):
    """A new EAGLE-3 head for `teacher` (fp32, on its device) and the share of the training response tokens its
    vocabulary covers; the main process writes <cand>/draft_vocab.json the first time (`draft_vocab`)."""
    L, V = teacher.config.num_hidden_layers, teacher.config.vocab_size
    vocab = draft_vocab(train, cand, draft_cfg.draft_vocab_size, V, log=log)
    if is_main and not (cand / VOCAB_FILE).is_file():
        from specdec_runtime.atomic import write_text

        write_text(cand / VOCAB_FILE, json.dumps(vocab))
    aux = draft_cfg.aux_layers if draft_cfg.aux_layers is not None else default_aux_layers(L)
    student = Eagle3Draft.from_target(
        teacher,
        torch.tensor(vocab["ids"]),
        aux,
        init_std=draft_cfg.init_std,
        norm_from_target=draft_cfg.norm_from_target,
        variants={k: getattr(draft_cfg, k) for k in HEAD_VARIANTS},
    )
    student.lm_head.weight.requires_grad_(not draft_cfg.freeze_lm_head)
    return student.float().train(), vocab["coverage"]


def describe_eagle3(student: Eagle3Draft, teacher, coverage: float) -> str:
    """One line: sizes, parameters and matmul FLOPs per drafted token relative to the teacher's."""
    params = sum(p.numel() for p in student.parameters())
    trainable = sum(p.numel() for p in student.parameters() if p.requires_grad)
    embedding = teacher.get_input_embeddings().weight
    teacher_matmul = sum(p.numel() for p in teacher.parameters() if p is not embedding)
    teacher_matmul += embedding.numel() if teacher.get_output_embeddings().weight is embedding else 0
    # Later drafted tokens skip fc (their hidden state is already H wide): the per-token cost of a draft step.
    flop_ratio = (params - student.fc.weight.numel()) / teacher_matmul
    cfg = student.config
    return (
        f"student: EAGLE-3 head, hidden {cfg.hidden_size}, draft vocabulary {student.lm_head.out_features} of "
        f"{cfg.vocab_size} (coverage {coverage:.4f}), "
        f"{params / 1e6:.2f}M params ({trainable / 1e6:.2f}M trainable) | teacher: "
        f"{teacher.config.num_hidden_layers} layers | flop_ratio {flop_ratio:.3f} per drafted token"
    )


def frozen_embedding(teacher, device) -> Tensor:
    """(V, H) fp32 copy of the teacher's input embeddings on `device`: frozen, shared by nothing, so the offline
    cache can drop the teacher."""
    return teacher.get_input_embeddings().weight.detach().float().to(device).clone()


# ----------------------------------------------------------------------------------------------------------------
# Batches and teacher targets


def collate_eagle3(
    rows: list[dict], *, max_seq_len: int, pad_id: int, topk: bool, loss_on_prompt: bool = False
) -> dict[str, Tensor]:
    """`distill.batches.collate`, plus the cached aux hidden states (B, T, n_aux * H) fp16 when the rows carry them
    (stored at every position, so prompt rows need nothing more with `loss_on_prompt`)."""
    batch = collate(rows, max_seq_len=max_seq_len, pad_id=pad_id, topk=topk, loss_on_prompt=loss_on_prompt)
    if rows and AUX_COLUMN in rows[0]:
        B, T = batch["input_ids"].shape
        width = next(len(r[AUX_COLUMN][0]) for r in rows if len(r[AUX_COLUMN]))
        aux = torch.zeros(B, T, width, dtype=torch.float16)
        for b, row in enumerate(rows):
            rows_b = torch.tensor(np.asarray(row[AUX_COLUMN][:max_seq_len], dtype=np.float16))
            aux[b, : len(rows_b)] = rows_b
        batch[AUX_COLUMN] = aux
    return batch


def cache_aux_index(stored: list[int], wanted: list[int], hidden_size: int) -> Tensor:
    """Column indices into the cached (..., len(stored) * H) aux states that give `wanted`'s (..., 3H)."""
    missing = [i for i in wanted if i not in stored]
    if missing:
        raise UserError(
            f"the offline teacher cache holds the hidden states of layers {stored}, not {missing}: regenerate the "
            "data (specdistill data) with this candidate's draft.aux_layers"
        )
    return torch.cat([torch.arange(hidden_size) + stored.index(i) * hidden_size for i in wanted])


def teacher_view(teacher, batch: dict[str, Tensor], aux_layers: list[int], aux_index: Tensor | None):
    """(aux hidden states (B, T, 3H), teacher logits (B, T, V) or None, top-k (ids, logprobs) or None) from one
    teacher forward, or from the batch's offline cache when `teacher` is None. No autograd graph."""
    if teacher is None:
        aux = batch[AUX_COLUMN].index_select(-1, aux_index.to(batch[AUX_COLUMN].device))
        return aux.float(), None, (batch["topk_ids"], batch["topk_logprobs"])
    with torch.no_grad():  # not inference_mode: the aux states feed the student's autograd graph
        logits, aux = target_aux_forward(
            teacher, batch["input_ids"], aux_layers, attention_mask=batch["attention_mask"], use_cache=False
        )
    return aux, logits, None


def shift(x: Tensor, n: int, fill) -> Tensor:
    """x[:, t + n] at row t along dim 1, `fill` past the end: (B, T, ...) -> (B, T, ...)."""
    out = torch.full_like(x, fill)
    out[:, : x.shape[1] - n] = x[:, n:]
    return out


def draft_targets(student: Eagle3Draft, logits: Tensor | None, topk, pad: int = 0) -> tuple[TeacherTargets, Tensor]:
    """(the teacher over the draft vocabulary for T + pad rows, the last `pad` rows at LOG_ZERO; the teacher's
    argmax lies in the draft vocabulary (B, T)). From online `logits` (B, T, V): dense fp32 logits (B, T + pad, Vd).
    From the cache's top-k (ids, log-probs) (B, T, K): sparse (`TeacherTargets.support_logits`, (B, T + pad, K) in
    draft indices), the ids outside the draft vocabulary at LOG_ZERO, so the loss renormalises over the draft
    vocabulary as the dense targets would. The pad rows let unrolled step j read rows j + 1 .. j + T as a view
    instead of a shifted copy per step (`window`)."""
    keep = target_ids(student.d2t)  # (Vd,)
    if logits is not None:
        dense = logits[..., keep].float()
        fill = dense.new_full((dense.shape[0], pad, len(keep)), LOG_ZERO)
        return TeacherTargets(logits=torch.cat([dense, fill], 1) if pad else dense), student.t2d[logits.argmax(-1)]
    ids, logprobs = topk[0].long(), topk[1].float()  # (B, T, K)
    B, T, K = ids.shape
    index = torch.cumsum(student.t2d.long(), 0) - 1  # target id -> draft index where t2d
    inside = student.t2d[ids]
    support = logprobs.new_full((B, T + pad, K), LOG_ZERO)
    support[:, :T] = torch.where(inside, logprobs, LOG_ZERO)
    support_ids = ids.new_zeros((B, T + pad, K))  # padding (at LOG_ZERO) points at id 0
    support_ids[:, :T] = torch.where(inside, index[ids], 0)
    top1 = ids.gather(-1, logprobs.argmax(-1, keepdim=True))[..., 0]  # (B, T)
    return TeacherTargets(support_logits=support, support_ids=support_ids), student.t2d[top1]


def window(targets: TeacherTargets, n: int, T: int) -> TeacherTargets:
    """Rows n .. n + T of `draft_targets`' padded rows, as views: the targets shifted by n, LOG_ZERO past the end."""
    if targets.logits is not None:
        return TeacherTargets(logits=targets.logits[:, n : n + T])
    rows = slice(n, n + T)
    return TeacherTargets(support_logits=targets.support_logits[:, rows], support_ids=targets.support_ids[:, rows])


def draft_labels(student: Eagle3Draft, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(labels as draft-vocabulary indices (B, T), whether each label lies in the draft vocabulary (B, T))."""
    safe = labels.clamp(min=0)
    index = torch.cumsum(student.t2d.long(), 0) - 1
    return index[safe].clamp(min=0), student.t2d[safe] & (labels != IGNORE)


# ----------------------------------------------------------------------------------------------------------------
# The training-time-test loss


class TTTCache:
    """An `Eagle3Cache` behind a plain object, for the unroll: FSDP2's forward hook rebuilds a dataclass argument
    that holds tensors requiring grad (`replace_grad_tensors`), so the keys a step appends would land in a copy and
    the next step would see the step-0 keys only."""

    def __init__(self):
        self.cache = Eagle3Cache()

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.cache.append(k, v)


def ttt_logits(
    student,
    aux: Tensor,
    embeds: Tensor,
    depth: int,
    packing: Packing | None = None,
    *,
    head=True,
    rows: list[Tensor] | None = None,
):
    """Yield (step j, draft logits (B, T, Vd), or with head=False lm_head's input (B, T, H)) of the training-time-
    test unroll: aux (B, T, 3H) are the teacher's states of the batch's tokens, embeds (B, T, H) their embeddings.
    Row t of step j sits at position t + j, reads token t + 1 + j and step j - 1's pre-norm output of row t, and
    sees the step-0 keys of rows <= t and the keys of steps 1..j of row t: what a chain draft computes at inference
    for its (j + 1)-th token after token t + 1.

    With `packing` the rows hold several sequences: positions count from each sequence's start, and the step-0
    keys of other sequences are masked. A row whose token t + 1 + j lies in the next sequence computes garbage
    that no valid row reads (it only sees keys of rows <= t of its own sequence and its own), and its loss is
    masked (`Packing.same`).

    With `rows` (`trained_rows`: per step j the sorted (R_j,) rows it computes, each step's a subset of the one
    before) step j yields (B, R_j, ...) for those rows only, the same values as the full unroll's: row t of step j
    reads only row t of the steps before and the step-0 keys, so step 0 still computes every row's key and value
    and nothing else of the rows no later step reads."""
    B, T, _ = embeds.shape
    position = torch.arange(T, device=embeds.device).expand(B, T) if packing is None else packing.position
    segments = None if packing is None else packing.segments
    hidden, cache = aux, TTTCache()
    for j in range(depth):
        inputs = hidden, shift(embeds, 1 + j, 0.0), position + j
        if rows is None:
            out = student(*inputs, cache, ttt_mask(T, j, embeds.device, segments), head=head)
        elif j == 0:
            out = student(*inputs, cache, ttt_rows_mask(T, rows[:1], segments), head=head, rows=rows[0])
        else:  # the step's rows of the inputs (hidden holds the previous step's rows)
            kept = (torch.searchsorted(rows[j - 1], rows[j]), rows[j], rows[j])
            inputs = tuple(x[:, r] for x, r in zip(inputs, kept))
            out = student(*inputs, cache, ttt_rows_mask(T, rows[: j + 1], segments), head=head)
        logits, hidden = out
        yield j, logits


def ttt_rows_mask(T: int, rows: list[Tensor], segments: Tensor | None = None) -> Tensor:
    """`ttt_mask` of step j = len(rows) - 1 for the rows it computes: (R_j, T + R_1 + ... + R_j) bool over keys
    [step 0 (every row) | step 1 (R_1 rows) | ... | step j (R_j rows)], or (B, 1, R_j, ...) with `segments`. With
    every row at every step it is `ttt_mask(T, j)`."""
    r = rows[-1]
    causal = r[:, None] >= torch.arange(T, device=r.device)  # (R, T)
    own = [r[:, None] == earlier[None, :] for earlier in rows[1:]]  # (R, R_i): the row's own key at step i
    if segments is None:
        return torch.cat([causal, *own], dim=1)
    B = segments.shape[0]
    causal = causal & (segments[:, r, None] == segments[:, None, :])  # (B, R, T)
    return torch.cat([causal, *(m.expand(B, *m.shape) for m in own)], dim=2)[:, None]


def rows_can_be_skipped(head: Eagle3Draft) -> bool:
    """Whether `ttt_logits(rows=...)` computes what the full unroll does for `head`: not with a sliding window (it
    compares positions with key indices, which the restricted steps renumber) nor a rotary embedding that rescales
    with the largest position of a call (dynamic, longrope: a restricted step's largest position is smaller)."""
    return head.midlayer.self_attn.sliding_window is None and head.rotary.rope_type not in ("dynamic", "longrope")


def trained_rows(masks: list[Tensor]) -> list[Tensor]:
    """Per unrolled step j, the sorted (R_j,) rows some step k >= j trains (`masks[k]` (B, T) bool, any of the B):
    the rows step j must compute, since step k reads row t of every step before it and nothing else of them."""
    rows, needed = [], torch.zeros_like(masks[0][0])
    for mask in reversed(masks):
        needed = needed | mask.any(0)
        rows.append(needed.nonzero()[:, 0])
    return rows[::-1]


@dataclass
class Packing:
    """A padded micro-batch's sequences concatenated into one row (`draft.pack_sequences`, as speculators packs):
    the unroll then computes on the batch's real tokens only instead of B x its longest."""

    keep: Tensor
    """(B, T) bool: the padded batch's real positions, taken row after row."""
    segments: Tensor
    """(1, N) which sequence (row of the padded batch) each packed position came from."""
    position: Tensor
    """(1, N) each packed position's position within its sequence."""

    @classmethod
    def of(cls, attention_mask: Tensor) -> Packing:
        keep = attention_mask.bool()
        B, T = keep.shape
        rows = torch.arange(B, device=keep.device)[:, None].expand(B, T)
        return cls(keep, rows[keep][None], (keep.cumsum(1) - 1)[keep][None])

    def __call__(self, x: Tensor) -> Tensor:
        """(B, T, ...) -> (1, N, ...)."""
        return x[self.keep][None]

    def same(self, n: int) -> Tensor:
        """(1, N) bool: position t + n belongs to the same sequence as t."""
        return shift(self.segments, n, -1) == self.segments


def unrolled_steps(
    student,
    embed_weight: Tensor,
    batch: dict[str, Tensor],
    view,
    draft_cfg,
    distill_cfg: DistillConfig,
    num_items,
    *,
    pack: bool = False,
    trained_only: bool = False,
    lm_head_weight: Tensor | None = None,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
):
    """Yield (step j, draft logits (B, T, Vd), step j's objective summed over its valid rows / num_items, its
    terms) for j < draft.ttt_depth, from `teacher_view`'s output `view`. Step j's rows sit at positions t + j, read
    the embedding of token t + 1 + j and learn the teacher's distribution at position t + 1 + j. With `pack` the
    batch's sequences are first concatenated into one row (`Packing`), and the logits are (1, N, Vd).

    With `trained_only` each step computes only the rows its own loss or a later step's reads (`trained_rows`;
    the same loss and gradients, up to float rounding) and the logits of the others are zeros: with the loss on
    response tokens only, most rows of the unroll are prompt rows that nothing reads (`rows_can_be_skipped`).

    With `lm_head_weight` (the head's own weight; not under FSDP, which shards it outside the forward) the loss
    applies the head to the valid rows only, chunk by chunk with the gradient in the forward (`distill_loss`'s
    `student_hidden`), inside `autocast` (the one accelerate applies inside the forward, which the head's matmul now
    runs outside of): no (B, T, Vd) logits exist, and the logits yielded are None."""
    plain = _unwrap(student)
    aux, logits, topk = view
    labels, input_ids, packing = batch["labels"], batch["input_ids"], None
    if pack and plain.midlayer.self_attn.sliding_window is not None:
        # its window counts keys by their index in the row, which packing makes differ from their positions
        raise UserError("draft.pack_sequences needs a head without a sliding window; set draft.pack_sequences=false")
    if pack:
        packing = Packing.of(batch["attention_mask"])
        aux, labels, input_ids = packing(aux), packing(labels), packing(input_ids)
        logits = None if logits is None else packing(logits)
        topk = None if topk is None else tuple(packing(x) for x in topk)
    depth = draft_cfg.ttt_depth
    teacher_d, in_vocab = draft_targets(plain, logits, topk, pad=depth)  # T + depth rows, (B, T)
    valid = labels != IGNORE
    labels_d, label_in = draft_labels(plain, labels) if "ce" in distill_cfg.objective else (labels.clamp(min=0), valid)
    dtype = plain.fc.weight.dtype  # fp32 masters (autocast runs the matmuls in bf16), or DeepSpeed's bf16 copy
    embeds = nn.functional.embedding(input_ids, embed_weight).to(dtype)  # (B, T, H), frozen
    fused = lm_head_weight is not None
    T = labels.shape[1]
    masks = [shift(valid & in_vocab & label_in, 1 + j, False) for j in range(depth)]
    if packing is not None:  # token t + n of a packed row may be the next sequence's
        masks = [mask & packing.same(1 + j) for j, mask in enumerate(masks)]
    rows = trained_rows(masks) if trained_only and rows_can_be_skipped(plain) else None
    for j, out in ttt_logits(student, aux.to(dtype), embeds, depth, packing, head=not fused, rows=rows):
        n = 1 + j
        if rows is not None:  # back in their places: the targets stay views, rows no loss reads hold zeros
            out = out.new_zeros(*labels.shape, out.shape[-1]).index_copy(1, rows[j], out)  # (B, T, H or Vd)
        student_out = (
            dict(student_logits=None, student_hidden=out, lm_head_weight=lm_head_weight)
            if fused
            else dict(student_logits=out)
        )
        with autocast() if fused else nullcontext():
            loss, terms = distill_loss(
                teacher=window(teacher_d, n, T),  # shift(.., n, LOG_ZERO), views
                labels=shift(labels_d, n, 0),
                mask=masks[j],
                objective=distill_cfg.objective,
                kd_temperature=distill_cfg.kd_temperature,
                beta=distill_cfg.beta,
                num_items=num_items,
                chunk_size=distill_cfg.chunk_size,
                **student_out,
            )
        yield j, None if fused else out, loss, terms


def eagle3_loss(
    student,
    embed_weight: Tensor,
    teacher,
    batch: dict[str, Tensor],
    num_items: Tensor | int,
    draft_cfg,
    distill_cfg: DistillConfig,
    aux_index: Tensor | None,
    *,
    aux_layers: list[int],
    lm_head_weight: Tensor | None = None,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
) -> Tensor:
    """This micro-batch's share of the step loss: sum_j ttt_decay^j x (the objective of unrolled step j summed over
    its valid rows) / `num_items`, the step's global trained-token count. `student` may be the prepared (DDP /
    FSDP / DeepSpeed) module: every step goes through its forward. `lm_head_weight`, `autocast`: the loss applies
    the head (`unrolled_steps`)."""
    view = teacher_view(teacher, batch, aux_layers, aux_index)
    steps = unrolled_steps(
        student, embed_weight, batch, view, draft_cfg, distill_cfg, num_items,
        pack=draft_cfg.pack_sequences, trained_only=draft_cfg.skip_untrained_rows,
        lm_head_weight=lm_head_weight, autocast=autocast,
    )  # fmt: skip
    return sum(draft_cfg.ttt_decay**j * loss for j, _, loss, _ in steps)


def _unwrap(model):
    """The Eagle3Draft inside a DDP / FSDP / DeepSpeed wrapper (for its buffers; forwards go through the wrapper)."""
    while not isinstance(model, Eagle3Draft) and hasattr(model, "module"):
        model = model.module
    return model


# ----------------------------------------------------------------------------------------------------------------
# Validation


@torch.no_grad()
def eagle3_validation_sums(
    student,
    embed_weight: Tensor,
    teacher,
    batch,
    draft_cfg,
    distill_cfg: DistillConfig,
    aux_index,
    *,
    aux_layers: list[int],
) -> Tensor:
    """One batch's sums, fp32 (2 + 3 x depth,): [loss, response tokens] then per unrolled position j [expected
    acceptance sum_v min(p_v, q_v), greedy top-1 match, valid rows], with q the draft's distribution scattered to
    target ids (0 off its vocabulary) and p the teacher's full one (or the offline cache's K+1 buckets)."""
    plain = _unwrap(student)
    view = teacher_view(teacher, batch, aux_layers, aux_index)
    _, logits, topk = view
    valid = batch["labels"] != IGNORE
    rows = [valid.new_zeros((), dtype=torch.float32), valid.sum().float()]
    for j, draft_logits, loss, _ in unrolled_steps(student, embed_weight, batch, view, draft_cfg, distill_cfg, 1):
        n, mask = 1 + j, shift(valid, 1 + j, False)
        rows[0] = rows[0] + draft_cfg.ttt_decay**j * loss.float()
        accept = agree = torch.zeros((), device=mask.device)
        if logits is None:
            teacher_ids, teacher_lp = shift(topk[0], n, 0), shift(topk[1], n, 0.0)  # (B, T, K)
        # One row and chunk_size positions at a time: the (chunk, V) target-id logits are the large tensor (a
        # whole row's took 126 MB at 640 positions of a 49k vocabulary, the process's peak after training).
        C = distill_cfg.chunk_size
        for b in range(mask.shape[0]):
            teacher_p = None if logits is None else shift(logits[b : b + 1], n, 0.0)  # (1, T, V)
            for t in range(0, mask.shape[1], C):
                at = (slice(b, b + 1), slice(t, t + C))
                m = mask[at]
                if not m.any():  # a prompt's positions: nothing to measure
                    continue
                q = to_target_logits(draft_logits[at].float(), plain.d2t, plain.target_vocab)  # (1, C, V)
                if teacher_p is not None:
                    p = teacher_p[:, t : t + C]
                    accept = accept + expected_acceptance_from_logits(q, p, m, num_items=1, chunk_size=C)
                    agree = agree + greedy_match(q, p, m, num_items=1)
                else:
                    a, g = topk_agreement_sums(q, teacher_lp[at], teacher_ids[at], m)
                    accept, agree = accept + a, agree + g
        rows += [accept, agree, mask.sum().float()]
    return torch.stack([r.float() for r in rows])


def chain_tau(acceptance: list[float]) -> float:
    """Tokens per verify step of a chain drafting len(acceptance) tokens whose position i is accepted with
    probability acceptance[i] given the earlier ones were: 1 + sum_k prod_{i < k} acceptance[i]."""
    tau, alive = 1.0, 1.0
    for a in acceptance:
        alive *= a
        tau += alive
    return tau


def eagle3_validation_metrics(sums: list[float], depth: int, coverage: float) -> dict[str, float]:
    """The validation metrics from `eagle3_validation_sums` added up over the validation data and processes:

    eval/loss, eval/expected_acceptance and eval/greedy_match (position 0, the numbers standalone drafts report),
    eval/expected_acceptance_{j} and eval/greedy_match_{j} per unrolled position j, eval/simulated_tau (the chain
    tau of `depth` tokens sampled at temperature 1) and eval/simulated_tau_greedy (temperature 0), eval/tokens,
    eval/draft_vocab_coverage (`coverage`, of the training responses)."""
    per = [sums[2 + 3 * j : 5 + 3 * j] for j in range(depth)]  # [accept, agree, rows] per position
    accept = [a / max(n, 1.0) for a, _, n in per]
    agree = [g / max(n, 1.0) for _, g, n in per]
    metrics = {
        "eval/loss": sums[0] / max(sums[1], 1.0),
        "eval/expected_acceptance": accept[0],
        "eval/greedy_match": agree[0],
        "eval/tokens": sums[1],
        "eval/simulated_tau": chain_tau(accept),
        "eval/simulated_tau_greedy": chain_tau(agree),
        "eval/draft_vocab_coverage": coverage,
    }
    metrics |= {f"eval/expected_acceptance_{j}": a for j, a in enumerate(accept)}
    return metrics | {f"eval/greedy_match_{j}": g for j, g in enumerate(agree)}


# ----------------------------------------------------------------------------------------------------------------
# What the distillation recipe calls


@dataclass
class Eagle3Training:
    """The EAGLE-3 parts of one candidate's distillation: its student, the frozen embeddings, which aux states it
    reads, and the loss and the validation pieces the recipe uses in place of the standalone ones (same signatures:
    `validation_sums` and `validation_metrics` plug into train/'s validation loop, with `collate_eagle3`)."""

    student: Eagle3Draft
    """The head being trained (fp32, on the recipe's device)."""
    embed_weight: Tensor
    """(V, H) frozen fp32 copy of the teacher's input embeddings."""
    draft: object
    """The candidate's DraftConfig."""
    aux_layers: list[int]
    """The teacher layers the head reads (HF output_hidden_states indices)."""
    aux_index: Tensor | None
    """Offline cache: columns of the cached aux states that give `aux_layers`; None with the teacher online."""
    coverage: float
    """Share of the training response tokens inside the draft vocabulary."""

    @property
    def columns(self) -> list[str]:
        """Dataset columns the recipe must load besides the standalone ones."""
        return [AUX_COLUMN] if self.aux_index is not None else []

    @classmethod
    def setup(
        cls,
        teacher,
        draft_cfg,
        distill_cfg: DistillConfig,
        teacher_data,
        cand: Path,
        *,
        device,
        is_main: bool,
        log=print,
    ):
        if distill_cfg.lmbda > 0:
            raise UserError("distill.lmbda > 0 (on-policy data) is not supported for draft.init=eagle3; set it to 0")
        student, coverage = build_eagle3_student(teacher, draft_cfg, teacher_data.train, cand, is_main=is_main, log=log)
        L, H = teacher.config.num_hidden_layers, teacher.config.hidden_size
        aux = student.aux_layers(L)
        index = None
        if distill_cfg.teacher == "cache":
            stored = cached_layers_of(teacher_data.train)
            if stored is None:
                raise UserError(
                    f"{teacher_data.train} holds no aux hidden states: an EAGLE-3 candidate with distill.teacher=cache "
                    "needs data generated with data.teacher_cache=true after this candidate was configured"
                )
            index = cache_aux_index(stored, aux, H)
        log(describe_eagle3(student, teacher, coverage))
        embed = frozen_embedding(teacher, device)
        return cls(student.to(device), embed, draft_cfg, aux, index, coverage)

    def loss(
        self,
        student,
        teacher,
        batch: dict[str, Tensor],
        num_items,
        distill_cfg: DistillConfig,
        *,
        head=None,
        autocast=nullcontext,
    ) -> Tensor:
        return eagle3_loss(
            student, self.embed_weight, teacher, batch, num_items, self.draft, distill_cfg, self.aux_index,
            aux_layers=self.aux_layers, lm_head_weight=head, autocast=autocast,
        )  # fmt: skip

    def validation_sums(self, student, teacher, batch: dict[str, Tensor], distill_cfg: DistillConfig) -> Tensor:
        return eagle3_validation_sums(
            student, self.embed_weight, teacher, batch, self.draft, distill_cfg, self.aux_index,
            aux_layers=self.aux_layers,
        )  # fmt: skip

    def validation_metrics(self, sums: list[float], distill_cfg: DistillConfig) -> dict[str, float]:
        return eagle3_validation_metrics(sums, self.draft.ttt_depth, self.coverage)


# ----------------------------------------------------------------------------------------------------------------
# The offline cache's aux layers


def cached_aux_layers(candidates, num_layers: int) -> list[int] | None:
    """The aux layers the offline teacher cache must store: the union (sorted) of every EAGLE-3 candidate's that
    trains from the cache (`candidates`: (DraftConfig, DistillConfig) pairs), None when none does."""
    layers = set()
    for draft, distill in candidates:
        if draft.init == "eagle3" and distill.teacher == "cache":
            layers |= set(draft.aux_layers if draft.aux_layers is not None else default_aux_layers(num_layers))
    return sorted(layers) or None


def cached_layers_of(path: Path) -> list[int] | None:
    """The aux layers whose hidden states the finished teacher dataset at `path` holds (None: none)."""
    text = (Path(path) / COMPLETE).read_text()
    return json.loads(text).get("aux_layers") if text.strip() else None
