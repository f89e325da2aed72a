"""`specdistill bench` (specdec_runtime/bench.py): HF assisted generation at the gamma we claim, measured by a hook on
the target; the paired bench JSON on tiny random models."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from helpers.models import perturbed, tiny_llama
from transformers import GenerationConfig

from specdec_runtime.bench import VerifyWidths, fair_assistant, format_bench_table, hf_assisted, run_bench
from specdec_runtime.cpu import CPU_BACKEND

PROMPTS = [[5, 17, 3, 40, 22, 9], [11, 4], [60, 2, 33]]


def widths(target, draft, config: GenerationConfig, gamma: int | None) -> list[list[int]]:
    """Per prompt: the draft tokens of each verify forward, with `fair_assistant(gamma)` or without (None)."""
    hook, out = VerifyWidths(target), []
    try:
        for prompt in PROMPTS:
            if gamma is None:
                run = hf_assisted(target, draft, [prompt], config, hook)
            else:
                with fair_assistant(draft, gamma):
                    run = hf_assisted(target, draft, [prompt], config, hook)
            out.append(run.widths)
    finally:
        hook.handle.remove()
    return out


@pytest.mark.parametrize("gamma", [2, 4])
def test_hf_assisted_verifies_num_draft_tokens(gamma):
    """Away from the sequence end every verify forward scores exactly gamma drafts; passing gamma through
    generate's own config only (what bench did before) leaves the draft's defaults in charge: another width."""
    torch.manual_seed(0)
    target = tiny_llama(seed=0)
    draft = perturbed(target, 0.003, seed=1)
    draft.generation_config.num_assistant_tokens = 7  # a draft's own default, which the fair run must override
    before = draft.generation_config
    config = GenerationConfig(max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    fair = widths(target, draft, config, gamma)
    assert draft.generation_config is before and before.num_assistant_tokens == 7  # restored
    for row in fair:
        end = len(row)
        while end and row[end - 1] < gamma:  # near max_new_tokens HF drafts only what room is left
            end -= 1
        tail = row[end:]
        assert end >= 30 // (gamma + 1) - 1 and row[:end] == [gamma] * end, row
        assert len(tail) <= gamma + 1 and tail == sorted(tail, reverse=True), row
    broken_config = GenerationConfig(
        **config.to_diff_dict(), num_assistant_tokens=gamma, num_assistant_tokens_schedule="constant"
    )
    broken = widths(target, draft, broken_config, None)
    assert any(w != gamma for row in broken for w in row[: len(row) - gamma - 1]), broken


def test_bench_json_pairs_every_arm():
    target = tiny_llama(seed=0)
    draft = perturbed(target, 0.003, seed=1)
    tokenizer = SimpleNamespace(eos_token_id=None, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warnings a user would trip on
        result = run_bench(
            target,
            draft,
            tokenizer,
            PROMPTS,
            num_draft_tokens=3,
            max_new_tokens=12,
            temperature=0.0,
            batch_size=1,
            seed=0,
            repeats=2,
            tree="2,1",
        )
    settings = result["settings"]
    assert settings["units"] == 3 and settings["repeats"] == 2 and settings["backend"] == CPU_BACKEND
    assert settings["stop_token_ids"] == [2]  # the generation config's eos (the tokenizer has none)
    for arm in ("target_only", "speculative"):
        assert set(result[arm]["phases"]) >= {"prefill_s", "draft_s", "verify_s", "other_s", "decode_s"}
    assert result["target_only"]["phases"]["draft_s"] == 0 and result["speculative"]["phases"]["draft_s"] > 0
    assert result["hf_assisted"]["draft_tokens_per_step"] == 3
    for key in ("speedup", "speedup_vs_hf_assisted"):
        lo, hi = result[f"{key}_ci"]
        assert 0 < lo <= result[key] <= hi, key
    for key in ("cost_ratio", "verify_cost_ratio", "predicted_speedup", "efficiency", "overhead_fraction"):
        assert 0 < result[key] < 100, key
    assert result["efficiency"] == pytest.approx(result["speedup"] / result["predicted_speedup"])
    tree = result["tree"]
    assert tree["speedup_ci"][0] <= tree["speedup"] <= tree["speedup_ci"][1] and tree["speedup_vs_chain"] > 0
    table = format_bench_table(result)
    assert "95% CI" in table and "hf draft tokens/step" in table
