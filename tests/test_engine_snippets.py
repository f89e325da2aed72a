"""The engine settings promotion writes (issue 23), one test per engine, each reading the written serving.yaml, the
exported head's config.json and the model card: an EAGLE-3 head with custom aux layers [1, 3, 5], recommended with the
sampled draft rule at gamma 3 and confirmed up to batch size 4 of [1, 4, 16] (so capped at 4). Each engine gets the
head's layers in its own convention, the rule it can express (or a note saying it cannot, also in the reason), the
cap, and a `needs:` comment naming the engine version its settings assume.

The zero-training drafts (issue 26) are checked on `engine_snippets` / `engine_notes` directly: each engine that has
the method gets the draft's knobs under its own names, each that has none an empty snippet and a `not served:` note."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from helpers.reports import eagle3_run

from eval.engines import ServingSetting, engine_notes, engine_snippets, kind_difference, rule_difference
from eval.promote import _merge_engines, promote
from specdec_runtime.lookup import NgramDraft, SuffixDraft


@pytest.fixture(scope="module")
def promoted(tmp_path_factory):
    """(serving.yaml text, its parsed form, the export folder, the export's config.json, the model card)."""
    folder = tmp_path_factory.mktemp("promoted")
    run = eagle3_run(folder, aux_layers=(1, 3, 5), draft_rule="sample", gamma=3, max_concurrency=4)
    promote(run.report, folder / "serving.yaml", expected_target=str(run.target_dir), export_root=folder / "export")
    text, export = (folder / "serving.yaml").read_text(), folder / "export" / "eagle3"
    config = json.loads((export / "config.json").read_text())
    return text, yaml.safe_load(text), export, config, (export / "README.md").read_text()


def comment_above(text: str, key: str) -> str:
    """The comment lines right above `  key:` in serving.yaml, joined."""
    block = re.search(rf"((?:  #.*\n)+)  {key}:\n", text)
    assert block, f"no comment above {key}"
    return " ".join(line.strip().removeprefix("# ").strip() for line in block.group(1).splitlines())


def card_block(card: str, fence: str, starts: str) -> str:
    (block,) = [b for b in re.findall(rf"```{fence}\n(.*?)```", card, re.S) if b.startswith(starts)]
    return block


def test_vllm_reads_the_aux_layers_from_config_json_and_samples_drafts(promoted):
    text, serving, export, config, card = promoted
    want = {
        "model": str(export),
        "num_speculative_tokens": 3,
        "method": "eagle3",
        "draft_sample_method": "probabilistic",  # the measured rule; vLLM's default, greedy, is the other one
        "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 5, 0]],  # no drafts above the confirmed 4
    }
    assert serving["engines"]["vllm"]["speculative_config"] == want
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # what vLLM reads: layer inputs
    needs = comment_above(text, "vllm")
    assert needs.startswith("needs: vLLM >= 0.11.1 for V1 `method: eagle3`") and "draft_sample_method" in needs
    (line,) = [x for x in card.splitlines() if x.startswith("vllm serve ")]
    assert json.loads(line.split("--speculative-config ")[1].strip("'")) == want


def test_sglang_reads_the_aux_layers_minus_one_and_says_it_drafts_greedily(promoted):
    text, serving, export, config, card = promoted
    sglang = serving["engines"]["sglang"]
    assert dict(zip(sglang[::2], sglang[1::2])) == {
        "--speculative-algorithm": "EAGLE3", "--speculative-draft-model-path": str(export),
        "--speculative-num-steps": 3, "--speculative-eagle-topk": 1, "--speculative-num-draft-tokens": 4,
    }  # fmt: skip
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}  # captured after layer i
    notes = comment_above(text, "sglang")
    assert notes.startswith("needs: SGLang >= 0.4.9 for `--speculative-algorithm EAGLE3`")
    assert "drafts greedily" in notes and "above batch size 4" in notes  # the rule and the cap it cannot express
    reason = serving["speculative"]["reason"]
    assert reason.startswith("both gates passed") and "SGLang and TensorRT-LLM draft greedily" in reason
    assert " ".join(map(str, sglang)) in card


def test_trtllm_gets_the_aux_layers_as_outputs_and_the_concurrency_cap(promoted):
    text, serving, export, config, card = promoted
    want = {
        "speculative_config": {
            "decoding_type": "Eagle3",
            "max_draft_len": 3,
            "speculative_model": str(export),
            "eagle3_layers_to_capture": [0, 2, 4],  # layer outputs: it never reads config.json's ids
            "max_concurrency": 4,
        }
    }
    assert serving["engines"]["trtllm"] == want
    notes = comment_above(text, "trtllm")
    assert notes.startswith("needs: TensorRT-LLM PyTorch backend with Eagle3DecodingConfig.eagle3_layers_to_capture")
    assert "`max_concurrency`" in notes and "drafts greedily" in notes
    assert yaml.safe_load(card_block(card, "yaml", "speculative_config:")) == want
    assert "trtllm-serve TARGET --config spec.yaml" in card


