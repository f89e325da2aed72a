"""Exact behaviour of the speculative engine: hand-written accept/reject cases, greedy identity, stops, bad input."""

from types import SimpleNamespace

import pytest
import torch
from helpers.models import LLAMA_PROMPTS, hf_greedy, perturbed, tiny_llama

from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.llama import Llama

# Tiny models: intra-op thread wake-ups cost more than the maths on a shared 2-core machine.
pytestmark = pytest.mark.usefixtures("one_thread")


class PositionLM(torch.nn.Module):
    """Predicts `script[pos + 1]` at position pos, whatever the tokens: wrong position ids show up as wrong tokens."""

    def __init__(self, script: list[int], vocab_size: int = 16, peak: float = 50.0):
        super().__init__()
        self.logits = peak * torch.nn.functional.one_hot(torch.tensor(script[1:] + [0]), vocab_size).float()
        self.config = SimpleNamespace(vocab_size=vocab_size, max_position_embeddings=1024)
        self.device = torch.device("cpu")

    def forward(self, input_ids, position_ids, attention_mask, cache, use_cache=True, logits_to_keep=0):
        logits = self.logits[position_ids]  # (B, T, V)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def reference_steps(target: list[int], draft: list[int], prompt_len: int, gamma: int, max_new: int, stop=()):
    """Accepted counts per verify step and the emitted tokens, by hand: draft token i is accepted iff it matches.

    The first token comes from the target's prefill, so the first verify step starts after it.
    """
    steps, out, pos = [], [target[prompt_len]], prompt_len  # pos: position of the last token so far
    while len(out) < max_new and out[-1] not in stop:
        n = 0
        while n < gamma and draft[pos + 1 + n] == target[pos + 1 + n]:
            n += 1
        steps.append(n)
        for token in target[pos + 1 : pos + n + 2]:
            if len(out) < max_new and not (out and out[-1] in stop):
                out.append(token)
        pos += n + 1
    return steps, out


