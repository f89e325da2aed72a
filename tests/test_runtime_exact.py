"""Exact behaviour of the speculative engine: hand-written accept/reject cases, greedy identity, stops, bad input."""

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers.models import LLAMA_PROMPTS, hf_greedy, perturbed, tiny_llama
from transformers.models.llama.modeling_llama import eager_attention_forward

from specdec_runtime.backends import fast_model
from specdec_runtime.eagle3 import Eagle3Draft
from specdec_runtime.eagle3_state import AuxCapture
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.llama import Llama, grouped_attention

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


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
def test_grouped_attention_equals_repeated_keys_and_hf(heads, kv_heads):
    """Folding a group's query heads into the query length (issue 22) computes what repeating every key and value
    per query head did before, and what HF's eager attention computes, under a random mask."""
    B, T, W, D, G = 3, 5, 19, 8, heads // kv_heads
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, heads, D, generator=gen)
    keys, values = (torch.randn(B, W, kv_heads, D, generator=gen).transpose(1, 2) for _ in range(2))  # cache views
    mask = torch.rand(B, 1, T, W, generator=gen) < 0.5
    mask[..., 0] = True  # every query sees a key
    got = grouped_attention(q, keys, values, mask)  # (B, T, H * D)
    repeated = [kv[:, :, None].expand(B, kv_heads, G, W, D).reshape(B, heads, W, D) for kv in (keys, values)]
    before = F.scaled_dot_product_attention(q.transpose(1, 2), *repeated, attn_mask=mask)  # (B, H, T, D)
    torch.testing.assert_close(got, before.transpose(1, 2).reshape(B, T, -1), atol=1e-6, rtol=1e-5)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=G, training=False)
    hf, _ = eager_attention_forward(module, q.transpose(1, 2), keys, values, additive, scaling=D**-0.5)
    torch.testing.assert_close(got, hf.reshape(B, T, -1), atol=1e-6, rtol=1e-5)


def test_compact_attention_reads_the_cache_where_it_lies(monkeypatch):
    """Issue 22: the compact model's attention reads every layer's static cache itself, not a per-head copy of it
    (which cost a copy of the whole cache per layer and step)."""
    compact = Llama.from_hf(tiny_llama(3))  # 4 query heads over 2 kv heads
    read, sdpa = [], F.scaled_dot_product_attention

    def recorded(q, k, v, **kwargs):
        read.append((storage(k), storage(v)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    S = compact.setup_cache(2, 8)
    positions = torch.arange(4).expand(2, 4)
    mask = (torch.arange(S) <= positions[..., None])[:, None]  # (B, 1, T, S)
    with torch.no_grad():
        compact(torch.ones(2, 4, dtype=torch.long), positions, positions, mask)
    assert read == [(storage(a.k_cache), storage(a.v_cache)) for a in attentions(compact)]


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def attentions(model: Llama) -> list:
    return [layer.self_attn for layer in model.layers]


def fake_cuda_capture(monkeypatch) -> None:
    """`Llama._capture`'s CUDA calls as no-ops (streams, pool, graph), so its warm-up and capture run on the CPU."""
    stream = SimpleNamespace(wait_stream=lambda other: None)
    calls = {"Stream": lambda: stream, "current_stream": lambda: stream, "stream": lambda s: nullcontext(),
             "graph_pool_handle": object, "CUDAGraph": object, "graph": lambda graph, pool: nullcontext()}  # fmt: skip
    for name, fake in calls.items():
        monkeypatch.setattr(torch.cuda, name, fake)


def test_inference_models_hold_no_autograd_state(monkeypatch):
    """Issue 22: no model the runtime builds for decoding requires grad (the compact model CUDA runs, the CPU fast
    path's target, draft and EAGLE-3 head), and a CUDA graph's warm-up and capture run under no_grad: a graph
    captured with autograd on records a backward graph too, and its pool keeps the saved activations alive. What
    the capture writes (the graph's logits, the static cache, a head's aux buffers) carries no autograd history."""
    hf = tiny_llama(0, layers=6)
    head = Eagle3Draft.from_target(hf, torch.arange(0, 64, 2), seed=0)
    built = {
        "compact": Llama.from_hf(hf),
        "cpu target": fast_model(hf),
        "cpu draft": fast_model(hf, draft=True),
        "cpu head": fast_model(head),
    }
    for name, model in built.items():
        assert not [key for key, w in model.named_parameters() if w.requires_grad], name
    compact = built["compact"]
    compact.setup_cache(2, 16)
    aux = AuxCapture([compact.layers[i] for i in head.aux_layers(6)])
    grad_modes = []
    compact.register_forward_pre_hook(lambda module, args: grad_modes.append(torch.is_grad_enabled()))
    fake_cuda_capture(monkeypatch)
    _, _, logits = compact._capture(2, 3)  # (graph, static inputs, logits)
    assert grad_modes == [False] * 3  # two warm-up forwards, then the capture
    caches = [c for a in attentions(compact) for c in (a.k_cache, a.v_cache)]
    assert all(t.grad_fn is None and not t.requires_grad for t in [logits, *aux.bufs, *caches])


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
