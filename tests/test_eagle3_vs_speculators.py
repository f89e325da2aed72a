"""EAGLE-3 heads trained by the speculators package (issue 27): our loader reads the format its trainer saves, with
the variants that trainer turns on by default, and computes what speculators' own model computes; and
benchmarks/eagle3_vs_speculators.py, which trains a head with each trainer and compares them, runs end to end on
random:tiny-llama (`--smoke`).

What is compared: speculators' `Eagle3DraftModel` and our `Eagle3Draft.from_pretrained` on the same folder, fp32,
fed the same target aux states and tokens: the training-time-test logits of every step (the benchmark's
`loader_check`) and, through our runtime's cache, the rows of a prompt and a greedy chain
(`test_speculators_conformance.assert_conforms`). A head read with one variant flag wrong fails both.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.runs import load_benchmark
from test_speculators_conformance import assert_conforms

from specdec_runtime.eagle3 import Eagle3Draft, is_eagle3_folder, vocab_maps
from specdec_runtime.errors import UserError
from specdistill.config import ConfigError, load_config

pytestmark = [
    pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*torch.jit.script_method:DeprecationWarning"),
]
AUX = [1, 3, 5]
DRAFT_IDS = torch.arange(0, 240, 10)  # 24 ids of the 259-token byte vocabulary
# speculators' trainer defaults for eagle3 (`speculators train`), and the engines' layout (what we train)
TRAINER_DEFAULTS = dict(norm_before_residual=True, norm_before_fc=True, norm_output=True, sliding_window=2048)
ENGINE_LAYOUT = dict(norm_before_residual=False, norm_before_fc=False, norm_output=False, sliding_window=None)


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("eagle3_vs_speculators")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(an 8-layer tiny Llama with the byte-level tokenizer, its folder): the verifier speculators reads."""
    from helpers.models import tiny_llama

    from specdec_runtime.tiny import byte_level_tokenizer

    folder = tmp_path_factory.mktemp("target")
    tokenizer = byte_level_tokenizer()
    model = tiny_llama(seed=3, vocab_size=len(tokenizer), layers=8)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model.eval(), folder


def speculators_head(sp, target_folder, out, *, sliding_window, seed: int = 0, **flags):
    """A speculators EAGLE-3 head for the tiny target, as its trainer builds one (`from_training_args`: the layer
    config from the target's, the vocabulary maps, the target's embeddings and head rows), every weight moved off
    its initial value so each one shows in the logits, saved with its own save_pretrained."""
    from transformers import AutoConfig, LlamaConfig

    t = AutoConfig.from_pretrained(target_folder)
    layer = LlamaConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=1, num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        max_position_embeddings=t.max_position_embeddings, rms_norm_eps=t.rms_norm_eps, head_dim=t.head_dim,
        tie_word_embeddings=False, sliding_window=sliding_window or 4096,
        layer_types=["sliding_attention" if sliding_window else "full_attention"],
    )  # fmt: skip
    layer._attn_implementation = "sdpa"
    config = sp.Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=len(DRAFT_IDS),
        eagle_aux_hidden_state_layer_ids=AUX,
        speculators_config=sp.SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[sp.GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=sp.VerifierConfig(name_or_path=str(target_folder), architectures=["LlamaForCausalLM"]),
        ),
        **flags,
    )
    model = sp.Eagle3DraftModel(config)
    d2t, t2d = vocab_maps(DRAFT_IDS, t.vocab_size)
    model.load_vocab_mappings(t2d, d2t)
    model.load_verifier_weights()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(("embed_tokens", "verifier_")):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return model.eval()


@pytest.mark.parametrize("flags", [TRAINER_DEFAULTS, ENGINE_LAYOUT], ids=["trainer-defaults", "engine-layout"])
def test_our_loader_computes_what_speculators_computes(speculators, bench, target, tmp_path, flags):
    model, folder = target
    flags = dict(flags)
    window = flags.pop("sliding_window")
    theirs = speculators_head(speculators, folder, tmp_path / "head", sliding_window=window, **flags)
    assert is_eagle3_folder(tmp_path / "head")
    ours = Eagle3Draft.from_pretrained(tmp_path / "head", dtype=torch.float32)
    assert ours.export_config["norm_output"] is flags["norm_output"]
    assert ours.aux_layers(8) == AUX and torch.equal(ours.d2t, theirs.d2t)
    check = bench.loader_check(tmp_path / "head", model, [5, 17, 3, 40, 22, 9, 101, 7, 60, 2, 33, 250])
    assert check["passed"], check
    assert_conforms(ours, theirs, model)  # our runtime's cached chain against its own forward


