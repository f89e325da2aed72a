"""Speculative decoding settings of the serving engines (vLLM, SGLang, TensorRT-LLM) for a standalone or an EAGLE-3
draft: the `engines` section of the serving config (DESIGN.md, "Serving config contract") and the snippets of a model
card. Each snippet carries what the measured setting depends on (issue 23): the draft and gamma, an EAGLE-3 head's aux
layers in the engine's own convention, the draft rule, the concurrency cap; `engine_notes` says what an engine cannot
express and which engine version the snippet assumes.

    setting = ServingSetting("runs/quickstart/export/eagle3", 4, kind="eagle3", aux_layers=(2, 15, 27))
    engine_snippets(setting)["trtllm"]      # {"speculative_config": {..., "eagle3_layers_to_capture": [1, 14, 26]}}
    engine_notes(setting)["sglang"]         # ["needs: SGLang >= 0.4.9 for `--speculative-algorithm EAGLE3` ...", ...]

The kind picks each engine's method: standalone = vLLM `draft_model`, SGLang `STANDALONE`, TensorRT-LLM
`DraftTarget`; eagle3 = vLLM `eagle3`, SGLang `EAGLE3` (`EAGLE` would load the head without its fc and serve a
useless draft), TensorRT-LLM `Eagle3` (shared/EAGLE3.md).

Engine facts, read in the newest releases on PyPI (vLLM 0.33.0, SGLang 0.5.23, 2026-11) unless said otherwise; the
release that first has each is in `FLOORS`:
- vLLM `SpeculativeConfig` (vllm/config/speculative.py): `draft_sample_method: greedy | probabilistic` ("greedy"
  treats the draft as one-hot in rejection sampling, our `greedy` rule; "probabilistic" samples drafts from q, our
  `sample` rule); `num_speculative_tokens_per_batch_size` ([lo, hi, K] entries, inclusive).
- TensorRT-LLM `DecodingBaseConfig` / `Eagle3DecodingConfig` (tensorrt_llm/llmapi/llm_args.py, read from its main
  branch, 2026-08; its 1.4.0rc4 API reference still lists both fields): `max_concurrency` (speculation off above it,
  PyTorch backend only; mutually exclusive with `draft_len_schedule`, into which it is translated),
  `eagle3_layers_to_capture` (layer outputs: our HF ids minus 1; default {1, L//2-1, L-4}), which it never reads
  from the head's config.json.
- SGLang drafts the topk-1 chain by argmax. Its `--speculative-use-rejection-sampling` (0.5.14 on) samples EAGLE /
  EAGLE3 drafts only and refuses a draft vocabulary smaller than the target's, which our heads have by default: not
  written, so `sample` is served greedily there.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Literal

# kind -> (vLLM method, SGLang algorithm, TensorRT-LLM decoding_type)
METHODS = {"standalone": ("draft_model", "STANDALONE", "DraftTarget"), "eagle3": ("eagle3", "EAGLE3", "Eagle3")}
ENGINES = ("vllm", "sglang", "trtllm")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}

# What each snippet assumes of its engine: the first release with each feature, found in the released packages
# (docs/eval-and-serving.md, "Engine versions"). TensorRT-LLM publishes no code on PyPI, so its releases are not
# verified: its entries name the feature and the PR that added it.
FLOORS = {
    ("vllm", "standalone"): "vLLM >= 0.15.0 for V1 draft models (`method: draft_model`, PR #24322; 0.14.1 refuses it)",
    ("vllm", "eagle3"): "vLLM >= 0.11.1 for V1 `method: eagle3` reading eagle_aux_hidden_state_layer_ids from the "
    "head's config.json (PR #25961)",
    ("vllm", "cap"): "vLLM >= 0.24.0 for `num_speculative_tokens_per_batch_size` (its dynamic speculative decoding; "
    "`disable_by_batch_size` is gone since 0.17.0)",
    ("vllm", "sample"): "vLLM >= 0.22.0 for `draft_sample_method: probabilistic` with the draft's probabilities in "
    "rejection sampling (PR #40269); 0.18.0-0.20.2 spelled it `rejection_sample_method: probabilistic`, read by "
    "Model Runner V2 only, and no release since accepts that spelling",
    ("sglang", "standalone"): "SGLang >= 0.5.2 for `--speculative-algorithm STANDALONE` (PR #10090)",
    ("sglang", "eagle3"): "SGLang >= 0.4.9 for `--speculative-algorithm EAGLE3` reading eagle_config."
    "eagle_aux_hidden_state_layer_ids from the head's config.json",
    ("trtllm", "standalone"): "TensorRT-LLM PyTorch backend with DraftTargetDecodingConfig and `speculative_model` "
    "(PR #10099; older releases: `speculative_model_dir`), release not verified",
    ("trtllm", "eagle3"): "TensorRT-LLM PyTorch backend with Eagle3DecodingConfig.eagle3_layers_to_capture and "
    "`speculative_model` (PR #10099; older releases: `speculative_model_dir`), release not verified",
    ("trtllm", "cap"): "`max_concurrency` on the speculative config (PyTorch backend only; release not verified)",
}


@dataclass(frozen=True)
class ServingSetting:
    """The measured setting an engine must reproduce."""

    draft: str
    """The draft folder the engines load (absolute path of the export) or a hub id."""
    num_draft_tokens: int
    """gamma: tokens drafted per verify step."""
    kind: Literal["standalone", "eagle3"] = "standalone"
    """standalone LM or EAGLE-3 head."""
    draft_rule: Literal["greedy", "sample"] = "greedy"
    """greedy: the draft proposes its argmax (one-hot q); sample: drafts sampled from q, exact rejection sampling."""
    aux_layers: tuple[int, ...] | None = None
    """EAGLE-3 only: the target layers the head reads, HF output_hidden_states indices (layer inputs)."""
    concurrency_limit: int | None = None
    """Speculation off above this batch size (a larger measured one failed the margin); None: no measured limit."""

    def __post_init__(self) -> None:
        if self.kind not in METHODS:
            raise ValueError(f"kind must be one of {', '.join(METHODS)}, got {self.kind!r}")
        if self.draft_rule not in ("greedy", "sample"):
            raise ValueError(f"draft_rule must be greedy or sample, got {self.draft_rule!r}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if (self.kind == "eagle3") != (self.aux_layers is not None):
            raise ValueError(
                f"aux_layers are the EAGLE-3 head's target layers: required for kind eagle3, none for a standalone "
                f"draft (kind={self.kind}, aux_layers={self.aux_layers})"
            )
        if self.concurrency_limit is not None and self.concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1 or None, got {self.concurrency_limit}")


def concurrency_cap(rec: dict) -> int | None:
    """The batch size above which speculation should be off, from an eval recommendation: its confirmed
    max_concurrency when a larger measured concurrency failed the margin, else None (no measured limit)."""
    conf = rec.get("confirmation") or {}
    limit, measured = conf.get("max_concurrency"), conf.get("measured_concurrency") or []
    return limit if limit is not None and measured and limit < max(measured) else None


def recommended_setting(rec: dict, draft: str, aux_layers: tuple[int, ...] | None = None) -> ServingSetting:
    """The setting of an eval recommendation (report.json's `recommendation`), served from `draft`; `aux_layers`:
    an EAGLE-3 head's, as eval measured them."""
    return ServingSetting(
        draft=draft,
        num_draft_tokens=rec["num_draft_tokens"],
        kind=rec.get("kind", "standalone"),
        draft_rule=rec.get("draft_rule", "greedy"),
        aux_layers=aux_layers,
        concurrency_limit=concurrency_cap(rec),
    )


def engine_snippets(s: ServingSetting) -> dict:
    """Speculative decoding settings for vLLM, SGLang and TensorRT-LLM reproducing `s`."""
    vllm_method, sglang_algorithm, trtllm_type = METHODS[s.kind]
    K = s.num_draft_tokens
    vllm = {"model": s.draft, "num_speculative_tokens": K, "method": vllm_method}
    if s.draft_rule == "sample":
        vllm["draft_sample_method"] = "probabilistic"  # vLLM's default, greedy, is our greedy rule
    trtllm = {"decoding_type": trtllm_type, "max_draft_len": K, "speculative_model": s.draft}
    if s.kind == "eagle3":  # TensorRT-LLM captures layer outputs: output i is HF hidden_states[i + 1]
        trtllm["eagle3_layers_to_capture"] = [i - 1 for i in s.aux_layers]
    if s.concurrency_limit is not None:
        cap = s.concurrency_limit
        # vLLM's batch-size schedule: [batch_lo, batch_hi, K] entries from 1, the last entry's K holding for every
        # larger batch (vllm/v1/spec_decode/dynamic/utils.py).
        vllm["num_speculative_tokens_per_batch_size"] = [[1, cap, K], [cap + 1, cap + 1, 0]]
        trtllm["max_concurrency"] = cap
    return {
        # `vllm serve TARGET --speculative-config '<json of speculative_config>'`; an EAGLE-3 head reads the target's
        # hidden states, so vLLM needs `method` to know it (its architecture name alone is not enough).
        "vllm": {"speculative_config": vllm},
        # SGLang's STANDALONE and EAGLE3 algorithms draft a chain (topk 1) of num-steps tokens; with topk 1 SGLang
        # requires num-draft-tokens = num-steps + 1 (the verified root plus the drafted chain) and rewrites others.
        "sglang": [
            "--speculative-algorithm",
            sglang_algorithm,
            "--speculative-draft-model-path",
            s.draft,
            "--speculative-num-steps",
            K,
            "--speculative-eagle-topk",
            1,
            "--speculative-num-draft-tokens",
            K + 1,
        ],
        # TensorRT-LLM LLM API / `trtllm-serve TARGET --config spec.yaml` (`--extra_llm_api_options` is its older
        # name): DraftTargetDecodingConfig, which its docs run with the overlap scheduler disabled, or
        # Eagle3DecodingConfig.
        "trtllm": {
            "speculative_config": trtllm,
            **({"disable_overlap_scheduler": True} if s.kind == "standalone" else {}),
        },
    }


def engine_notes(s: ServingSetting) -> dict[str, list[str]]:
    """Per engine: the version its snippet assumes (`needs: ...`), then every way it departs from the measured
    setting or needs checking. serving.yaml writes them as comments above each engine, the model card under it."""
    notes = {e: [f"needs: {FLOORS[e, s.kind]}"] for e in ENGINES}
    if s.concurrency_limit is not None:
        notes["vllm"][0] += f"; {FLOORS['vllm', 'cap']}"
        notes["trtllm"][0] += f"; {FLOORS['trtllm', 'cap']}"
        notes["sglang"].append(
            f"no concurrency cap written (no SGLang switch for it was verified): speculation was measured to lose "
            f"above batch size {s.concurrency_limit}"
        )
        if s.kind == "standalone":
            notes["vllm"].append(
                "vLLM documents num_speculative_tokens_per_batch_size as tested with EAGLE / EAGLE-3 / DFlash only, "
                "and as off when data parallelism > 1: check that the cap holds for this draft_model deployment"
            )
    if s.draft_rule == "sample":
        notes["vllm"][0] += f"; {FLOORS['vllm', 'sample']}"
        for engine in rule_unexpressed(s):
            notes[engine].append(
                "drafts greedily (argmax): the measured draft_rule was `sample`, which this snippet cannot express; "
                "expect the acceptance of the greedy rule here, not the measured one"
            )
    return notes


def rule_unexpressed(s: ServingSetting) -> list[str]:
    """Engines whose snippet cannot express the measured draft rule. SGLang drafts by argmax; TensorRT-LLM drafts
    greedily unless its prototype `use_rejection_sampling` (one-model paths, FlashInfer) is on, which is not
    written: not verified for these decoding types."""
    return ["sglang", "trtllm"] if s.draft_rule == "sample" else []


def rule_difference(s: ServingSetting) -> str | None:
    """The sentence serving.yaml's reason adds when an engine cannot serve the measured draft rule, else None."""
    engines = rule_unexpressed(s)
    if not engines:
        return None
    names = " and ".join(ENGINE_NAMES[e] for e in engines)
    return (
        f"Measured with draft_rule sample; vLLM samples drafts the same way (draft_sample_method: probabilistic), "
        f"{names} draft greedily (argmax), a different rule: their acceptance is the greedy rule's, not the measured "
        "one."
    )


def speculators_convert_command(draft: str, verifier: str, aux_layers: list[int] | tuple[int, ...]) -> str:
    """The `speculators convert` command for an EAGLE-3 head: the converter takes the aux ids only from
    --algorithm-kwargs (never from config.json), so without them a head with custom layers converts to the default
    ones. --verifier is an HF id or folder; the output goes next to the head, `<draft>-speculators`."""
    kwargs = json.dumps({"eagle_aux_hidden_state_layer_ids": list(aux_layers)})
    args = ["speculators", "convert", draft, "--algorithm", "eagle3", "--verifier", verifier]
    return shlex.join([*args, "--output-path", f"{draft}-speculators", "--algorithm-kwargs", kwargs])
