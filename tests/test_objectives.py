"""Property tests of the distillation objectives (distill/objectives.py): tiny random logits, CPU, fp32."""

import pytest
import torch
import torch.nn.functional as F

import distill.objectives as objectives
from distill.config import OBJECTIVES
from distill.objectives import (
    KD_TERMS,
    LOG_ZERO,
    TeacherTargets,
    dense_from_support,
    distill_loss,
    expected_acceptance_from_logits,
    forward_kl,
    generalized_jsd,
    greedy_match,
    reverse_kl,
)

B, T, V = 3, 7, 11


def _batch(seed: int = 0, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    student = (scale * torch.randn(B, T, V, generator=g)).requires_grad_()
    teacher = scale * torch.randn(B, T, V, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0, 0] = True  # never empty by chance
    return student, teacher, labels, mask


def _topk(teacher_logits: torch.Tensor, k: int) -> TeacherTargets:
    logprobs, indices = F.log_softmax(teacher_logits, dim=-1).topk(k, dim=-1)
    return TeacherTargets(topk_logprobs=logprobs, topk_indices=indices)


def _loss(student, teacher, labels, mask, objective, **kw):
    return distill_loss(student, teacher, labels, mask, objective, **kw)[0]


@pytest.mark.parametrize("name", KD_TERMS)
@pytest.mark.parametrize("kd_temperature", [1.0, 2.5])
def test_zero_for_equal_distributions(name, kd_temperature):
    student, _, labels, mask = _batch()
    same = student.detach().clone()
    for teacher in (TeacherTargets(logits=same), _topk(same, 4)):
        loss = _loss(student, teacher, labels, mask, name, kd_temperature=kd_temperature)
        assert abs(loss.item()) < 1e-6, (name, teacher.logits is None, loss.item())
    different = _loss(student, TeacherTargets(logits=same.flip(-1)), labels, mask, name)
    assert different.item() > 1e-3  # the zero above is not a constant


def test_forward_and_reverse_kl_match_torch_kl_div():
    student, teacher, labels, mask = _batch()
    s, t = F.log_softmax(student.detach(), -1)[mask], F.log_softmax(teacher, -1)[mask]  # (N, V)
    fwd = F.kl_div(s, t, reduction="sum", log_target=True) / mask.sum()  # kl_div(input, target) = KL(target || input)
    rev = F.kl_div(t, s, reduction="sum", log_target=True) / mask.sum()
    teacher_targets = TeacherTargets(logits=teacher)
    torch.testing.assert_close(_loss(student, teacher_targets, labels, mask, "forward_kl"), fwd)
    torch.testing.assert_close(_loss(student, teacher_targets, labels, mask, "reverse_kl"), rev)


def test_jsd_endpoints_are_the_two_kls_in_trl_convention():
    student, teacher, _, _ = _batch()
    t, s = F.log_softmax(teacher.double(), -1), F.log_softmax(student.detach().double(), -1)
    torch.testing.assert_close(generalized_jsd(t, s, 0.0), forward_kl(t, s))
    torch.testing.assert_close(generalized_jsd(t, s, 1.0), reverse_kl(t, s))
    # The endpoints are the limits up to scale: JSD_beta / beta -> KL(p || q), JSD_beta / (1 - beta) -> KL(q || p).
    eps = 1e-5
    torch.testing.assert_close(generalized_jsd(t, s, eps) / eps, forward_kl(t, s), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(generalized_jsd(t, s, 1 - eps) / eps, reverse_kl(t, s), rtol=1e-3, atol=1e-6)


def test_jsd_matches_the_mixture_definition():
    student, teacher, labels, mask = _batch()
    beta = 0.3
    p, q = F.softmax(teacher.double(), -1), F.softmax(student.detach().double(), -1)
    m = beta * p + (1 - beta) * q  # the mixture leans to the teacher as beta grows (TRL's convention)
    jsd = beta * (p * (p / m).log()).sum(-1) + (1 - beta) * (q * (q / m).log()).sum(-1)  # (B, T)
    expected = jsd[mask].sum() / mask.sum()
    loss = _loss(student, TeacherTargets(logits=teacher), labels, mask, "jsd", beta=beta)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


def test_tv_is_one_minus_sum_min():
    student, teacher, labels, mask = _batch()
    tv = _loss(student, TeacherTargets(logits=teacher), labels, mask, "tv")
    acceptance = expected_acceptance_from_logits(student, teacher, mask, chunk_size=5)
    p, q = F.softmax(teacher, -1), F.softmax(student.detach(), -1)
    expected = torch.minimum(p, q).sum(-1)[mask].mean()
    torch.testing.assert_close(acceptance, expected)
    torch.testing.assert_close(tv, 1 - acceptance)


def test_ce_is_nll_of_labels():
    student, _, labels, mask = _batch()
    expected = F.cross_entropy(student.detach().reshape(-1, V), labels.masked_fill(~mask, -100).reshape(-1))
    torch.testing.assert_close(_loss(student, None, labels.masked_fill(~mask, -100), mask, "ce"), expected)


def test_mix_is_weighted_sum_and_metrics_are_per_term():
    student, teacher, labels, mask = _batch()
    teacher_targets = TeacherTargets(logits=teacher)
    weights = {"forward_kl": 0.5, "tv": 2.0, "ce": 0.25, "jsd": 0.0}
    loss, metrics = distill_loss(student, teacher_targets, labels, mask, weights, beta=0.2)
    assert set(metrics) == set(weights)
    expected = sum(w * _loss(student, teacher_targets, labels, mask, n, beta=0.2) for n, w in weights.items())
    torch.testing.assert_close(loss, expected)
    for name in weights:
        torch.testing.assert_close(metrics[name], _loss(student, teacher_targets, labels, mask, name, beta=0.2))
    assert metrics["jsd"].item() > 0  # weight 0 still reports the value


@pytest.mark.parametrize("teacher_kind", ["full", "topk"])
def test_chunked_equals_unchunked_with_gradients(teacher_kind):
    student, teacher, labels, mask = _batch()
    teacher_targets = TeacherTargets(logits=teacher) if teacher_kind == "full" else _topk(teacher, 3)
    objective = {"forward_kl": 1.0, "reverse_kl": 0.5, "jsd": 0.5, "tv": 1.0, "ce": 0.3}
    results = []
    for chunk_size in (1, 4, 1000):
        loss = _loss(student, teacher_targets, labels, mask, objective, chunk_size=chunk_size, kd_temperature=1.5)
        (grad,) = torch.autograd.grad(loss, student)
        results.append((loss.detach(), grad))
    for loss, grad in results[:-1]:
        torch.testing.assert_close(loss, results[-1][0])
        torch.testing.assert_close(grad, results[-1][1])


def test_teacher_logits_from_inference_mode_need_no_copy_and_give_the_same_gradients():
    """The training loop hands distill_loss the teacher's logits as they come out of torch.inference_mode."""
    student, teacher, labels, mask = _batch()
    with torch.inference_mode():
        frozen = teacher.clone()
    objective = {"forward_kl": 1.0, "reverse_kl": 0.5, "jsd": 0.5, "tv": 1.0, "ce": 0.3}
    grads = []
    for logits in (teacher, frozen):
        loss = _loss(student, TeacherTargets(logits=logits), labels, mask, objective, chunk_size=4, kd_temperature=2.0)
        grads.append((loss.detach(), *torch.autograd.grad(loss, student)))
    assert frozen.is_inference()
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def _hidden_case(seed: int = 1, D: int = 5):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g, requires_grad=True)
    weight = torch.randn(V, D, generator=g, requires_grad=True)
    return hidden, weight


@pytest.mark.parametrize("teacher_kind", ["full", "inference", "topk"])
@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_hidden_states_path_equals_logits_path(teacher_kind, chunk_size):
    """The training path (hidden states + head, its gradient computed in the forward: `_FusedHeadSums`) gives the
    loss, the metrics and the gradients of plain autograd through the full logits: every term with a weight 0 one,
    kd_temperature != 1, prompt rows masked with labels -100, a global token count."""
    hidden, weight = _hidden_case()
    _, teacher, labels, mask = _batch()
    mask[2] = False  # a sequence with no valid row
    labels = labels.masked_fill(~mask, -100)
    with torch.inference_mode():
        frozen = teacher.clone()
    targets = {"full": TeacherTargets(logits=teacher), "inference": TeacherTargets(logits=frozen)}.get(teacher_kind)
    targets = targets or _topk(teacher, 3)
    objective = {"forward_kl": 1.0, "reverse_kl": 0.5, "jsd": 0.0, "tv": 1.0, "ce": 0.3}
    kw = dict(kd_temperature=1.5, beta=0.3, num_items=40)
    ref, ref_terms = distill_loss(hidden @ weight.T, targets, labels, mask, objective, **kw)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    head = dict(student_hidden=hidden, lm_head_weight=weight, chunk_size=chunk_size)
    loss, terms = distill_loss(None, targets, labels, mask, objective, **head, **kw)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(terms, ref_terms)
    assert terms["jsd"] > 0  # weight 0: reported, no gradient
    grads = torch.autograd.grad(3.0 * loss, (hidden, weight))  # the upstream gradient scales the stored one
    for grad, expected in zip(grads, ref_grads):
        torch.testing.assert_close(grad, 3.0 * expected)
    assert grads[0][2].abs().sum() == 0  # masked rows get an exact zero


def _sparse(teacher_logits: torch.Tensor, k: int, pad: int = 2) -> TeacherTargets:
    """Each row's k largest logits, then `pad` padding entries at LOG_ZERO on id 0 (as the EAGLE-3 targets pad)."""
    values, ids = teacher_logits.topk(k, dim=-1)
    fill = torch.full((*values.shape[:-1], pad), LOG_ZERO)
    zeros = torch.zeros(*ids.shape[:-1], pad, dtype=torch.long)
    return TeacherTargets(support_logits=torch.cat([values, fill], -1), support_ids=torch.cat([ids, zeros], -1))


@pytest.mark.parametrize(
    "objective",
    ["forward_kl", {"forward_kl": 0.7, "ce": 0.3}, "ce", {"forward_kl": 1.0, "reverse_kl": 0.5, "jsd": 0.2, "tv": 1.0}],
)
@pytest.mark.parametrize("kd_temperature", [1.0, 2.5, 0.5, 8.0])
def test_a_sparse_teacher_is_the_dense_logits_it_stands_for(objective, kd_temperature, monkeypatch):
    """Support logits give the loss, metrics and gradients of their dense logits (LOG_ZERO off the support at
    kd_temperature: reverse_kl reads the stand-in's value there), on the
    logits path (densified chunk by chunk) and on the training path, where forward_kl and ce take the closed form
    (`_support_sums_and_grad`; other terms autograd). Padding entries repeat id 0, which some rows also hold."""
    hidden, weight = _hidden_case()
    _, teacher, labels, mask = _batch()
    teacher[0, :, 0] += 6.0  # id 0 among the top k of these rows, next to the padding's id 0
    labels = labels.masked_fill(~mask, -100)
    sparse = _sparse(teacher, 4)
    off = LOG_ZERO * max(kd_temperature, 1.0)  # LOG_ZERO x max(1, 1 / T) after the temperature: probability ~0
    dense = TeacherTargets(logits=dense_from_support(sparse.support_logits, sparse.support_ids, V, off))
    without_0 = (sparse.support_ids[..., :4] != 0).all(-1)  # id 0 only as the padding's: off the support too
    assert without_0.any() and (dense.logits[..., 0][without_0] == off).all()
    kw = dict(kd_temperature=kd_temperature, beta=0.3, num_items=40)
    ref, ref_terms = distill_loss(hidden @ weight.T, dense, labels, mask, objective, **kw)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    closed = []
    real = objectives._support_sums_and_grad
    monkeypatch.setattr(objectives, "_support_sums_and_grad", lambda *a, **k: closed.append(1) or real(*a, **k))
    paths = (dict(student_logits=hidden @ weight.T), dict(student_hidden=hidden, lm_head_weight=weight, chunk_size=4))
    for path in paths:
        student = path.pop("student_logits", None)
        loss, terms = distill_loss(student, sparse, labels, mask, objective, **path, **kw)
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(terms, ref_terms)
        for grad, expected in zip(torch.autograd.grad(loss, (hidden, weight)), ref_grads):
            torch.testing.assert_close(grad, expected)
    names = {objective} if isinstance(objective, str) else set(objective)
    assert bool(closed) == (names <= {"forward_kl", "ce"})  # the training path only, where it applies


def test_the_closed_form_gradient_is_autograds_at_every_row_and_weight():
    """`_support_sums_and_grad` against autograd through `_chunk_sums` on one chunk: weighted terms, a masked row
    (exact zero), kd_temperature != 1; a dropped 1 / T or the wrong temperature would fail it."""
    g = torch.Generator().manual_seed(3)
    logits = (2 * torch.randn(6, V, generator=g)).requires_grad_()
    sparse = _sparse(2 * torch.randn(6, V, generator=g), 5)
    labels = torch.randint(0, V, (6,), generator=g)
    mask = torch.tensor([True, True, False, True, True, True])
    weights = torch.tensor([0.6, 0.4])
    names, T = ("forward_kl", "ce"), 1.7
    args = (sparse.support_logits, sparse.support_ids, labels, mask)
    sums = objectives._chunk_sums(logits, *args, None, teacher_logits=None, names=names, kd_temperature=T, beta=0.5,
                                  sparse=True)  # fmt: skip
    (expected,) = torch.autograd.grad((sums * weights).sum(), logits)
    closed, grad = objectives._support_sums_and_grad(logits.detach(), *args, weights, names=names, kd_temperature=T)
    torch.testing.assert_close(closed, sums.detach())
    torch.testing.assert_close(grad, expected)
    assert grad[2].abs().sum() == 0
    # the comparison tells a missing 1 / T factor and a wrong temperature apart
    assert not torch.allclose(grad * T, expected)
    broken, _ = objectives._support_sums_and_grad(logits.detach(), *args, weights, names=names, kd_temperature=1.0)
    assert not torch.allclose(broken, sums.detach())


def test_hidden_states_path_with_a_frozen_head_or_an_empty_mask():
    hidden, weight = _hidden_case()
    _, teacher, labels, mask = _batch()
    frozen = weight.detach()  # a head that does not train (tied to a frozen embedding)
    ref = _loss(hidden @ frozen.T, TeacherTargets(logits=teacher), labels, mask, "jsd")
    loss, _ = distill_loss(None, TeacherTargets(logits=teacher), labels, mask, "jsd", student_hidden=hidden,
                           lm_head_weight=frozen)  # fmt: skip
    torch.testing.assert_close(torch.autograd.grad(loss, hidden), torch.autograd.grad(ref, hidden))
    empty = torch.zeros_like(mask)
    loss, terms = distill_loss(None, TeacherTargets(logits=teacher), labels, empty, "jsd", student_hidden=hidden,
                               lm_head_weight=weight)  # fmt: skip
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert loss.item() == 0 and terms["jsd"].item() == 0 and all(g.abs().sum() == 0 for g in grads)


def test_the_training_path_runs_the_head_gemm_three_times_per_chunk_on_valid_rows_only():
    """Forward logits, then the gradient into the hidden states and into the head: 3 GEMMs over the valid rows;
    checkpointing (forward, recompute, 2 in backward) would run 4, and a loss over every row more rows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HeadGemms(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.rows = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            gemm = func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)
            if gemm and V in (*out.shape, *args[-1].shape):
                self.rows.append(args[0].shape[0] if out.shape[-1] == V else None)
            return out

    hidden, weight = _hidden_case()
    _, teacher, labels, mask = _batch()
    with HeadGemms() as gemms:
        loss, _ = distill_loss(None, TeacherTargets(logits=teacher), labels, mask, "jsd", student_hidden=hidden,
                               lm_head_weight=weight, chunk_size=1000)  # fmt: skip
        loss.backward()
    assert len(gemms.rows) == 3 and gemms.rows[0] == mask.sum()  # one chunk: the logits of the valid rows only


@pytest.mark.parametrize("name", KD_TERMS)
def test_topk_with_all_tokens_equals_full(name):
    student, teacher, labels, mask = _batch()
    full = _loss(student, TeacherTargets(logits=teacher), labels, mask, name)
    topk = _loss(student, _topk(teacher, V), labels, mask, name)
    torch.testing.assert_close(topk, full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", KD_TERMS)
def test_topk_is_a_lower_bound_that_grows_with_k(name):
    # Merging the tail into one bucket can only lose information (data processing inequality for f-divergences),
    # and the top-(k+1) buckets refine the top-k ones, so the bucketed loss grows with k up to the full loss.
    student, teacher, labels, mask = _batch(seed=3)
    full = _loss(student, TeacherTargets(logits=teacher), labels, mask, name).item()
    values = [_loss(student, _topk(teacher, k), labels, mask, name).item() for k in range(1, V + 1)]
    assert all(a <= b + 1e-5 for a, b in zip(values, values[1:])), values
    assert values[0] < full - 1e-3 and abs(values[-1] - full) < 1e-4


def test_kd_temperature_full_equals_loss_on_scaled_logits():
    student, teacher, labels, mask = _batch()
    for name in KD_TERMS:
        at_t = _loss(student, TeacherTargets(logits=teacher), labels, mask, name, kd_temperature=3.0)
        scaled = _loss(student / 3.0, TeacherTargets(logits=teacher / 3.0), labels, mask, name)
        torch.testing.assert_close(at_t, scaled)
        assert at_t.item() < _loss(student, TeacherTargets(logits=teacher), labels, mask, name).item()  # softer
    # ce ignores kd_temperature
    ce = [_loss(student, None, labels, mask, "ce", kd_temperature=kd) for kd in (1.0, 3.0)]
    torch.testing.assert_close(ce[0], ce[1])


def test_kd_temperature_topk_renormalises_buckets():
    student, teacher, labels, mask = _batch()
    k, kd = 3, 2.0
    targets = _topk(teacher, k)
    q_k = F.softmax(student.detach(), -1).gather(-1, targets.topk_indices)  # (B, T, K)
    p_k = targets.topk_logprobs.exp()
    p = torch.cat([p_k, 1 - p_k.sum(-1, keepdim=True)], -1) ** (1 / kd)  # (B, T, K+1)
    q = torch.cat([q_k, 1 - q_k.sum(-1, keepdim=True)], -1) ** (1 / kd)
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    expected = (p * (p / q).log()).sum(-1)[mask].mean()
    torch.testing.assert_close(_loss(student, targets, labels, mask, "forward_kl", kd_temperature=kd), expected)


@pytest.mark.parametrize("teacher_kind", ["full", "topk"])
def test_gradients_finite_with_masked_rows_and_empty_mask(teacher_kind):
    student, teacher, labels, mask = _batch()
    teacher_targets = TeacherTargets(logits=teacher) if teacher_kind == "full" else _topk(teacher, 4)
    objective = {name: 1.0 for name in OBJECTIVES}
    mask[1] = False  # a fully masked row
    labels = labels.masked_fill(~mask, -100)
    loss = _loss(student, teacher_targets, labels, mask, objective)
    (grad,) = torch.autograd.grad(loss, student)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert grad[1].abs().sum() == 0 and grad[0].abs().sum() > 0

    empty = torch.zeros_like(mask)
    loss = _loss(student, teacher_targets, labels.fill_(-100), empty, objective)
    (grad,) = torch.autograd.grad(loss, student)  # a grad path exists
    assert loss.item() == 0 and torch.isfinite(grad).all() and grad.abs().sum() == 0


def test_topk_with_all_mass_in_topk_has_finite_gradients():
    # Peaked distributions put all the mass in the top-k: the rest buckets are at the floor on both sides.
    student, teacher, labels, mask = _batch(scale=60.0)
    loss = _loss(student, _topk(teacher, 4), labels, mask, {name: 1.0 for name in KD_TERMS})
    (grad,) = torch.autograd.grad(loss, student)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_global_normalisation_halves_sum_to_full_batch():
    student, teacher, labels, mask = _batch()
    objective = {"forward_kl": 1.0, "tv": 0.5, "ce": 1.0}
    full = _loss(student, TeacherTargets(logits=teacher), labels, mask, objective)
    (full_grad,) = torch.autograd.grad(full, student)
    total = mask.sum()
    halves = [
        _loss(student[rows], TeacherTargets(logits=teacher[rows]), labels[rows], mask[rows], objective, num_items=total)
        for rows in (slice(0, 1), slice(1, B))
    ]
    torch.testing.assert_close(halves[0] + halves[1], full)
    (grad,) = torch.autograd.grad(halves[0] + halves[1], student)
    torch.testing.assert_close(grad, full_grad)
    # without the global count each half is its own mean, which does not add up
    halves_rows = (slice(0, 1), slice(1, B))
    local = [_loss(student[r], TeacherTargets(logits=teacher[r]), labels[r], mask[r], objective) for r in halves_rows]
    assert not torch.allclose(local[0] + local[1], full)


def test_unknown_objective_lists_valid_names():
    student, teacher, labels, mask = _batch()
    with pytest.raises(ValueError, match="unknown objective 'kl'") as err:
        _loss(student, TeacherTargets(logits=teacher), labels, mask, {"kl": 1.0})
    for name in OBJECTIVES:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="valid objectives"):
        _loss(student, TeacherTargets(logits=teacher), labels, mask, "fkl")


def test_bad_inputs_fail_clearly():
    student, teacher, labels, mask = _batch()
    with pytest.raises(ValueError, match="need teacher targets"):
        _loss(student, None, labels, mask, "tv")
    with pytest.raises(ValueError, match="bool"):
        _loss(student, TeacherTargets(logits=teacher), labels, mask.float(), "tv")
    with pytest.raises(ValueError, match="do not match"):
        _loss(student, TeacherTargets(logits=teacher[..., :-1]), labels, mask, "tv")
    with pytest.raises(ValueError, match="exactly one of logits"):
        TeacherTargets(logits=teacher, topk_logprobs=teacher[..., :2], topk_indices=labels[..., None])
    with pytest.raises(ValueError, match="come together"):
        TeacherTargets(support_logits=teacher[..., :2])
    with pytest.raises(ValueError, match="support logits"):
        bad = TeacherTargets(support_logits=teacher[..., :2], support_ids=labels[..., None])
        _loss(student, bad, labels, mask, "tv")


def test_greedy_match_and_greedy_acceptance_hand_written():
    # two positions: the student's argmax agrees with the teacher's at the first only
    teacher = torch.tensor([[[0.0, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 9.0]]])  # (1, 3, 3)
    student = torch.tensor([[[0.0, 5.0, 1.0], [0.0, 0.0, 4.0], [9.0, 0.0, 0.0]]])
    mask = torch.tensor([[True, True, False]])
    assert greedy_match(student, teacher, mask).item() == pytest.approx(0.5)
    p = F.softmax(teacher, -1)
    expected = (p[0, 0, 1] + p[0, 1, 2]) / 2  # p(argmax q) at the valid positions
    greedy = expected_acceptance_from_logits(student, teacher, mask, draft_rule="greedy")
    assert greedy.item() == pytest.approx(expected.item())
    assert greedy_match(student, teacher, torch.zeros_like(mask)).item() == 0


def test_no_grad_and_bf16_inputs_match_fp32():
    student, teacher, labels, mask = _batch()
    objective = {"forward_kl": 1.0, "jsd": 1.0, "ce": 1.0}
    ref = _loss(student, TeacherTargets(logits=teacher), labels, mask, objective)
    with torch.no_grad():  # validation path: no checkpointing
        torch.testing.assert_close(_loss(student, TeacherTargets(logits=teacher), labels, mask, objective), ref)
    low = _loss(student.bfloat16(), TeacherTargets(logits=teacher.bfloat16()), labels, mask, objective)
    assert low.dtype == torch.float32  # fp32 softmax whatever the logits' dtype
    torch.testing.assert_close(low, ref.detach(), rtol=5e-2, atol=5e-2)


def test_hidden_states_path_under_bf16_autocast_keeps_fp32_gradients():
    """Under autocast (the CUDA training path; here the CPU's) the head GEMMs run in bf16 and the gradients still
    come back in the parameters' fp32, close to plain autograd through the same autocast logits."""
    hidden, weight = _hidden_case(D=16)
    _, teacher, labels, mask = _batch()
    targets = TeacherTargets(logits=teacher)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _loss(hidden @ weight.T, targets, labels, mask, "jsd")
        loss, _ = distill_loss(None, targets, labels, mask, "jsd", student_hidden=hidden, lm_head_weight=weight,
                               chunk_size=4)  # fmt: skip
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert [g.dtype for g in grads] == [torch.float32, torch.float32]
    torch.testing.assert_close(loss, ref)
    for grad, expected in zip(grads, torch.autograd.grad(ref, (hidden, weight))):
        torch.testing.assert_close(grad, expected, rtol=2e-2, atol=2e-3)