def test_a_head_saved_without_aux_ids_is_served_from_the_layers_eval_measured(tmp_path):
    """A head saved before the ids were always written: eval measured it on the default layers of the target's
    count, [2, 4, 5] for 8 layers; the export writes them out and every engine gets them."""
    run = eagle3_run(tmp_path, aux_layers=None, draft_rule="greedy")
    promote(run.report, tmp_path / "serving.yaml", export_root=tmp_path / "export")
    config = json.loads((tmp_path / "export" / "eagle3" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] == run.head.aux_layers(8)
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    serving = yaml.safe_load((tmp_path / "serving.yaml").read_text())
    assert serving["engines"]["trtllm"]["speculative_config"]["eagle3_layers_to_capture"] == [1, 3, 4]
    assert "draft_sample_method" not in serving["engines"]["vllm"]["speculative_config"]  # greedy: vLLM's default
    assert "draft greedily" not in serving["speculative"]["reason"]


def test_a_capped_standalone_draft_notes_where_vllms_schedule_is_untested():
    """vLLM documents its batch-size schedule as tested with EAGLE / EAGLE-3 / DFlash only and off under data
    parallelism: the note says so where it is written for a draft model."""
    notes = engine_notes(ServingSetting("/d", 4, concurrency_limit=8))["vllm"]
    assert notes[0].startswith("needs: vLLM >= 0.15.0") and "num_speculative_tokens_per_batch_size" in notes[0]
    assert "tested with EAGLE / EAGLE-3 / DFlash only" in notes[1] and "data parallelism > 1" in notes[1]
    assert (
        len(engine_notes(ServingSetting("/d", 4, kind="eagle3", aux_layers=(2, 4, 5), concurrency_limit=8))["vllm"])
        == 1
    )


NGRAM = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
SUFFIX = {"max_depth": 24, "max_spec_factor": 1.5, "min_token_prob": 0.2}


def test_ngram_goes_to_vllm_and_tensorrt_llm_under_their_names_and_sglang_serves_none():
    setting = ServingSetting(None, 5, kind="ngram", knobs=NGRAM)
    snippets = engine_snippets(setting)
    assert snippets["vllm"] == {
        "speculative_config": {
            "method": "ngram",  # no model: vLLM names it after the method
            "num_speculative_tokens": 5,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    }
    assert snippets["trtllm"] == {
        "speculative_config": {
            "decoding_type": "NGram",
            "max_draft_len": 5,
            "max_matching_ngram_size": 4,
            "is_public_pool": False,  # its default pools all requests' n-grams; prompt lookup reads its own context
            "is_keep_all": True,
            "is_use_oldest": True,  # the earliest occurrence, as vLLM and the eval
        },
        "disable_overlap_scheduler": True,
    }
    assert snippets["sglang"] == []  # its NGRAM is another draft
    notes = engine_notes(setting)
    (vllm,) = notes["vllm"]
    assert vllm.startswith("needs: vLLM >= 0.10.1 for V1 `method: ngram`") and "0.8.2-0.8.5 serve ngram on V0" in vllm
    (sglang,) = notes["sglang"]
    assert sglang.startswith("not served: SGLang has no prompt lookup") and "--speculative-algorithm NGRAM" in sglang
    assert "never searches the prompt" in sglang
    needs, no_min = notes["trtllm"]
    assert needs.startswith("needs: TensorRT-LLM PyTorch backend with NGramDecodingConfig") and "not verified" in needs
    assert "no prompt_lookup_min" in no_min and "2..4 tokens" in no_min and "down to 1 token" in no_min
    one = ServingSetting(None, 5, kind="ngram", knobs={**NGRAM, "prompt_lookup_min": 1})
    assert len(engine_notes(one)["trtllm"]) == 1  # from 1 token on, TensorRT-LLM matches as measured
    assert kind_difference(setting).startswith("SGLang cannot serve the measured ngram draft")


def test_suffix_goes_to_vllm_only_with_its_departures_noted():
    setting = ServingSetting(None, 16, kind="suffix", knobs=SUFFIX)
    assert engine_snippets(setting) == {
        "vllm": {
            "speculative_config": {
                "method": "suffix",
                "num_speculative_tokens": 16,  # the cap: suffix drafts up to it, at most max_spec_factor x the match
                "suffix_decoding_max_tree_depth": 24,
                "suffix_decoding_max_spec_factor": 1.5,
                "suffix_decoding_min_token_prob": 0.2,
            }
        },
        "sglang": [],
        "trtllm": {},
    }
    notes = engine_notes(setting)
    assert notes["vllm"][0] == (
        "needs: vLLM >= 0.11.1 for `method: suffix` (PR #25784) and `pip install arctic-inference` (not a vLLM "
        "dependency; vLLM's error message names arctic-inference==0.1.1)"
    )
    vllm = " ".join(notes["vllm"][1:])
    assert "every match length" in vllm and "occurrences that continue" in vllm  # Arctic's denominator vs the eval's
    assert "repeated prompt finds its earlier answer" in vllm and "10000 requests" in vllm
    (sglang,), (trtllm,) = notes["sglang"], notes["trtllm"]
    assert sglang.startswith("not served: SGLang has no suffix decoding") and "NGRAM" in sglang
    assert trtllm.startswith("not served: TensorRT-LLM has no suffix decoding") and "`decoding_type: SA`" in trtllm
    assert kind_difference(setting).startswith("SGLang and TensorRT-LLM cannot serve the measured suffix draft")
    cached = ServingSetting(None, 16, kind="suffix", knobs={**SUFFIX, "max_cached_requests": 1000})
    assert engine_snippets(cached)["vllm"]["speculative_config"]["suffix_decoding_max_cached_requests"] == 1000
    assert not any("10000" in n for n in engine_notes(cached)["vllm"])  # measured: no default to warn about


def test_the_drafts_own_knobs_map_onto_every_key():
    for draft in (NgramDraft(5, 3), SuffixDraft(max_depth=12)):
        config = engine_snippets(ServingSetting(None, 4, kind=draft.kind, knobs=draft.knobs()))["vllm"]
        assert len(config["speculative_config"]) == 2 + len(draft.knobs())  # method, num_speculative_tokens, knobs


def test_a_capped_lookup_is_capped_where_the_engine_can_switch_speculation_off():
    ngram = ServingSetting(None, 4, kind="ngram", knobs=NGRAM, concurrency_limit=8)
    snippets, notes = engine_snippets(ngram), engine_notes(ngram)
    assert snippets["vllm"]["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 8, 4], [9, 9, 0]]
    assert snippets["trtllm"]["speculative_config"]["max_concurrency"] == 8
    assert "num_speculative_tokens_per_batch_size" in notes["vllm"][0] and "`max_concurrency`" in notes["trtllm"][0]
    assert "tested with EAGLE / EAGLE-3 / DFlash only" in notes["vllm"][1] and "ngram deployment" in notes["vllm"][1]
    assert len(notes["sglang"]) == 1  # not served: no cap to note
    suffix = ServingSetting(None, 4, kind="suffix", knobs=SUFFIX, concurrency_limit=8)
    # vLLM's suffix proposer asserts every step drafts num_speculative_tokens: a schedule's 0 would fail
    assert "num_speculative_tokens_per_batch_size" not in engine_snippets(suffix)["vllm"]["speculative_config"]
    (cap,) = [n for n in engine_notes(suffix)["vllm"] if "concurrency cap" in n]
    assert cap.startswith("no concurrency cap written") and "above batch size 8" in cap


def test_a_lookups_draft_rules_coincide():
    """q is one-hot: `sample` is the greedy rule, nothing to write and nothing to note."""
    for kind, knobs in (("ngram", NGRAM), ("suffix", SUFFIX)):
        setting = ServingSetting(None, 4, kind=kind, knobs=knobs, draft_rule="sample")
        assert "draft_sample_method" not in engine_snippets(setting)["vllm"]["speculative_config"]
        assert rule_difference(setting) is None
        notes = [n for ns in engine_notes(setting).values() for n in ns]
        assert not any("greedily" in n or "draft_sample_method" in n for n in notes)
    assert kind_difference(ServingSetting("/d", 4)) is None


def test_an_unserved_engine_keeps_its_other_settings_and_loses_the_speculative_ones():
    """promote merges an empty snippet as the target alone: the old --speculative-* flags and speculative_config go,
    the engine's other settings stay."""
    old = {
        "sglang": ["--tp", 2, "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", 3],
        "trtllm": {"speculative_config": {"decoding_type": "Eagle3"}, "max_batch_size": 8},
    }
    engines = _merge_engines(old, engine_snippets(ServingSetting(None, 4, kind="suffix", knobs=SUFFIX)))
    assert engines["sglang"] == ["--tp", 2] and engines["trtllm"] == {"max_batch_size": 8}
    assert engines["vllm"]["speculative_config"]["method"] == "suffix"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"draft": "/d", "kind": "ngram", "knobs": NGRAM}, "has no folder"),
        ({"draft": None, "kind": "standalone"}, "needs its folder"),
        ({"draft": None, "kind": "ngram"}, "required for kind ngram"),
        ({"draft": "/d", "kind": "standalone", "knobs": NGRAM}, "none for a model draft"),
        ({"draft": None, "kind": "ngram", "knobs": {**NGRAM, "n": 3}}, "unknown ['n']"),
        ({"draft": None, "kind": "suffix", "knobs": {"max_depth": 24}}, "missing ['max_spec_factor'"),
        ({"draft": None, "kind": "ngram", "knobs": {"prompt_lookup_max": 2, "prompt_lookup_min": 3}}, "out of range"),
        ({"draft": None, "kind": "suffix", "knobs": {**SUFFIX, "min_token_prob": 1.5}}, "out of range"),
        ({"draft": None, "kind": "suffix", "knobs": {**SUFFIX, "max_depth": 2.5}}, "out of range"),
    ],
)
def test_a_lookup_setting_is_checked(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ServingSetting(num_draft_tokens=4, **kwargs)
