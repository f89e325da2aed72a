"""Speculative decoding settings of the serving engines (vLLM, SGLang, TensorRT-LLM) for a standalone or an EAGLE-3
draft: the `engines` section of the serving config (DESIGN.md, "Serving config contract") and the snippets of a model
card.

    engine_snippets("runs/quickstart/export/trunc4-fkl", num_draft_tokens=4)["vllm"]
    engine_snippets("runs/quickstart/export/eagle3", num_draft_tokens=4, kind="eagle3")["sglang"]

The kind picks each engine's method: standalone = vLLM `draft_model`, SGLang `STANDALONE`, TensorRT-LLM
`DraftTarget`; eagle3 = vLLM `eagle3`, SGLang `EAGLE3` (`EAGLE` would load the head without its fc and serve a
useless draft), TensorRT-LLM `Eagle3` (shared/EAGLE3.md).
"""

from __future__ import annotations

from typing import Literal

# kind -> (vLLM method, SGLang algorithm, TensorRT-LLM decoding_type)
METHODS = {"standalone": ("draft_model", "STANDALONE", "DraftTarget"), "eagle3": ("eagle3", "EAGLE3", "Eagle3")}


def engine_snippets(
    draft: str,
    num_draft_tokens: int,
    max_concurrency: int | None = None,
    kind: Literal["standalone", "eagle3"] = "standalone",
) -> dict:
    """Speculative decoding settings for vLLM, SGLang and TensorRT-LLM with `draft` proposing `num_draft_tokens`.

    max_concurrency: the largest batch size at which the eval confirmed a speedup, when a larger one was measured
    and failed; vLLM then drafts nothing above it (SGLang and TensorRT-LLM have no such knob: serving.yaml records
    the limit in `speculative.concurrency_limit`).
    """
    if kind not in METHODS:
        raise ValueError(f"kind must be one of {', '.join(METHODS)}, got {kind!r}")
    vllm_method, sglang_algorithm, trtllm_type = METHODS[kind]
    vllm = {"model": draft, "num_speculative_tokens": num_draft_tokens, "method": vllm_method}
    if max_concurrency is not None:
        # vLLM's SpeculativeConfig (vllm/config/speculative.py) no longer has `disable_by_batch_size`; its batch-size
        # schedule `num_speculative_tokens_per_batch_size` takes [batch_lo, batch_hi, K] entries starting at 1, K >= 0,
        # the last entry's K holding for every larger batch (vllm/v1/spec_decode/dynamic/utils.py:
        # validate_and_normalize_dynamic_sd_schedule, build_dynamic_sd_schedule_lookup).
        vllm["num_speculative_tokens_per_batch_size"] = [
            [1, max_concurrency, num_draft_tokens],
            [max_concurrency + 1, max_concurrency + 1, 0],
        ]
    return {
        # vLLM V1 speculation: `vllm serve TARGET --speculative-config '<json of this dict>'`; an EAGLE-3 head reads
        # the target's hidden states, so vLLM needs `method` to know it (its architecture name alone is not enough).
        "vllm": {"speculative_config": vllm},
        # SGLang's STANDALONE and EAGLE3 algorithms draft a chain (topk 1) of num-steps tokens; with topk 1 SGLang
        # requires num-draft-tokens = num-steps + 1 (the verified root plus the drafted chain) and rewrites others.
        "sglang": [
            "--speculative-algorithm",
            sglang_algorithm,
            "--speculative-draft-model-path",
            draft,
            "--speculative-num-steps",
            num_draft_tokens,
            "--speculative-eagle-topk",
            1,
            "--speculative-num-draft-tokens",
            num_draft_tokens + 1,
        ],
        # TensorRT-LLM LLM API / `trtllm-serve --extra_llm_api_options`: DraftTargetDecodingConfig, which its docs
        # run with the overlap scheduler disabled, or Eagle3DecodingConfig.
        "trtllm": {
            "speculative_config": {
                "decoding_type": trtllm_type,
                "max_draft_len": num_draft_tokens,
                "speculative_model": draft,
            },
            **({"disable_overlap_scheduler": True} if kind == "standalone" else {}),
        },
    }
