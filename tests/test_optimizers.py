"""train.optimizer=muon: torch.optim.Muon on the weight matrices and AdamW on the rest, as one optimizer
(train/optimizers.py), trained through the recipe, checkpointed and resumed."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import tiny_llama
from helpers.runs import assert_same_logs, assert_same_weights, final_weights, metric_rows, reference_run, train_config
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.optim.lr_scheduler import LambdaLR

from specdistill.config import ConfigError
from train.config import TrainConfig
from train.optimizers import MuonAdamW, build_optimizer, muon_split


def loss_of(model: torch.nn.Module, seed: int) -> torch.Tensor:
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(seed))
    return model(input_ids=ids, labels=ids).loss


def steps(model: torch.nn.Module, optimizer, seeds) -> None:
    for seed in seeds:
        loss_of(model, seed).backward()
        optimizer.step()
        optimizer.zero_grad()


def untied_llama() -> torch.nn.Module:
    return tiny_llama(tie_word_embeddings=False)


def test_muon_takes_the_weight_matrices_and_adamw_the_rest():
    model = untied_llama()
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    matrices, rest = muon_split(model, trainable)
    name = {id(p): n for n, p in model.named_parameters()}
    muon, adamw = {name[id(p)] for p in matrices}, {name[id(p)] for p in rest}
    assert muon and all(n.endswith("proj.weight") for n in muon), muon
    assert "model.layers.1.mlp.up_proj.weight" not in muon | adamw  # frozen: in neither
    embedding_like = {"model.embed_tokens.weight", "lm_head.weight"}
    assert embedding_like | {"model.norm.weight"} <= adamw
    assert all(p.ndim == 1 for n, p in model.named_parameters() if n in adamw - embedding_like)
    assert len(muon) + len(adamw) == len(trainable)


def test_one_step_is_torchs_muon_on_the_matrices_and_adamw_on_the_rest():
    """The combined optimizer steps exactly as torch.optim.Muon and torch.optim.AdamW stepping their halves; a
    schedule scales both halves' learning rate."""
    cfg = TrainConfig(lr=2e-3, weight_decay=0.01, optimizer="muon", muon_weight_decay=0.1)
    ours, ref = untied_llama(), untied_llama()
    optimizer = build_optimizer(ours, cfg)
    assert isinstance(optimizer, MuonAdamW)
    matrices, rest = muon_split(ref, [p for p in ref.parameters() if p.requires_grad])
    muon = torch.optim.Muon(matrices, lr=2e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest, lr=2e-3, weight_decay=0.01, fused=True)
    schedules = [LambdaLR(o, lambda step: 1 / (1 + step)) for o in (optimizer, muon, adamw)]
    for seed in range(3):
        steps(ours, optimizer, [seed])
        loss_of(ref, seed).backward()
        for half in (muon, adamw):
            half.step()
            half.zero_grad()
        for s in schedules:
            s.step()
    assert {g["lr"] for g in optimizer.param_groups} == {2e-3 / 4}
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    # and it is not AdamW: the same steps with AdamW alone end elsewhere
    other = untied_llama()
    steps(other, build_optimizer(other, TrainConfig(lr=2e-3, weight_decay=0.01)), range(3))
    assert not torch.equal(other.model.layers[0].self_attn.q_proj.weight, ours.model.layers[0].self_attn.q_proj.weight)


def test_a_restored_state_continues_both_halves_where_they_were():
    """Through torch's distributed state-dict API (what a checkpoint holds): 2 steps, save, a fresh optimizer
    loads it, one more step == 3 straight steps, bit for bit (Muon's momentum and Adam's moments both restored)."""
    cfg = TrainConfig(lr=2e-3, weight_decay=0.01, optimizer="muon")
    straight = untied_llama()
    steps(straight, build_optimizer(straight, cfg), range(3))

    model = untied_llama()
    first = build_optimizer(model, cfg)
    steps(model, first, range(2))
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    saved = copy.deepcopy(get_optimizer_state_dict(model, first, options=options))
    kinds = {frozenset(v) for v in saved["state"].values()}
    assert frozenset({"momentum_buffer"}) in kinds and any("exp_avg" in k for k in kinds)
    resumed = build_optimizer(model, cfg)
    set_optimizer_state_dict(model, resumed, saved, options=StateDictOptions(full_state_dict=True))
    steps(model, resumed, [2])
    for (name, a), b in zip(model.named_parameters(), straight.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_bad_optimizer_settings_fail_by_name(tmp_path):
    with pytest.raises(ValueError, match="muon_weight_decay"):
        TrainConfig(optimizer="muon", muon_weight_decay=-0.1)
    with pytest.raises(ConfigError, match="optimizer"):
        train_config(tmp_path, "train.optimizer=sgd")
    with pytest.raises(ValueError, match="train.optimizer=adamw"):
        MuonAdamW([], [torch.nn.Parameter(torch.zeros(3))], muon={}, adamw={})


EAGLE3 = ("draft.init=eagle3", "draft.draft_vocab_size=48", "draft.ttt_depth=2", "train.min_lr_ratio=1.0")
COMMON = ("train.warmup_steps=0", "train.eval_every=2", "train.keep_last=1", "train.optimizer=muon")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted 3-step EAGLE-3 run with Muon."""
    return reference_run(tmp_path_factory, "muon", *EAGLE3, *COMMON, "train.max_steps=3")


def test_an_eagle3_head_trains_with_muon_and_resumes_where_a_straight_run_ends(straight, tmp_path):
    from specdistill.pipeline import distill_candidate

    root, data, ref = straight
    out = tmp_path / "resumed"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDISTILL_CACHE", str(root / "cache"))
        for max_steps in (2, 3):
            distill_candidate(train_config(out, *EAGLE3, *COMMON, f"train.max_steps={max_steps}"), "draft", data)
        adamw = tmp_path / "adamw"
        distill_candidate(
            train_config(adamw, *EAGLE3, *COMMON, "train.max_steps=3", "train.optimizer=adamw"), "draft", data
        )
    cand = out / "candidates" / "draft"
    assert_same_weights(final_weights(cand, 3), final_weights(ref, 3), atol=0)
    assert_same_logs(metric_rows(cand), metric_rows(ref))
    # the option reached the loop: AdamW's head ends elsewhere
    other = final_weights(adamw / "candidates" / "draft", 3)
    assert not torch.equal(
        other["midlayer.self_attn.q_proj.weight"], final_weights(ref, 3)["midlayer.self_attn.q_proj.weight"]
    )
