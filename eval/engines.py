"""Speculative decoding settings of the serving engines (vLLM, SGLang, TensorRT-LLM) for a standalone or an EAGLE-3
draft, or a zero-training one (prompt lookup `ngram`, suffix decoding `suffix`: specdec_runtime/lookup.py): the
`engines` section of the serving config (DESIGN.md, "Serving config contract") and the snippets of a model card. Each
snippet carries what the measured setting depends on (issue 23): the draft and gamma, an EAGLE-3 head's aux layers in
the engine's own convention, a lookup's knobs under the engine's names, the draft rule, the concurrency cap;
`engine_notes` says what an engine cannot express and which engine version the snippet assumes.

    setting = ServingSetting("runs/quickstart/export/eagle3", 4, kind="eagle3", aux_layers=(2, 15, 27))
    engine_snippets(setting)["trtllm"]      # {"speculative_config": {..., "eagle3_layers_to_capture": [1, 14, 26]}}
    engine_notes(setting)["sglang"]         # ["needs: SGLang >= 0.4.9 for `--speculative-algorithm EAGLE3` ...", ...]
    lookup = ServingSetting(None, 4, kind="ngram", knobs=NgramDraft().knobs())   # no folder: drafts from tokens
    engine_snippets(lookup)["sglang"]       # []: not served there; engine_notes(lookup)["sglang"][0] says why

The kind picks each engine's method (`METHODS`): standalone = vLLM `draft_model`, SGLang `STANDALONE`, TensorRT-LLM
`DraftTarget`; eagle3 = vLLM `eagle3`, SGLang `EAGLE3` (`EAGLE` would load the head without its fc and serve a
useless draft), TensorRT-LLM `Eagle3` (shared/EAGLE3.md); ngram = vLLM `ngram`, TensorRT-LLM `NGram`; suffix = vLLM
`suffix`. An engine with no method for a kind (None in `METHODS`) gets an empty snippet, [] or {} (the target served
alone there), and its notes start with `not served: ...` instead of `needs: ...`.

Engine facts, read in the newest releases on PyPI (vLLM 0.33.0, SGLang 0.5.23, arctic-inference 0.3.0, 2026-11) unless
said otherwise; the release that first has each is in `FLOORS`:
- vLLM `SpeculativeConfig` (vllm/config/speculative.py): `draft_sample_method: greedy | probabilistic` ("greedy"
  treats the draft as one-hot in rejection sampling, our `greedy` rule; "probabilistic" samples drafts from q, our
  `sample` rule); `num_speculative_tokens_per_batch_size` ([lo, hi, K] entries, inclusive); `prompt_lookup_max/min`
  (ngram); `suffix_decoding_max_tree_depth` (24), `_max_spec_factor` (1.0), `_min_token_prob` (0.1),
  `_max_cached_requests` (10000) for suffix, whose proposer (vllm/v1/spec_decode/suffix_decoding.py) is Arctic
  Inference's SuffixDecodingCache, num_speculative_tokens the cap of each step's draft.
- TensorRT-LLM `DecodingBaseConfig` / `Eagle3DecodingConfig` / `NGramDecodingConfig` (tensorrt_llm/llmapi/llm_args.py,
  read from its main branch, 2026-08; its 1.4.0rc4 API reference still lists the first two's fields):
  `max_concurrency` (speculation off above it, PyTorch backend only; mutually exclusive with `draft_len_schedule`,
  into which it is translated), `eagle3_layers_to_capture` (layer outputs: our HF ids minus 1; default {1, L//2-1,
  L-4}), which it never reads from the head's config.json. NGram is a pool of n-gram -> continuations
  (tensorrt_llm/_torch/speculative/ngram.py); its SpeculativeConfig union has no suffix decoding.
- SGLang drafts the topk-1 chain by argmax. Its `--speculative-use-rejection-sampling` (0.5.14 on) samples EAGLE /
  EAGLE3 drafts only and refuses a draft vocabulary smaller than the target's, which our heads have by default: not
  written, so `sample` is served greedily there. Its NGRAM is neither of our lookups (`UNSERVED`).
- A lookup's q is one-hot, so its two draft rules coincide (specdec_runtime/lookup.py), and an engine verifying by
  exact match (sample from p, accept if equal) is exact for it: no rule note for the lookup kinds.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Literal

# kind -> (vLLM method, SGLang algorithm, TensorRT-LLM decoding_type); None: the engine cannot serve the kind (UNSERVED)
METHODS = {
    "standalone": ("draft_model", "STANDALONE", "DraftTarget"),
    "eagle3": ("eagle3", "EAGLE3", "Eagle3"),
    "ngram": ("ngram", None, "NGram"),
    "suffix": ("suffix", None, None),
}
LOOKUP_KINDS = ("ngram", "suffix")  # drafts from tokens alone: no folder (specdec_runtime.lookup.LOOKUP_KINDS)
ENGINES = ("vllm", "sglang", "trtllm")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}

# A lookup's knobs (its `.knobs()`) -> vLLM's keys; the optional ones are written only when measured.
VLLM_KNOBS = {
    "ngram": {"prompt_lookup_max": "prompt_lookup_max", "prompt_lookup_min": "prompt_lookup_min"},
    "suffix": {
        "max_depth": "suffix_decoding_max_tree_depth",
        "max_spec_factor": "suffix_decoding_max_spec_factor",
        "min_token_prob": "suffix_decoding_min_token_prob",
        "max_cached_requests": "suffix_decoding_max_cached_requests",
    },
}
OPTIONAL_KNOBS = {"max_cached_requests"}

# What each snippet assumes of its engine: the first release with each feature, found in the released packages
# (docs/eval-and-serving.md, "Engine versions"). TensorRT-LLM publishes no code on PyPI, so its releases are not
# verified: its entries name the feature and the PR that added it.
FLOORS = {
    ("vllm", "standalone"): "vLLM >= 0.15.0 for V1 draft models (`method: draft_model`, PR #24322; 0.14.1 refuses it)",
    ("vllm", "eagle3"): "vLLM >= 0.11.1 for V1 `method: eagle3` reading eagle_aux_hidden_state_layer_ids from the "
    "head's config.json (PR #25961)",
    ("vllm", "ngram"): "vLLM >= 0.10.1 for V1 `method: ngram` proposing as measured, the longest n-gram of "
    "prompt_lookup_min..max tokens at its earliest occurrence (vllm/v1/spec_decode/ngram_proposer.py); 0.9.0-0.10.0 "
    "skip occurrences overlapping the context's tail, 0.8.2-0.8.5 serve ngram on V0 unless VLLM_USE_V1=1",
    ("vllm", "suffix"): "vLLM >= 0.11.1 for `method: suffix` (PR #25784) and `pip install arctic-inference` (not a "
    "vLLM dependency; vLLM's error message names arctic-inference==0.1.1)",
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
    ("trtllm", "ngram"): "TensorRT-LLM PyTorch backend with NGramDecodingConfig (PR #3936) taking `max_draft_len` "
    "(older releases: `prompt_lookup_num_tokens`) and `is_public_pool`, release not verified",
    ("trtllm", "cap"): "`max_concurrency` on the speculative config (PyTorch backend only; release not verified)",
}

# (engine, kind) the engine cannot serve: the note that replaces its `needs:` line. SGLang's NGRAM and TensorRT-LLM's
# SA are named so a reader need not look for them, and why they are not written: another draft, never measured here.
UNSERVED = {
    ("sglang", "ngram"): "not served: SGLang has no prompt lookup. Its `--speculative-algorithm NGRAM` (0.5.3 on) "
    "drafts a token tree from one LRU trie of recent output windows shared by all requests and never searches the "
    "prompt beyond its last `--speculative-ngram-max-trie-depth` tokens (0.5.3-0.5.9: "
    "`--speculative-ngram-branch-length`; sglang/srt/speculative/ngram_worker.py): another draft, not measured; no "
    "--speculative-* flags written",
    ("sglang", "suffix"): "not served: SGLang has no suffix decoding (no such algorithm in 0.5.23). Its NGRAM (0.5.3 "
    "on) is the nearest, a shared LRU trie of recent output windows like suffix decoding's response cache, but with no "
    "prompt tree, and it drafts a fixed-size tree (recency BFS or frequency PROB) with no min_token_prob or spec "
    "factor: another draft, not measured; no --speculative-* flags written",
    ("trtllm", "suffix"): "not served: TensorRT-LLM has no suffix decoding (no SuffixDecodingConfig in the "
    "SpeculativeConfig of tensorrt_llm/llmapi/llm_args.py; PRs #9706 and #9912 were closed). Its SA (`decoding_type: "
    "SA`, or `sa_config` on Eagle3 / MTP / PARD) proposes the continuation of the longest match in a suffix automaton "
    "of each request's context: prompt lookup, without suffix decoding's counts, min_token_prob or response cache; no "
    "speculative_config written",
}

# Where vLLM's suffix (Arctic Inference's SuffixDecodingCache.speculate and suffix_tree.cc, 0.1.1 to 0.3.0) departs
# from the eval's SuffixDraft (specdec_runtime/lookup.py); remove an entry when lookup.py adopts Arctic's rule.
VLLM_SUFFIX_DEPARTURES = (
    "vLLM's suffix (Arctic Inference) divides a token's count by all occurrences of the matched text, the context's "
    "own latest one included; the eval's SuffixDraft divides by the occurrences that continue: path probabilities, "
    "so proposals and acceptance, can differ (both score a draft from every match length and keep the best)",
    "vLLM's response cache holds every request's response as it grows (running ones too), keyed by request, so a "
    "repeated prompt finds its earlier answer; the eval cached finished responses and withheld a row's own earlier "
    "one: repeats may accept more here than measured",
)


@dataclass(frozen=True)
class ServingSetting:
    """The measured setting an engine must reproduce."""

    draft: str | None
    """The draft folder the engines load (absolute path of the export) or a hub id; None for a lookup kind."""
    num_draft_tokens: int
    """gamma: tokens drafted per verify step (a lookup's cap: it proposes up to gamma)."""
    kind: Literal["standalone", "eagle3", "ngram", "suffix"] = "standalone"
    """standalone LM, EAGLE-3 head, or a zero-training lookup (prompt lookup, suffix decoding)."""
    draft_rule: Literal["greedy", "sample"] = "greedy"
    """greedy: the draft proposes its argmax (one-hot q); sample: drafts sampled from q, exact rejection sampling.
    A lookup's q is one-hot: the rules coincide and nothing is written for them."""
    aux_layers: tuple[int, ...] | None = None
    """EAGLE-3 only: the target layers the head reads, HF output_hidden_states indices (layer inputs)."""
    concurrency_limit: int | None = None
    """Speculation off above this batch size (a larger measured one failed the margin); None: no measured limit."""
    knobs: dict | None = field(default=None, hash=False)
    """Lookup kinds only: the draft's `.knobs()` (NgramDraft: prompt_lookup_max/min; SuffixDraft: max_depth,
    max_spec_factor, min_token_prob, optionally max_cached_requests)."""

    def __post_init__(self) -> None:
        if self.kind not in METHODS:
            raise ValueError(f"kind must be one of {', '.join(METHODS)}, got {self.kind!r}")
        if self.draft_rule not in ("greedy", "sample"):
            raise ValueError(f"draft_rule must be greedy or sample, got {self.draft_rule!r}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if (self.kind == "eagle3") != (self.aux_layers is not None):
            raise ValueError(
                f"aux_layers are the EAGLE-3 head's target layers: required for kind eagle3, none for another "
                f"draft (kind={self.kind}, aux_layers={self.aux_layers})"
            )
        if self.concurrency_limit is not None and self.concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1 or None, got {self.concurrency_limit}")
        lookup = self.kind in LOOKUP_KINDS
        if lookup != (self.draft is None):
            need = "drafts from tokens and has no folder: pass draft=None" if lookup else "needs its folder or hub id"
            raise ValueError(f"a {self.kind} draft {need} (draft={self.draft!r})")
        if lookup != (self.knobs is not None):
            raise ValueError(
                f"knobs are a zero-training draft's settings (its .knobs()): required for kind ngram / suffix, none "
                f"for a model draft (kind={self.kind}, knobs={self.knobs})"
            )
        if lookup:
            _check_knobs(self.kind, self.knobs)


def _check_knobs(kind: str, knobs: dict) -> None:
    """The knobs every engine mapping reads, in the ranges specdec_runtime/lookup.py accepts; an unknown one is refused
    rather than silently left out of the snippets."""
    names = VLLM_KNOBS[kind]
    missing = [k for k in names if k not in knobs and k not in OPTIONAL_KNOBS]
    unknown = [k for k in knobs if k not in names]
    if missing or unknown:
        raise ValueError(f"{kind} knobs are {', '.join(names)} (missing {missing}, unknown {unknown})")
    v = {k: x for k, x in knobs.items() if isinstance(x, int | float) and not isinstance(x, bool)}
    ints = all(isinstance(v.get(k), int) for k in ("prompt_lookup_max", "prompt_lookup_min", "max_depth") if k in knobs)
    if kind == "ngram":
        ok = ints and 1 <= v["prompt_lookup_min"] <= v["prompt_lookup_max"]
    else:
        ok = ints and len(v) == len(knobs) and v["max_depth"] >= 1 and v["max_spec_factor"] > 0
        ok = ok and 0 <= v["min_token_prob"] <= 1 and isinstance(v.get("max_cached_requests", 0), int)
        ok = ok and v.get("max_cached_requests", 0) >= 0
    if not ok:
        raise ValueError(f"{kind} knobs out of range: {knobs}")


def concurrency_cap(rec: dict) -> int | None:
    """The batch size above which speculation should be off, from an eval recommendation: its confirmed
    max_concurrency when a larger measured concurrency failed the margin, else None (no measured limit)."""
    conf = rec.get("confirmation") or {}
    limit, measured = conf.get("max_concurrency"), conf.get("measured_concurrency") or []
    return limit if limit is not None and measured and limit < max(measured) else None


def recommended_setting(
    rec: dict, draft: str | None, aux_layers: tuple[int, ...] | None = None, knobs: dict | None = None
) -> ServingSetting:
    """The setting of an eval recommendation (report.json's `recommendation`), served from `draft` (None for a lookup
    kind); `aux_layers`: an EAGLE-3 head's, as eval measured them; `knobs`: a lookup's, else the recommendation's
    own `knobs`."""
    return ServingSetting(
        draft=draft,
        num_draft_tokens=rec["num_draft_tokens"],
        kind=rec.get("kind", "standalone"),
        draft_rule=rec.get("draft_rule", "greedy"),
        aux_layers=aux_layers,
        concurrency_limit=concurrency_cap(rec),
        knobs=knobs if knobs is not None else rec.get("knobs"),
    )


def unserved_engines(s: ServingSetting) -> list[str]:
    """Engines that cannot serve the setting's kind: their snippet is empty, their notes start with `not served:`."""
    return [e for e in ENGINES if (e, s.kind) in UNSERVED]


def engine_snippets(s: ServingSetting) -> dict:
    """Speculative decoding settings for vLLM, SGLang and TensorRT-LLM reproducing `s`; an engine that cannot serve
    the kind gets an empty one ({} or []: the target alone)."""
    vllm_method, sglang_algorithm, trtllm_type = METHODS[s.kind]
    K = s.num_draft_tokens
    if s.kind in LOOKUP_KINDS:
        # No model: vLLM sets model to the method itself. Knobs under vLLM's names; an unmeasured optional one is
        # left at vLLM's default (the note says so).
        vllm = {"method": vllm_method, "num_speculative_tokens": K}
        vllm |= {key: s.knobs[k] for k, key in VLLM_KNOBS[s.kind].items() if k in s.knobs}
    else:
        vllm = {"model": s.draft, "num_speculative_tokens": K, "method": vllm_method}
    if s.draft_rule == "sample" and s.kind not in LOOKUP_KINDS:
        vllm["draft_sample_method"] = "probabilistic"  # vLLM's default, greedy, is our greedy rule
    trtllm = {"decoding_type": trtllm_type, "max_draft_len": K}
    if s.kind == "ngram":
        # The pool kept per request (its default, one pool for all requests, proposes other requests' text), every
        # continuation kept and the oldest proposed: the earliest occurrence's, as prompt lookup
        # (tensorrt_llm/_torch/speculative/ngram.py). The two defaults are written so a change of default cannot
        # change the rule. It matches n-grams of max_matching_ngram_size down to 1 token: no minimum (engine_notes).
        trtllm |= {
            "max_matching_ngram_size": s.knobs["prompt_lookup_max"],
            "is_public_pool": False,
            "is_keep_all": True,
            "is_use_oldest": True,
        }
    elif s.kind not in LOOKUP_KINDS:
        trtllm["speculative_model"] = s.draft
    if s.kind == "eagle3":  # TensorRT-LLM captures layer outputs: output i is HF hidden_states[i + 1]
        trtllm["eagle3_layers_to_capture"] = [i - 1 for i in s.aux_layers]
    if s.concurrency_limit is not None:
        cap = s.concurrency_limit
        if s.kind != "suffix":  # vLLM's suffix proposer refuses a step K other than the configured one (engine_notes)
            # vLLM's batch-size schedule: [batch_lo, batch_hi, K] entries from 1, the last entry's K holding for
            # every larger batch (vllm/v1/spec_decode/dynamic/utils.py).
            vllm["num_speculative_tokens_per_batch_size"] = [[1, cap, K], [cap + 1, cap + 1, 0]]
        trtllm["max_concurrency"] = cap  # Drafter.should_use_spec_decode (tensorrt_llm/_torch/speculative/drafter.py)
    # SGLang's STANDALONE and EAGLE3 algorithms draft a chain (topk 1) of num-steps tokens; with topk 1 SGLang
    # requires num-draft-tokens = num-steps + 1 (the verified root plus the drafted chain) and rewrites others.
    sglang = [
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
    ]
    return {
        # `vllm serve TARGET --speculative-config '<json of speculative_config>'`; an EAGLE-3 head reads the target's
        # hidden states, so vLLM needs `method` to know it (its architecture name alone is not enough).
        "vllm": {"speculative_config": vllm},
        "sglang": sglang if sglang_algorithm is not None else [],
        # TensorRT-LLM LLM API / `trtllm-serve TARGET --config spec.yaml` (`--extra_llm_api_options` is its older
        # name): DraftTargetDecodingConfig and NGramDecodingConfig, which its docs run with the overlap scheduler
        # disabled, or Eagle3DecodingConfig.
        "trtllm": {
            "speculative_config": trtllm,
            **({"disable_overlap_scheduler": True} if s.kind in ("standalone", "ngram") else {}),
        }
        if trtllm_type is not None
        else {},
    }


def engine_notes(s: ServingSetting) -> dict[str, list[str]]:
    """Per engine: the version its snippet assumes (`needs: ...`), or why it cannot serve the kind (`not served:
    ...`), then every way it departs from the measured setting or needs checking. serving.yaml writes them as comments
    above each engine, the model card under it."""
    unserved = unserved_engines(s)
    notes = {e: [UNSERVED[e, s.kind] if e in unserved else f"needs: {FLOORS[e, s.kind]}"] for e in ENGINES}
    if s.kind == "suffix":
        notes["vllm"] += VLLM_SUFFIX_DEPARTURES
        if "max_cached_requests" not in s.knobs:
            notes["vllm"].append(
                "max_cached_requests was not measured: vLLM's default response cache (10000 requests) is served"
            )
    if s.kind == "ngram" and s.knobs["prompt_lookup_min"] > 1:
        notes["trtllm"].append(
            f"TensorRT-LLM's NGram has no prompt_lookup_min: where no n-gram of {s.knobs['prompt_lookup_min']}.."
            f"{s.knobs['prompt_lookup_max']} tokens recurs (the measured draft proposed nothing) it proposes from a "
            "shorter one, down to 1 token"
        )
    if s.concurrency_limit is not None:
        if s.kind == "suffix":
            notes["vllm"].append(
                f"no concurrency cap written: vLLM's suffix proposer asserts that each step's num_speculative_tokens "
                f"is the configured one (vllm/v1/spec_decode/suffix_decoding.py), so the batch-size schedule's 0 "
                f"would fail; speculation was measured to lose above batch size {s.concurrency_limit}"
            )
        else:
            notes["vllm"][0] += f"; {FLOORS['vllm', 'cap']}"
        if "trtllm" not in unserved:
            notes["trtllm"][0] += f"; {FLOORS['trtllm', 'cap']}"
        if "sglang" not in unserved:
            notes["sglang"].append(
                f"no concurrency cap written (no SGLang switch for it was verified): speculation was measured to lose "
                f"above batch size {s.concurrency_limit}"
            )
        if s.kind in ("standalone", "ngram"):
            notes["vllm"].append(
                "vLLM documents num_speculative_tokens_per_batch_size as tested with EAGLE / EAGLE-3 / DFlash only, "
                f"and as off when data parallelism > 1: check that the cap holds for this {METHODS[s.kind][0]} "
                "deployment"
            )
    if s.draft_rule == "sample" and s.kind not in LOOKUP_KINDS:
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
    written: not verified for these decoding types. A lookup's rules coincide (one-hot q)."""
    return ["sglang", "trtllm"] if s.draft_rule == "sample" and s.kind not in LOOKUP_KINDS else []


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


def kind_difference(s: ServingSetting) -> str | None:
    """The sentence serving.yaml's reason adds when an engine cannot serve the measured kind at all, else None."""
    engines = unserved_engines(s)
    if not engines:
        return None
    names = " and ".join(ENGINE_NAMES[e] for e in engines)
    return (
        f"{names} cannot serve the measured {s.kind} draft: no speculative decoding is configured there (their notes "
        "name the nearest method and why it is not written)."
    )


def speculators_convert_command(draft: str, verifier: str, aux_layers: list[int] | tuple[int, ...]) -> str:
    """The `speculators convert` command for an EAGLE-3 head: the converter takes the aux ids only from
    --algorithm-kwargs (never from config.json), so without them a head with custom layers converts to the default
    ones. --verifier is an HF id or folder; the output goes next to the head, `<draft>-speculators`."""
    kwargs = json.dumps({"eagle_aux_hidden_state_layer_ids": list(aux_layers)})
    args = ["speculators", "convert", draft, "--algorithm", "eagle3", "--verifier", verifier]
    return shlex.join([*args, "--output-path", f"{draft}-speculators", "--algorithm-kwargs", kwargs])