def test_a_head_read_with_a_wrong_variant_fails_both_checks(speculators, bench, target, tmp_path):
    """The checks can fail: the same weights read with norm_output off (later steps fed pre-norm states) or with
    the residual taken before hidden_norm differ from speculators' own forward."""
    model, folder = target
    flags = {k: v for k, v in TRAINER_DEFAULTS.items() if k != "sliding_window"}
    theirs = speculators_head(speculators, folder, tmp_path / "head", sliding_window=None, **flags)
    for flag in ("norm_output", "norm_before_residual"):
        wrong = tmp_path / f"wrong-{flag}"
        shutil.copytree(tmp_path / "head", wrong)
        config = json.loads((wrong / "config.json").read_text())
        config[flag] = False
        (wrong / "config.json").write_text(json.dumps(config))
        misread = Eagle3Draft.from_pretrained(wrong, dtype=torch.float32)
        check = bench.loader_check(tmp_path / "head", model, [5, 17, 3, 40, 22, 9, 101, 7], ours=misread)
        assert not check["passed"] and check["max_abs_diff"] > 1e-2, (flag, check)
        with pytest.raises(AssertionError):
            assert_conforms(misread, theirs, model)


def test_both_trainers_compute_the_same_gradient_on_the_same_rows(speculators, bench, target, tmp_path):
    """One head, one packed batch of three sequences, the target online: our EAGLE-3 loss and speculators' give
    the same gradient, up to one factor for all parameters (their mean over the rows they train, per unrolled step,
    against our sum over the response tokens), when their loss mask holds our rows (`rows_mask(.., "ours")`, what
    --their-rows ours trains on). With their own rows, or either half of the difference, the gradients part: the
    check can fail, and the rows trained are the one difference between the two losses."""
    model, folder = target
    flags = {k: v for k, v in ENGINE_LAYOUT.items() if k != "sliding_window"}
    speculators_head(speculators, folder, tmp_path / "head", sliding_window=None, **flags)
    gen = torch.Generator().manual_seed(7)
    rows = [
        {"input_ids": torch.randint(3, 259, (n,), generator=gen).tolist(), "prompt_len": p}
        for n, p in ((23, 9), (15, 4), (30, 12))
    ]
    for decay in (1.0, 0.8):
        check = bench.loss_check(tmp_path / "head", model, rows, ttt_decay=decay)
        assert 0 < check["their_rows"] < check["our_rows"], check  # some argmax outside the 24-id vocabulary
        assert set(check["grads"]) >= {"fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight"}
        for name, grad in check["grads"].items():
            assert grad["cosine"] > 1 - 1e-6, (decay, name, grad)
            assert grad["ratio"] == pytest.approx(check["their_rows"] / check["our_rows"], rel=1e-4), (name, grad)
    for other in ("own", "next", "in-vocab"):
        apart = bench.loss_check(tmp_path / "head", model, rows, ttt_decay=0.8, their_rows=other)
        assert min(g["cosine"] for g in apart["grads"].values()) < 0.999, (other, apart)


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_both_trainers_take_the_same_steps_from_one_head(speculators, bench, target, tmp_path, monkeypatch, optimizer):
    """`trajectory_check`: from one head, on the same three batches, our optimizer step and speculators' keep the
    weights together (their difference a small fraction of how far they moved); a deliberately different update
    (their learning rate doubled) must part them. AdamW agrees to float rounding (~1e-5 here); Muon to a few per
    cent (~0.04 here): its Newton-Schulz iterations run in bf16 and map every singular value of the update to ~1,
    so the fp32 rounding in the gradients' smallest directions reaches the whole update."""
    import speculators.train.optimizers as their_optimizers

    model, folder = target
    flags = {k: v for k, v in ENGINE_LAYOUT.items() if k != "sliding_window"}
    speculators_head(speculators, folder, tmp_path / "head", sliding_window=None, **flags)
    gen = torch.Generator().manual_seed(11)
    batches = [
        [{"input_ids": torch.randint(3, 259, (n,), generator=gen).tolist(), "prompt_len": n // 3} for n in (21, 14, 27)]
        for _ in range(3)
    ]
    steps = bench.trajectory_check(tmp_path / "head", model, batches, optimizer=optimizer)
    assert len(steps) == 3 and all(s["grad_norm_ours"] > 0 for s in steps)
    assert max(s["apart"] for s in steps) < {"adamw": 1e-3, "muon": 0.1}[optimizer], steps

    real = their_optimizers.build_optimizers
    monkeypatch.setattr(
        their_optimizers,
        "build_optimizers",
        lambda model, cfg: real(model, type(cfg)(**{**vars(cfg), "lr": 2 * cfg.lr, "muon_lr": 2 * cfg.muon_lr})),
    )
    broken = bench.trajectory_check(tmp_path / "head", model, batches, optimizer=optimizer)
    assert max(s["apart"] for s in broken) > 0.3, broken


def test_the_step_log_records_each_step_once_and_tells_a_different_update(bench):
    """`StepLog` (--step-log) around real optimizers: one row per step for every parameter stepped, MuonAdamW's two
    halves not counted again, the learning rate it stepped with and the norm of the change it made. Two identical
    runs compare at ratio 1 everywhere (`compare_step_logs`); the same run with the learning rate doubled, the
    broken variant, must read 2 in the learning rate and in Muon's update (which is the lr times a fixed size)."""
    from helpers.models import tiny_llama

    from train.config import TrainConfig
    from train.optimizers import build_optimizer

    def run(lr: float, optimizer: str) -> dict:
        model = tiny_llama(tie_word_embeddings=False)
        opt = build_optimizer(model, TrainConfig(lr=lr, optimizer=optimizer, weight_decay=0.0, muon_weight_decay=0.0))
        log = bench.StepLog()
        log.name(model)
        try:
            for seed in range(3):
                ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(seed))
                model(input_ids=ids, labels=ids).loss.backward()
                before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
                opt.step()
                moved = float((model.model.layers[0].self_attn.q_proj.weight.detach() - before).norm())
                opt.zero_grad()
        finally:
            rows = log.close()
        q = rows["model.layers.0.self_attn.q_proj.weight"]
        assert q["update"][-1] == pytest.approx(moved) and q["lr"] == [lr] * 3
        return rows

    ours = run(1e-3, "muon")
    assert set(ours) == {n for n, _ in tiny_llama(tie_word_embeddings=False).named_parameters()}
    assert all(len(row[k]) == 3 for row in ours.values() for k in bench.StepLog.KEYS)
    same = bench.compare_step_logs(ours, run(1e-3, "muon"))
    assert all(r == pytest.approx(1.0) for c in same.values() for r in c["median_ratio"].values()), same
    doubled = bench.compare_step_logs(run(2e-3, "muon"), ours)
    q = doubled["model.layers.0.self_attn.q_proj.weight"]["median_ratio"]
    assert q["lr"] == pytest.approx(2.0) and q["update"] == pytest.approx(2.0, rel=0.05), doubled
    names = ("fc.proj.weight", "fc.norm.weight", "midlayer.self_attn.q_proj.weight")
    assert [bench.their_name(n) for n in names] == [
        "fc.weight",
        "input_norm.weight",
        "layers.0.self_attn.q_proj.weight",
    ]


def test_the_rows_each_mask_trains():
    """`rows_mask` on one sequence: which rows (after speculators' shift_batch drops mask[0], row t reads mask[t + 1])
    each rule trains. Tokens 3..6 are the response, the target's argmax at position 4 lies outside the vocabulary."""
    bench = load_benchmark("eagle3_vs_speculators")
    response = torch.tensor([0, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
    in_vocab = torch.tensor([1, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    trained = {rows: bench.rows_mask(response, in_vocab, rows)[1:].nonzero().flatten().tolist() for rows in bench.ROWS}
    # row t predicts token t + 2 from the distribution at t + 1
    assert trained == {"own": [2, 3, 4, 5], "next": [1, 2, 3, 4], "in-vocab": [2, 4, 5], "ours": [1, 2, 4]}
    with pytest.raises(ValueError, match="rows must be one of"):
        bench.rows_mask(response, in_vocab, "mine")


def test_a_sliding_window_hides_keys_that_far_back(speculators, target, tmp_path):
    """speculators' default layer attends within a sliding window: with a window of 3 the first rows of a prompt
    (where both conventions agree: a row at position t sees positions t - 2 .. t) match, and differ from the same
    weights read with full attention."""
    from test_speculators_conformance import our_chain, their_chain

    model, folder = target
    theirs = speculators_head(speculators, folder, tmp_path / "head", sliding_window=3)
    ours = Eagle3Draft.from_pretrained(tmp_path / "head", dtype=torch.float32)
    assert ours.midlayer.self_attn.sliding_window == 3
    ids = torch.tensor([[5, 17, 3, 40, 22, 9, 101, 7, 60]])
    rows, steps = our_chain(ours, model, ids)
    their_rows, _, _ = their_chain(theirs, model, ids, [int(s.argmax()) for s in steps])
    torch.testing.assert_close(their_rows, rows, rtol=1e-5, atol=1e-5)
    ours.midlayer.self_attn.sliding_window = None
    full_rows, _ = our_chain(ours, model, ids)
    kept = torch.isfinite(rows[0])  # the draft vocabulary's columns (-inf elsewhere on both)
    assert (full_rows[3:, kept] - rows[3:, kept]).abs().max() > 1e-3  # rows 3.. lost keys to the window
    torch.testing.assert_close(full_rows[:3], rows[:3])


@pytest.mark.parametrize(
    "change, message",
    [
        ({"fc_norm": True, "norm_before_fc": False}, "fc_norm"),
        ({"transformer_layer_config": {"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2}}, "2 decoder"),
        ({"transformer_layer_config": {"model_type": "qwen3"}}, "qwen3 decoder layer"),
    ],
)
def test_a_head_our_runtime_cannot_compute_is_refused_by_name(speculators, target, tmp_path, change, message):
    _, folder = target
    speculators_head(speculators, folder, tmp_path / "head", sliding_window=None)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    for key, value in change.items():
        config[key] = config[key] | value if isinstance(value, dict) else value
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=message):
        Eagle3Draft.from_pretrained(tmp_path / "head")


# ------------------------------------------------------------------------------------------------ the benchmark


def test_the_pairs_give_each_trainer_the_recipe_they_name(speculators, bench, tmp_path):
    """`same`: speculators' own CLI resolves the flags to our candidate's recipe (AdamW without weight decay, cosine
    after our warm-up, our step loss decay, the engines' head layout) and ours ends its cosine at 0 as speculators'
    does; `recommended`: speculators' defaults (Muon, linear schedule, undecayed steps, its head variants) and our
    candidate as it is. Both pairs share the data, vocabulary, aux layers, depth, learning rate and steps."""
    from speculators.train.config import TrainConfig

    cand = load_config(bench.SMOKE_CONFIG, bench.SMOKE_OVERRIDES).candidate_configs["eagle3"]
    files = {k: str(tmp_path / k) for k in ("path", "hidden_states", "d2t", "t2d")}
    data = {**files, "train_rows": 6, "validation_rows": 2, "draft_vocab_size": 64, "aux_layers": [1, 2, 3]}

    def resolve(pair):
        flags = bench.their_flags(cand, pair, data, str(tmp_path / "target"), tmp_path / "save", 3)
        return TrainConfig.resolve([*flags, "--total-seq-len", "100", "--epochs", "1"])

    same, default = resolve("same"), resolve("recommended")
    for cfg in (same, default):
        assert (cfg.draft.target_layer_ids, cfg.draft.draft_vocab_size, cfg.draft.d2t_path) == (
            [1, 2, 3],
            64,
            files["d2t"],
        )
        assert (cfg.loss.ttt_steps, cfg.optimizer.lr, cfg.trainer.max_steps) == (2, cand.train.lr, 3)
        assert cfg.data.hidden_states_dtype == "float32" and cfg.loss.loss_implementation == "eager"
    assert (same.optimizer.optimizer, same.optimizer.weight_decay, same.scheduler.scheduler_type) == (
        "adamw",
        0,
        "cosine",
    )
    assert same.scheduler.scheduler_warmup_steps == cand.train.warmup_steps
    assert same.loss.ttt_step_loss_decay == cand.draft.ttt_decay and same.draft.full_attention_indices == [0]
    assert not (same.draft.norm_before_residual or same.draft.norm_before_fc or same.draft.norm_output)
    assert (default.optimizer.optimizer, default.scheduler.scheduler_type, default.loss.ttt_step_loss_decay) == (
        "muon", "linear", 1.0)  # fmt: skip
    assert default.draft.norm_before_residual and default.draft.norm_before_fc and default.draft.norm_output
    ours = {pair: bench.our_recipe(cand, pair, tmp_path, 3) for pair in ("same", "recommended")}
    assert ours["same"].train.min_lr_ratio == 0 and ours["same"].train.weight_decay == 0
    assert ours["recommended"].train.min_lr_ratio == cand.train.min_lr_ratio
    # `same` trains speculators' loss mask, the response tokens, whatever the candidate says; `recommended` its own
    on_prompt = dataclasses.replace(cand, distill=dataclasses.replace(cand.distill, loss_on_prompt=True))
    assert not bench.our_recipe(on_prompt, "same", tmp_path, 3).distill.loss_on_prompt
    assert bench.our_recipe(on_prompt, "recommended", tmp_path, 3).distill.loss_on_prompt
    # `same` runs AdamW as speculators does there, whatever the candidate's optimizer; `recommended` the candidate's
    muon = dataclasses.replace(cand, train=dataclasses.replace(cand.train, optimizer="muon"))
    assert bench.our_recipe(muon, "same", tmp_path, 3).train.optimizer == "adamw"
    assert bench.our_recipe(muon, "recommended", tmp_path, 3).train.optimizer == "muon"
    assert bench.recipes(muon, 618)["recommended"]["ours"]["optimizer"].startswith("Muon")
    # `same` keeps the engines' head layout (its flags turn speculators' variants off); `recommended` the candidate's
    variant = dataclasses.replace(cand, draft=dataclasses.replace(cand.draft, norm_before_residual=True))
    assert not bench.our_recipe(variant, "same", tmp_path, 3).draft.norm_before_residual
    assert bench.our_recipe(variant, "recommended", tmp_path, 3).draft.norm_before_residual
    assert bench.recipes(variant, 618)["recommended"]["ours"]["head"].startswith("residual after hidden_norm")
    assert all(o.train.max_steps == 3 and o.train.eval_every == 3 and o.draft == cand.draft for o in ours.values())
    # in `same` a pass of ours holds at most speculators' packed length; `recommended` runs the config as it is
    assert [o.train.max_micro_batch_tokens for o in ours.values()] == [0, 0]
    bounded = {pair: bench.our_recipe(cand, pair, tmp_path, 3, pass_tokens=618) for pair in ("same", "recommended")}
    assert bounded["same"].train.max_micro_batch_tokens == 618
    assert bounded["recommended"].train == ours["recommended"].train
    # --ablate: the pair's recipe with the overrides on top; a key the schema lacks fails by name
    ablation = bench.our_recipe(cand, "same", tmp_path, 3, ["distill.teacher=online", "draft.ttt_decay=1.0"])
    assert (ablation.distill.teacher, ablation.draft.ttt_decay) == ("online", 1.0)
    assert ablation.train == ours["same"].train
    with pytest.raises(ConfigError, match="ttt_dekay"):
        bench.our_recipe(cand, "same", tmp_path, 3, ["draft.ttt_dekay=1.0"])
    # --training-seed: both trainers' seed (initialisation and batch order), nothing else of the recipes
    for pair in ("same", "recommended"):
        reseeded = bench.our_recipe(cand, pair, tmp_path, 3, seed=cand.seed + 7)
        assert reseeded.seed == cand.seed + 7 and dataclasses.replace(reseeded, seed=cand.seed) == ours[pair]
        flags = bench.their_flags(cand, pair, data, str(tmp_path / "target"), tmp_path / "save", 3, cand.seed + 7)
        assert TrainConfig.resolve([*flags, "--total-seq-len", "100", "--epochs", "1"]).seed == cand.seed + 7
    # --ablate-speculators: the pair's flags with these set, a flag already there replaced (a switch by its negation)
    same_flags = bench.their_flags(cand, "same", data, str(tmp_path / "target"), tmp_path / "save", 3)
    ablated = bench.with_flags(
        same_flags, ["optimizer=muon", "norm-before-fc", "weight-decay=0.01", "muon-momentum=0.9"]
    )
    assert ablated.count("--optimizer") == ablated.count("--weight-decay") == 1 and "--no-norm-before-fc" not in ablated
    assert ablated[-2:] == ["--muon-momentum", "0.9"] and len(ablated) == len(same_flags) + 2
    config = TrainConfig.resolve([*ablated, "--total-seq-len", "100", "--epochs", "1"])
    resolved = TrainConfig.resolve([*same_flags, "--total-seq-len", "100", "--epochs", "1"])
    assert (config.optimizer.optimizer, config.optimizer.weight_decay) == ("muon", 0.01)
    assert config.draft.norm_before_fc and config.optimizer.muon_momentum == 0.9
    assert config.draft.norm_output == resolved.draft.norm_output is False  # what it did not name stays the pair's
    assert bench.with_flags(["--norm-before-fc", "--lr", "1"], ["no-norm-before-fc"]) == [
        "--lr",
        "1",
        "--no-norm-before-fc",
    ]


@pytest.mark.slow  # ~70 s on 2 cores: four processes import torch, two of them speculators
def test_the_benchmark_smoke_run(speculators, bench, tmp_path, isolated_cache):
    """`--smoke` end to end: both trainers on one dataset, both heads measured by our eval against target-only and
    against each other at T = 0 and 1, the speculators head read from the folder its trainer saved and checked
    against its own model there; an --ablate head (ours with the teacher online) measured as one more arm."""
    out = tmp_path / "run"
    # One pair: its speculators head has that trainer's variants on (the other pair's flags are checked above).
    argv = ["--smoke", "--pairs", "recommended", "--out", str(out), "--json", str(out / "result.json")]
    argv += ["--training-seed", "3"]  # not the config's: it must reach both trainings
    argv += ["--ablate", "distill.teacher=online", "--ablate", "train.optimizer=muon"]
    argv += ["--ablate-speculators", "optimizer=adamw", "--their-rows", "ours", "--their-batches", "ours"]
    assert bench.main(argv) == 0
    report = json.loads((out / "result.json").read_text())
    assert report["settings"]["smoke"] and report["data"]["train_rows"] > 0 and report["data"]["validation_rows"] > 0
    assert report["settings"]["training_seed"] == 3
    assert load_config(out / "children" / "recommended-ours.yaml").seed == 3
    their_spec = json.loads((out / "children" / "recommended-speculators.spec.json").read_text())
    assert their_spec["seed"] == 3 and their_spec["flags"][their_spec["flags"].index("--seed") + 1] == "3"
    assert set(report["pairs"]) == {"recommended"}
    for pair, r in report["pairs"].items():
        for who in ("ours", "speculators"):
            train = r["training"][who]
            assert train["steps"] == report["settings"]["steps"], (pair, who, train)
            assert train["tokens_per_s"] > 0 and train["peak_rss_mb"] > 0
            assert train["process_peak_rss_mb"] >= train["peak_rss_mb"]
        assert r["training"]["tokens_per_s_ratio"] > 0 and r["training"]["peak_rss_ratio"] > 0
        # the same tokens per step on average: speculators' packing is sized from our batches
        ours, theirs = r["training"]["ours"]["mean_step_tokens"], r["training"]["speculators"]["mean_step_tokens"]
        assert theirs >= ours and r["training"]["speculators"]["total_seq_len"] > 0
        assert set(r["eval"]) == {"T=0", "T=1"}
        for e in r["eval"].values():
            for who in ("ours", "speculators"):
                m = e[who]
                assert 0 <= m["acceptance_rate"] <= 1 and m["mean_accepted_length"] >= 1 and m["speedup"] > 0
                for key in ("acceptance_rate", "mean_accepted_length", "speedup"):
                    lo, hi = m[f"{key}_ci"]
                    assert lo <= hi
            d = e["difference"]
            assert d["acceptance_rate_ci"][0] <= d["acceptance_rate"] <= d["acceptance_rate_ci"][1]
            assert d["speed_ratio"] > 0 and len(d["speed_ratio_ci"]) == 2
        assert r["loader_check"]["passed"], r["loader_check"]
        assert r["same_draft_vocab"]
        assert set(r["goals"]) == {
            "acceptance_at_least_theirs",
            "tokens_per_s_at_least_1.5x",
            "peak_memory_at_most_theirs",
        }
    # The ablation: our recipe of the pair with the override, trained as its own head and measured in the same A/B.
    ablation = report["pairs"]["recommended"]["ablation"]
    assert ablation["overrides"] == ["distill.teacher=online", "train.optimizer=muon"]
    recipe = load_config(out / "children" / "recommended-ours-ablation.yaml")
    plain = load_config(out / "children" / "recommended-ours.yaml")
    assert recipe.distill.teacher == "online" and plain.distill.teacher == "cache" and recipe.draft == plain.draft
    assert (recipe.train.optimizer, plain.train.optimizer) == ("muon", "adamw")
    # its steps counted once each though Muon and AdamW step inside (the head read is the last step's checkpoint)
    assert ablation["training"]["steps"] == report["settings"]["steps"]
    assert ablation["training"]["head"] != report["pairs"]["recommended"]["training"]["ours"]["head"]
    for T, e in ablation["eval"].items():
        assert 0 <= e["ablation"]["acceptance_rate"] <= 1, T
        for d in (e["minus_ours"], e["minus_speculators"]):
            assert d["acceptance_rate_ci"][0] <= d["acceptance_rate"] <= d["acceptance_rate_ci"][1]
    # Their ablation: the pair's flags with AdamW for Muon, on a copy of its data whose loss mask holds our rows
    # (--their-rows ours), trained as its own head, the same A/B.
    ablated = report["pairs"]["recommended"]["speculators_ablation"]
    rows = out / "speculators-data" / "dataset-rows-ours"
    changes = ["optimizer=adamw", f"data-path={rows}", "batches=ours"]
    assert (ablated["trainer"], ablated["overrides"]) == ("speculators", changes)
    # --their-batches ours: its steps hold the rows of ours, so the same tokens step by step
    ours_tokens = report["pairs"]["recommended"]["training"]["ours"]["mean_step_tokens"]
    assert ablated["training"]["mean_step_tokens"] == pytest.approx(ours_tokens), ablated["training"]
    flags = json.loads((out / "children" / "recommended-speculators-ablation.spec.json").read_text())["flags"]
    own = [f.replace("/recommended/", "/recommended-ablation/") for f in their_spec["flags"]]  # its own folders
    assert flags == bench.with_flags(own, ["optimizer=adamw", f"data-path={rows}"])
    import datasets

    original, copy = (
        datasets.load_from_disk(str(p)).with_format(None) for p in (out / "speculators-data" / "dataset", rows)
    )
    assert copy["input_ids"] == original["input_ids"] and copy["seq_len"] == original["seq_len"]
    for mask, response in zip(copy["loss_mask"], original["loss_mask"]):  # ours: one place later, less some rows
        later = bench.rows_mask(
            torch.tensor(response, dtype=torch.bool), torch.ones(len(mask), dtype=torch.bool), "next"
        )
        assert not (torch.tensor(mask, dtype=torch.bool) & ~later).any()
    assert copy["loss_mask"] != original["loss_mask"]
    pair_heads = {t["head"] for t in report["pairs"]["recommended"]["training"].values() if isinstance(t, dict)}
    assert len(pair_heads) == 2 and ablated["training"]["head"] not in pair_heads
    for e in ablated["eval"].values():
        assert 0 <= e["ablation"]["acceptance_rate"] <= 1
        d = e["minus_speculators"]
        assert d["acceptance_rate_ci"][0] <= d["acceptance_rate"] <= d["acceptance_rate_ci"][1]
    # The recommended pair's speculators head has its trainer's variants on: our loader read them from its folder.
    head = report["pairs"]["recommended"]["training"]["speculators"]["head"]
    config = Eagle3Draft.from_pretrained(head).export_config
    assert config["norm_before_fc"] and config["norm_output"] and config["norm_before_residual"]
    # Its optimizer timed on that head: Muon takes the trained 2-D weights by speculators' rule (fc, the projections),
    # never a norm, the embeddings or the frozen lm_head.
    times = bench.optimizer_step_seconds(Path(head), reps=1)
    names = set(times["muon_weights"])
    assert "fc_weight" in names and any("q_proj" in n for n in names) and any("down_proj" in n for n in names)
    assert not any("norm" in n or "embed" in n or "lm_head" in n for n in names), names
    assert all(len(shape) == 2 for shape in times["muon_weights"].values())
    assert times["muon_step_s"] > 0 and times["adamw_step_s"] > 0
    assert bench.main(["--optimizer-step", head]) == 0
    # benchmarks/over_seeds.py reads the JSON as the benchmark writes it: this seed, and one more given with --add
    over, summary = load_benchmark("over_seeds"), out / "over-seeds.json"
    argv = [str(out / "result.json"), "--pair", "recommended", "--add", "1=0.5", "--json", str(summary)]
    assert over.main(argv) == 0
    seeds = json.loads(summary.read_text())
    assert [r["seed"] for r in seeds["runs"]] == [3]
    d = {T: e["difference"]["acceptance_rate"] for T, e in report["pairs"]["recommended"]["eval"].items()}
    one = dict(differences=[d["T=0"]], mean=d["T=0"], ci=None, seeds=1, goal_met=None)  # no interval of one seed
    assert seeds["acceptance"]["T=0"] == one
    two = seeds["acceptance"]["T=1"]
    assert two["differences"] == [0.5, d["T=1"]] and two["mean"] == pytest.approx((0.5 + d["T=1"]) / 2)
    assert two["ci"][0] < two["mean"] < two["ci"][1] and two["goal_met"] == (two["ci"][0] > -0.02)


def test_the_step_logged_runs_compare_one_recipe_on_both_trainers(speculators, bench, tmp_path, isolated_cache):
    """`--smoke --step-log --train-only` with both ablation arms on one recipe (ours with speculators' optimizer and
    initialisation, theirs on our rows and batches and from our very initial weights): every training logs each of
    its steps; the arms, the same algorithm from the same weights on the same rows, read the same learning rates and
    weight norms throughout, where the pair (two recipes) does not; and each training's own validation signal."""
    out = tmp_path / "run"
    argv = ["--smoke", "--pairs", "same", "--out", str(out), "--json", str(out / "logs.json"), "--step-log"]
    argv += ["--train-only", "--their-init", "ours", "--their-rows", "ours", "--their-batches", "ours"]
    # no warm-up on either side: HF's schedule starts it at lr 0, ours at lr / warmup_steps
    argv += ["--ablate", "train.optimizer=muon", "--ablate", "distill.teacher=online"]
    argv += ["--ablate", "train.warmup_steps=0"]
    argv += ["--ablate-speculators", "optimizer=muon", "--ablate-speculators", "scheduler-warmup-steps=0"]
    assert bench.main(argv) == 0
    report = json.loads((out / "logs.json").read_text())
    arms = {f"same-{who}{arm}" for who in ("ours", "speculators") for arm in ("", "-ablation")}
    assert set(report["trainings"]) == arms
    assert all(t["tokens_per_s"] > 0 for t in report["trainings"].values())
    arms = report["step_logs"]["ablation"]
    assert (arms["ours"], arms["theirs"]) == ("same-ours-ablation", "same-speculators-ablation")
    steps = report["steps"]
    for name, c in arms["compared"].items():
        assert c["steps"] == steps, name
        assert c["median_ratio"]["lr"] == pytest.approx(1.0), name
        first = c["at"]["1"]["norm"]  # after one step from the same weights at the same lr
        assert first[0] == pytest.approx(first[1], rel=1e-3), (name, first)
    assert any(c["at"]["1"]["norm"][0] != pytest.approx(c["at"]["1"]["norm"][1], rel=1e-3)
               for c in report["step_logs"]["same"]["compared"].values())  # two draws of the head: apart  # fmt: skip
    assert all(0 <= m <= 1 for m in arms["validation_greedy_match_0"])
    assert "same" in report["step_logs"] and len(report["step_logs"]["same"]["compared"]) >= 10


def test_a_finished_training_is_reused_only_for_the_very_same_spec(bench, tmp_path):
    """`child` reuses a training whose result exists for an identical spec (a run interrupted after it, or re-run
    with other --pairs) unless --retrain; a spec that differs in anything trains again, which here fails (a config
    that does not exist) instead of returning the old result."""
    import argparse

    folder = tmp_path / "children"
    folder.mkdir()
    spec = {"tag": "same-ours", "config": str(tmp_path / "missing.yaml"), "name": "same-ours", "steps": 3, "x": 0.5}
    (folder / "same-ours.spec.json").write_text(json.dumps(spec))
    (folder / "same-ours.json").write_text(json.dumps({"step_s": [1.0], "head": "h"}))
    args = argparse.Namespace(out=tmp_path, retrain=False, step_log=False)
    assert bench.child(args, "ours", dict(spec)) == {"step_s": [1.0], "head": "h"}
    # --step-log: a training with its step log is another spec (trains again, here failing)
    with pytest.raises(SystemExit, match="same-ours training failed"):
        bench.child(argparse.Namespace(out=tmp_path, retrain=False, step_log=True), "ours", dict(spec))
    (folder / "same-ours.spec.json").write_text(json.dumps(spec))
    (folder / "same-ours.json").write_text(json.dumps({"step_s": [1.0], "head": "h"}))
    # --retrain: the same spec trains again (its speed is of this machine)
    with pytest.raises(SystemExit, match="same-ours training failed"):
        bench.child(argparse.Namespace(out=tmp_path, retrain=True, step_log=False), "ours", dict(spec))
    (folder / "same-ours.json").write_text(json.dumps({"step_s": [1.0], "head": "h"}))
    with pytest.raises(SystemExit, match="same-ours training failed"):
        bench.child(args, "ours", {**spec, "steps": 4})
    assert not (folder / "same-ours.json").exists(), "a stale result must not survive a training with another spec"
