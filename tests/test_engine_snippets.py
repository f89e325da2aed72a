"""The engine settings promotion writes (issue 23), one test per engine, each reading the written serving.yaml, the
exported head's config.json and the model card: an EAGLE-3 head with custom aux layers [1, 3, 5], recommended with the
sampled draft rule at gamma 3 and confirmed up to batch size 4 of [1, 4, 16] (so capped at 4). Each engine gets the
head's layers in its own convention, the rule it can express (or a note saying it cannot, also in the reason), the
cap, and a `needs:` comment naming the engine version its settings assume."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from helpers.reports import eagle3_run

from eval.promote import promote


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
    from eval.engines import ServingSetting, engine_notes

    notes = engine_notes(ServingSetting("/d", 4, concurrency_limit=8))["vllm"]
    assert notes[0].startswith("needs: vLLM >= 0.15.0") and "num_speculative_tokens_per_batch_size" in notes[0]
    assert "tested with EAGLE / EAGLE-3 / DFlash only" in notes[1] and "data parallelism > 1" in notes[1]
    assert (
        len(engine_notes(ServingSetting("/d", 4, kind="eagle3", aux_layers=(2, 4, 5), concurrency_limit=8))["vllm"])
        == 1
    )