SCRIPT = [(7 * i + 3) % 16 for i in range(200)]
NEVER = [(t + 1) % 16 for t in SCRIPT]
PARTIAL = [t if i % 3 else (t + 5) % 16 for i, t in enumerate(SCRIPT)]
PROMPTS = [[1, 2, 3, 4, 5], [6], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


@pytest.mark.parametrize("draft_script", [SCRIPT, NEVER, PARTIAL], ids=["always", "never", "partial"])
@pytest.mark.parametrize("gamma", [1, 3, 4])
@pytest.mark.parametrize("rule,temperature", [("greedy", 0.0), ("sample", 0.0), ("sample", 1.0), ("greedy", 1.0)])
def test_accept_counts_match_hand_computed(draft_script, gamma, rule, temperature):
    max_new = 13
    result = generate(
        PositionLM(SCRIPT),
        PositionLM(draft_script),
        PROMPTS,
        num_draft_tokens=gamma,
        draft_rule=rule,
        sampling=SamplingParams(temperature=temperature),
        max_new_tokens=max_new,
        generator=torch.Generator().manual_seed(0),
    )
    for prompt, tokens, req in zip(PROMPTS, result.tokens, result.stats.requests):
        steps, out = reference_steps(SCRIPT, draft_script, len(prompt), gamma, max_new)
        assert tokens == out == SCRIPT[len(prompt) : len(prompt) + max_new]
        assert req.verify_steps == len(steps)
        assert req.accepted == sum(steps)
        assert req.drafted == gamma * len(steps)
        assert req.position_accepted == [sum(n > i for n in steps) for i in range(gamma)]
        assert req.position_reached == [sum(n >= i for n in steps) for i in range(gamma)]
        assert req.target_forwards == len(steps) + 1  # + the prefill, which emits the first token
    agg = result.stats.aggregate()
    if draft_script is SCRIPT:
        assert agg["acceptance_rate"] == 1.0
    if draft_script is NEVER:
        assert agg["acceptance_rate"] == 0.0 and agg["mean_accepted_length"] == 1.0


def test_stop_token_mid_draft_ends_each_row_after_it():
    stop = SCRIPT[9]  # position 9: inside a draft block for every prompt length here
    result = generate(PositionLM(SCRIPT), PositionLM(SCRIPT), PROMPTS, num_draft_tokens=4, stop_token_ids=[stop])
    for prompt, tokens in zip(PROMPTS, result.tokens):
        _, expected = reference_steps(SCRIPT, SCRIPT, len(prompt), 4, 30, stop=(stop,))
        assert tokens == expected and tokens[-1] == stop and stop not in tokens[:-1]
    assert len({len(t) for t in result.tokens}) > 1  # rows finished at different times


def test_max_new_tokens_is_never_exceeded():
    for max_new in (1, 2, 5, 6):
        result = generate(PositionLM(SCRIPT), PositionLM(SCRIPT), PROMPTS, num_draft_tokens=4, max_new_tokens=max_new)
        assert [len(t) for t in result.tokens] == [max_new] * len(PROMPTS)


@pytest.fixture(scope="module")
def llamas():
    target = tiny_llama(0)
    return {"target": target, "other": tiny_llama(1), "near": perturbed(target, 0.004, seed=2)}


@pytest.mark.parametrize("backend", ["hf", "compact"])
@pytest.mark.parametrize("draft_name", ["other", "near", "self"])
def test_greedy_identity_with_target_only_and_hf_generate(llamas, backend, draft_name):
    target = llamas["target"]
    draft = target if draft_name == "self" else llamas[draft_name]
    reference = hf_greedy(target, LLAMA_PROMPTS, 24)
    if backend == "compact":
        target, draft = Llama.from_hf(target), Llama.from_hf(draft)
    assert generate(target, None, LLAMA_PROMPTS, max_new_tokens=24).tokens == reference
    rates = []
    for gamma in (1, 2, 4, 8):
        result = generate(target, draft, LLAMA_PROMPTS, num_draft_tokens=gamma, max_new_tokens=24)
        assert result.tokens == reference, f"gamma={gamma}"
        rates.append(result.stats.aggregate()["acceptance_rate"])
    if draft_name == "self":
        assert rates == [1.0] * 4
    if draft_name == "near":
        assert all(0 < r < 1 for r in rates)  # rejections and acceptances both exercised


@pytest.mark.parametrize("backend", ["hf", "compact"])
def test_greedy_identity_with_eos_hit_mid_draft(llamas, backend):
    target, draft = llamas["target"], llamas["near"]
    free = hf_greedy(target, LLAMA_PROMPTS, 24)
    eos = free[0][6]  # a token greedy decoding really produces, mid-sequence
    reference = hf_greedy(target, LLAMA_PROMPTS, 24, eos=eos)
    assert reference[0][-1] == eos and len(reference[0]) < 24
    if backend == "compact":
        target, draft = Llama.from_hf(target), Llama.from_hf(draft)
    for gamma in (2, 4, 8):
        result = generate(target, draft, LLAMA_PROMPTS, num_draft_tokens=gamma, max_new_tokens=24, stop_token_ids=[eos])
        assert result.tokens == reference, f"gamma={gamma}"


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True},
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}},
    ],
    ids=["gqa", "tied", "mha-bias", "rope-linear"],
)
def test_compact_llama_logits_match_hf(overrides):
    hf = tiny_llama(3, **overrides)
    compact = Llama.from_hf(hf)
    tokens = torch.randint(64, (2, 9), generator=torch.Generator().manual_seed(0))
    compact.setup_cache(2, 16)
    S = compact.cache_shape[1]
    positions = torch.arange(9).expand(2, 9)
    mask = (torch.arange(S) <= positions[..., None])[:, None]  # (B, 1, T, S)
    with torch.no_grad():
        got = compact(tokens, positions, positions, mask)
        expected = hf(input_ids=tokens).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_compact_model_refuses_other_architectures():
    hf = tiny_llama(0)
    hf.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="generic HF path"):
        Llama.from_hf(hf)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_draft_tokens": 0}, "num_draft_tokens must be >= 1"),
        ({"sampling": "temperature"}, "temperature must be >= 0"),
        ({"sampling": "top_p0"}, r"top_p must be in \(0, 1\]"),
        ({"sampling": "top_p2"}, r"top_p must be in \(0, 1\]"),
        ({"sampling": "top_k"}, "top_k must be >= 0"),
        ({"prompts": [[1] * 250]}, "exceeds the context window of 256"),
        ({"prompts": [[1, 2], []]}, "at least one token"),
        ({"draft": "wide"}, "differ in width"),
        ({"draft_rule": "typical"}, "draft_rule must be"),
        ({"draft": "same-compact"}, "one compact Llama object"),
    ],
)
def test_bad_input_raises_a_clear_value_error(llamas, kwargs, match):
    bad_sampling = {
        "temperature": dict(temperature=-0.1),
        "top_p0": dict(top_p=0.0),
        "top_p2": dict(top_p=1.5),
        "top_k": dict(top_k=-1),
    }
    call = {"draft": llamas["other"], "prompts": [[1, 2, 3]], "max_new_tokens": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        if "sampling" in kwargs:
            call["sampling"] = SamplingParams(**bad_sampling[kwargs["sampling"]])
        target = llamas["target"]
        if kwargs.get("draft") == "wide":
            call["draft"] = tiny_llama(1, vocab_size=80)
        if kwargs.get("draft") == "same-compact":
            target = call["draft"] = Llama.from_hf(target)
        generate(target, call.pop("draft"), call.pop("prompts"), **call)
