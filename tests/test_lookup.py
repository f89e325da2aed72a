"""Zero-training drafts (lookup.py, issue 26): each proposal against a from-scratch reference, greedy identity with
target-only decoding, the exact distribution at T > 0 with a broken twin the same test rejects, and the suffix
draft's memory of earlier calls (a repeat of a prompt never looks its own answer up)."""

import random

import pytest
import torch
from helpers.models import hf_greedy, tiny_llama
from helpers.runs import load_benchmark
from helpers.stats import chi_square_pvalue, joint3

import specdec_runtime.lookup as lookup
from specdec_runtime.cpu import cpu_model
from specdec_runtime.engine import SamplingParams, generate
from specdec_runtime.errors import UserError
from specdec_runtime.llama import Llama
from specdec_runtime.lookup import NgramDraft, NgramState, SuffixDraft, SuffixState, lookup_draft

pytestmark = pytest.mark.usefixtures("one_thread")

REPEATING = [[5, 17, 3, 5, 17, 3, 5, 17], [11], [60, 2, 33, 60, 2], [7] * 9, [1, 2, 3, 4, 1, 2, 3]]


def ngram_reference(context: list[int], lo: int, hi: int, k: int) -> list[int]:
    """vLLM's rule from scratch: the longest suffix of n in [lo, hi] tokens seen earlier, its earliest occurrence,
    the tokens after it (at most k, up to the context's end)."""
    L = len(context)
    for n in range(hi, lo - 1, -1):
        if L < n:
            continue
        for j in range(0, L - n):  # ends before the last token: something follows it
            if context[j : j + n] == context[L - n :]:
                return context[j + n : j + n + k]
    return []


def random_contexts(seed: int, rows: int, alphabet: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(alphabet) for _ in range(rng.randrange(1, 30))] for _ in range(rows)]


@pytest.mark.parametrize("lo,hi", [(1, 1), (1, 3), (2, 4), (3, 3)])
def test_every_ngram_proposal_matches_the_reference(lo, hi):
    for seed in range(20):
        contexts = random_contexts(seed, 6)
        state = NgramState(NgramDraft(hi, lo), len(contexts), 40, torch.device("cpu"))
        width = max(map(len, contexts))
        tokens = torch.tensor([[0] * (width - len(c)) + c for c in contexts])
        state.extend(tokens, torch.tensor([len(c) for c in contexts]))
        x, limit = state.propose(5)
        got = [row[:n] for row, n in zip(x.tolist(), limit.tolist())]
        assert got == [ngram_reference(c, lo, hi, 5) for c in contexts], seed


def test_the_ngram_draft_reads_nothing_back_from_the_device(monkeypatch):
    """Its state's writes and matches stay on the device (on CUDA a read back is a host sync per step); the step's
    one read, the proposal's width, is lookup_step's."""
    from helpers.syncs import count_host_syncs

    syncs = count_host_syncs(monkeypatch, NgramState, ("extend", "propose"), moves=False)
    getitem = torch.Tensor.__getitem__

    def masked(self, index):  # a boolean-mask index has a data-dependent shape: the device reports it to the host
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts):
            syncs["boolean mask index"] += 1
        return getitem(self, index)

    monkeypatch.setattr(torch.Tensor, "__getitem__", masked)
    target = tiny_llama(seed=1, layers=2)
    want = hf_greedy(target, REPEATING, 12)
    assert generate(Llama.from_hf(target), NgramDraft(3, 1), REPEATING, max_new_tokens=12).tokens == want
    assert not syncs, syncs


def suffix_reference(context: list[int], depth: int, factor: float, min_prob: float, k: int) -> list[int]:
    """Suffix decoding over the context alone, from scratch: from every suffix of m < depth tokens that occurred
    earlier, the most frequent next token while the path probability stays >= min_prob (at most factor x m tokens,
    substrings of at most depth tokens); the walk with the highest score (sum of its path probabilities) wins, the
    longer match on a tie."""

    def after(s: list[int]) -> dict[int, int]:
        counts: dict[int, int] = {}
        for i in range(len(context) - len(s)):
            if context[i : i + len(s)] == s:
                counts[context[i + len(s)]] = counts.get(context[i + len(s)], 0) + 1
        return counts

    best, best_score = [], 0.0
    for m in range(min(depth, len(context)), 0, -1):
        s, out, prob, score = context[len(context) - m :], [], 1.0, 0.0
        while len(out) < min(k, int(factor * m)) and len(s) < depth and after(s):
            counts = after(s)
            token = max(counts, key=lambda t: (counts[t], -list(counts).index(t)))
            prob *= counts[token] / sum(counts.values())
            if prob < min_prob:
                break
            out.append(token)
            score += prob
            s = s + [token]
        if score > best_score:
            best, best_score = out, score
    return best


@pytest.mark.parametrize("depth,factor,min_prob", [(24, 1.0, 0.1), (3, 2.0, 0.0), (6, 0.5, 0.3)])
def test_every_suffix_proposal_matches_the_reference(depth, factor, min_prob):
    """Over the context alone (a fresh draft: no earlier responses); ties between equally frequent next tokens are
    broken the same way (the first seen), so the alphabet is small enough to make them common."""
    for seed in range(20):
        contexts = random_contexts(100 + seed, 6)
        state = SuffixState(SuffixDraft(depth, factor, min_prob), contexts, torch.device("cpu"))
        x, limit = state.propose(5)
        got = [row[:n] for row, n in zip(x.tolist(), limit.tolist())]
        assert got == [suffix_reference(c, depth, factor, min_prob, 5) for c in contexts], seed


def feed(state, *rows: list[int]) -> None:
    """What the engine feeds a state: ragged rows of new tokens, left-padded."""
    width = max(map(len, rows))
    state.extend(torch.tensor([[0] * (width - len(r)) + r for r in rows]), torch.tensor([len(r) for r in rows]))


def suffix_call(draft: SuffixDraft, prompts: list[list[int]], *emitted: list[int]) -> SuffixState:
    """A call's state after its prefill and the emitted tokens of each row."""
    state = SuffixState(draft, prompts, torch.device("cpu"))
    feed(state, *prompts)  # the prefill (the prompts are filed when the state is built)
    if emitted:
        feed(state, *emitted)
    return state


def test_the_suffix_draft_remembers_other_prompts_and_withholds_a_repeat():
    """Call 1's response to prompt A is proposed to prompt B, whose context ends like A's response began; a repeat of
    A itself (in the same call) never proposes its own earlier response; the oldest response leaves past
    max_cached_requests."""
    draft = SuffixDraft(max_depth=8, max_spec_factor=2.0, min_token_prob=0.0, max_cached_requests=1)
    a, b = [40, 41], [50]
    suffix_call(draft, [a], [1, 2, 3, 4, 5, 6])  # A's response
    state = suffix_call(draft, [b, a], [1, 2], [9, 1])  # files A's response; withholds it from A's repeat
    x, limit = state.propose(4)
    assert x[0, : limit[0]].tolist() == [3, 4, 5, 6]  # ..., 1, 2 -> 3, 4, 5, 6 from A's response
    assert limit[1] == 0  # A's repeat: its own response is withheld, its context has no earlier 1
    # files B's response [1, 2], then A's newest [9, 1] replaces its first: one cached request keeps A's newest
    x, limit = suffix_call(draft, [[7], [8]], [9], [1, 2]).propose(4)
    assert draft._responses == {tuple(a): [9, 1]}
    assert x[0, : limit[0]].tolist() == [1] and limit[1] == 0  # 9 -> 1 from A's newest; A's first and B's are gone


def test_knobs_are_validated_and_parsed():
    assert lookup_draft("ngram") == NgramDraft()
    assert lookup_draft("ngram:max=5,min=1") == NgramDraft(5, 1)
    assert lookup_draft("suffix:depth=8,factor=2,prob=0.2,cached=5").knobs() == {
        "max_depth": 8,
        "max_spec_factor": 2.0,
        "min_token_prob": 0.2,
        "max_cached_requests": 5,
    }
    for bad, says in [
        ("ngram:max=1,min=2", "prompt_lookup_min <= prompt_lookup_max"),
        ("ngram:size=3", "takes max, min"),
        ("ngram:max=x", "not a int"),
        ("lookup", "unknown zero-training draft"),
        ("suffix:prob=2", "min_token_prob"),
    ]:
        with pytest.raises(UserError, match=says):
            lookup_draft(bad)


# ---------------------------------------------------------------------------------------------- greedy identity


@pytest.mark.parametrize("spec", ["ngram", "ngram:max=3,min=1", "suffix", "suffix:depth=4,factor=2,prob=0"])
@pytest.mark.parametrize("backend", ["hf", "compact", "cpu-fast"])
def test_greedy_output_equals_target_only_greedy(spec, backend):
    target = tiny_llama(seed=1, layers=2)
    model = {"hf": lambda: target, "compact": lambda: Llama.from_hf(target), "cpu-fast": lambda: cpu_model(target)}
    model = model[backend]()
    draft = lookup_draft(spec)
    want = hf_greedy(target, REPEATING, 30)
    stop = want[0][7]
    want_stop = hf_greedy(target, REPEATING, 30, eos=stop)
    for stop_ids, expected in (((), want), ((stop,), want_stop), ((), want)):  # the suffix draft's second call too
        got = generate(model, draft, REPEATING, num_draft_tokens=4, max_new_tokens=30, stop_token_ids=stop_ids)
        assert got.tokens == expected, stop_ids
        requests = got.stats.requests
        assert sum(r.accepted for r in requests) > 0, "these prompts repeat: some proposal is accepted"
        assert all(r.accepted <= r.drafted <= 4 * r.verify_steps for r in requests)
        assert got.stats.draft_forwards == 0 and got.stats.phases.draft_s > 0  # no forward; its time is the draft's


def test_a_step_where_no_row_proposes_is_a_plain_decode_step():
    """No prompt repeats a token and the lookup needs 3: every verify forward is one token wide, as target-only."""
    target = Llama.from_hf(tiny_llama(seed=1, layers=2))
    widths = []
    extend = type(target).step

    def recorded(self, tokens, *args):
        widths.append(tokens.shape[1])
        return extend(self, tokens, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(target), "step", recorded)
        got = generate(target, NgramDraft(3, 3), [[1, 2, 3, 4, 5]], num_draft_tokens=4, max_new_tokens=3)
    assert got.stats.requests[0].drafted == 0 and set(widths) == {1}, widths


# ------------------------------------------------------------------------------------------- distribution at T > 0

V6 = 6
DIST_PROMPTS = {"short": [4, 1, 4], "long": [2, 5, 1, 3, 2, 5]}
DRAWS = 6000  # per prompt kind


@pytest.fixture(scope="module")
def spread_target():
    return tiny_llama(seed=5, vocab_size=V6, layers=4, initializer_range=0.5, max_position_embeddings=64)


def joint_pvalues(target, spec: str, sampling: SamplingParams) -> tuple[dict[str, float], int]:
    prompts = [DIST_PROMPTS["short"], DIST_PROMPTS["long"]] * DRAWS
    result = generate(target, lookup_draft(spec), prompts, num_draft_tokens=2, sampling=sampling, max_new_tokens=3,
                      generator=torch.Generator().manual_seed(0))  # fmt: skip
    flat = (torch.tensor(result.tokens) * torch.tensor([V6 * V6, V6, 1])).sum(1)
    pvalues = {
        kind: chi_square_pvalue(
            torch.bincount(flat[i::2], minlength=V6**3), joint3(target, DIST_PROMPTS[kind], sampling, V6)
        )
        for i, kind in enumerate(("short", "long"))
    }
    return pvalues, sum(r.drafted for r in result.stats.requests)


@pytest.mark.parametrize("spec", ["ngram:max=2,min=1", "suffix:prob=0"])
@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.8, top_k=4)], ids=["t1", "t0.8-top4"])
def test_sampling_is_distributed_as_target_only(spread_target, spec, sampling):
    pvalues, drafted = joint_pvalues(spread_target, spec, sampling)
    assert drafted > DRAWS, "the prompts repeat: most rows propose, so the test sees the verification"
    assert min(pvalues.values()) > 1e-4, pvalues


@pytest.mark.parametrize("spec", ["ngram:max=2,min=1", "suffix:prob=0"])
def test_accepting_past_a_rows_proposal_is_caught(spread_target, monkeypatch, spec):
    """Guard on the test above: a verify that ignores each row's proposal length accepts the padding after it."""
    verify = lookup.verify
    monkeypatch.setattr(lookup, "verify", lambda p, q, x, gen, greedy, limit: verify(p, q, x, gen, greedy))
    pvalues, _ = joint_pvalues(spread_target, spec, SamplingParams(1.0))
    assert min(pvalues.values()) < 1e-6, pvalues


# ------------------------------------------------------------------------------------------------ eval and report


def kinds_in_order(report: dict) -> list[str]:
    return [c["kind"] for c in report["candidates"]]


def test_eval_measures_free_drafts_next_to_a_model_per_category(tmp_path):
    """The sweep measures ngram and suffix candidates with the same paired A/B as a draft model (the target as its
    own draft here); each setting's categories carry their own paired speedup, the report says per category which
    kind wins, a lookup has no tree settings and no offline estimate."""
    from eval.config import EvalConfig
    from eval.report import kind_wins, write_reports
    from eval.sweep import EvalPrompt, resolve_candidates, run_sweep
    from specdec_runtime.loading import load_model
    from specdec_runtime.tiny import build_tiny_model

    folder = build_tiny_model("tiny-llama", tmp_path / "tiny")
    target, tokenizer = load_model(str(folder), device="cpu")
    texts = {"repeats": ["a b c a b c a b", "x y x y x y x"], "plain": ["hello there", "what is it"]}
    prompts = [
        EvalPrompt(id=f"{cat}{i}", category=cat, ids=tokenizer.encode(text))
        for cat, group in texts.items()
        for i, text in enumerate(group * 2)
    ]
    cfg = EvalConfig(num_draft_tokens=[2, 3], temperatures=[0.0], trees=["2,2"], max_new_tokens=8, warmup=0)
    candidates = resolve_candidates([folder, "ngram:max=2,min=1", "suffix"])
    assert [c.kind for c in candidates] == ["standalone", "ngram", "suffix"]
    report = run_sweep(target, tokenizer, candidates, prompts, cfg, target_spec=str(folder), progress=False)
    by_name = {c["name"]: c for c in report["candidates"]}
    # every setting at T = 0 (2 + 2 + 3 of them) is an arm next to one target-only arm: each of the 4 selection
    # prompts runs target-only once per repeat, not once per setting
    assert report["target_only"][0]["calls"] == 4 * cfg.repeats
    # what it ran on: the CPU's flags, the target's decode step against the bandwidth floor, the layouts it chose
    machine = report["machine"]
    assert machine["cpu"] and machine["cores"] >= 1 and machine["bandwidth_gb_s"] > 0
    assert machine["decode_step_over_floor"] == machine["decode_step_s"] / machine["decode_floor_s"] > 0
    assert set(machine["layouts"]["target"]) >= {"qkv", "gate_up", "lm_head"}
    assert by_name["ngram:max=2,min=1"]["draft"] == "ngram:max=2,min=1" and by_name["suffix"]["kind"] == "suffix"
    for name in ("ngram:max=2,min=1", "suffix"):
        cand = by_name[name]
        assert cand["expected_acceptance"] is None and cand["num_parameters"] == 0
        assert [s["tree"] for s in cand["settings"]] == [None, None]  # chains only
        assert all(s["draft_forwards"] == 0 for s in cand["settings"])
    assert [s["tree"] for s in by_name["tiny"]["settings"]] == [None, None, "2,2"]
    for cand in report["candidates"]:
        for s in cand["settings"]:
            for stats in s["by_category"].values():
                assert stats["units"] == 2 and stats["speedup_ci"][0] <= stats["speedup"] <= stats["speedup_ci"][1]
    temperature, rule, kinds, rows = kind_wins(report)
    assert kinds == ["ngram", "standalone", "suffix"] and [r[0] for r in rows] == ["plain", "repeats"]
    by_category = load_benchmark("report_by_category").rows(report, best=True)  # docs/benchmarks.md's table
    assert [(r[0], r[2]) for r in by_category] == [(c, k) for c in ("plain", "repeats") for k in kinds_in_order(report)]
    paths = write_reports(report, tmp_path / "out")
    markdown = paths["md"].read_text()
    assert "Which kind wins, per category" in markdown and "| repeats |" in markdown


def test_bench_compares_ngram_with_hf_prompt_lookup_and_skips_hf_for_suffix(tmp_path):
    """The HF arm of an n-gram bench is HF's own prompt lookup (gamma tokens per step: the widths it verified say
    so); transformers has no suffix decoding, so that arm is skipped with the reason."""
    from specdec_runtime.bench import run_bench
    from specdec_runtime.loading import load_model
    from specdec_runtime.tiny import build_tiny_model

    target, tokenizer = load_model(str(build_tiny_model("tiny-llama", tmp_path / "tiny")), device="cpu")
    prompts = [tokenizer.encode("a b c a b c a b"), tokenizer.encode("x y x y x y")]
    kwargs = dict(num_draft_tokens=3, max_new_tokens=12, temperature=0.0, batch_size=1, seed=0, repeats=1)
    ngram = run_bench(target, lookup_draft("ngram:max=2,min=1"), tokenizer, prompts, **kwargs)
    assert ngram["settings"]["draft_kind"] == "ngram" and ngram["hf_assisted"]["draft_tokens_per_step"] == 3
    assert ngram["speedup_vs_hf_assisted"] is not None and ngram["speculative"]["new_tokens"] == 24
    suffix = run_bench(target, lookup_draft("suffix"), tokenizer, prompts, **kwargs)
    assert "no suffix decoding" in suffix["hf_assisted"]["skipped"] and suffix["speedup_vs_hf_assisted"] is None


# --------------------------------------------------------------------------------------------------- promotion


@pytest.mark.parametrize("spec", ["ngram:max=3,min=2", "suffix:depth=16,factor=2,prob=0.2,cached=50"])
def test_promoting_a_free_draft_writes_each_engines_lookup_and_exports_nothing(tmp_path, spec):
    """A report recommending a zero-training draft: serving.yaml names it by its spec and knobs, vLLM gets its
    lookup method with our knobs under its names, an engine that cannot serve the kind gets no speculative setting
    and a `not served:` note, and no folder is exported (there are no weights)."""
    import json

    import yaml
    from test_promote import write_report

    from eval.promote import promote

    report_path = write_report(tmp_path)
    report = json.loads(report_path.read_text())
    report["recommendation"].update(name=spec, draft=spec, kind=spec.partition(":")[0])
    report_path.write_text(json.dumps(report))
    serving, export_root = tmp_path / "serving.yaml", tmp_path / "export"
    summary = promote(report_path, serving, export_root=export_root)
    cfg = yaml.safe_load(serving.read_text())
    speculative, vllm = cfg["speculative"], cfg["engines"]["vllm"]["speculative_config"]
    assert spec in summary and speculative["draft"] == spec and speculative["enabled"] is True
    assert speculative["knobs"] == lookup_draft(spec).knobs() and not export_root.exists()
    text = serving.read_text()
    if spec.startswith("ngram"):
        assert speculative["kind"] == "ngram" and vllm["method"] == "ngram"
        assert (vllm["prompt_lookup_max"], vllm["prompt_lookup_min"], vllm["num_speculative_tokens"]) == (3, 2, 4)
        assert cfg["engines"]["trtllm"]["speculative_config"]["decoding_type"] == "NGram"
    else:
        assert speculative["kind"] == "suffix" and vllm["method"] == "suffix"
        assert vllm["suffix_decoding_max_tree_depth"] == 16 and vllm["suffix_decoding_min_token_prob"] == 0.2
        assert vllm["suffix_decoding_max_cached_requests"] == 50
        assert "# not served: SGLang has no suffix decoding" in text and "# not served: TensorRT-LLM" in text
        assert cfg["engines"]["sglang"] == [] and cfg["engines"]["trtllm"] == {}
        assert "cannot serve the measured suffix draft" in speculative["reason"]
    edited = {**report["recommendation"], "draft": "ngram:size=3", "kind": "ngram"}
    report_path.write_text(json.dumps({**report, "recommendation": edited}))
    with pytest.raises(UserError, match="ngram takes max, min"):
        promote(report_path, tmp_path / "other.yaml")
    assert not (tmp_path / "other.yaml").exists()


def test_the_cli_takes_a_free_draft_wherever_a_draft_is_named(tmp_path, capsys):
    """`generate --draft ngram`, `bench --draft suffix:...`; a misspelt knob and a tree with a lookup are one line
    (exit 2) before any model loads."""
    import json

    from specdec_runtime.tiny import build_tiny_model
    from specdistill.cli import main

    folder = str(build_tiny_model("tiny-llama", tmp_path / "tiny"))
    common = ["--target", folder, "--max-new-tokens", "8"]
    assert main(["generate", *common, "--draft", "ngram:max=2,min=1", "--no-chat-template", "a b a b a b"]) == 0
    assert "acceptance_rate=" in capsys.readouterr().err
    bench = ["bench", *common, "--draft", "suffix:prob=0", "--prompts", "builtin:test", "--num-prompts", "2"]
    assert main([*bench, "--repeats", "1", "--json", str(tmp_path / "bench.json")]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["draft"] == "suffix:prob=0" and result["settings"]["draft_kind"] == "suffix"
    capsys.readouterr()
    assert main(["generate", "--target", "no/such-model", "--draft", "ngram:n=3", "hi"]) == 2
    assert "ngram takes max, min" in capsys.readouterr().err
    assert main(["generate", "--target", "no/such-model", "--draft", "suffix", "--tree", "2,2", "hi"]) == 2
    assert "lookup drafts chains" in capsys.readouterr().err


def test_run_with_free_candidates_trains_nothing_and_evaluates_them(tmp_path, monkeypatch):
    """`draft.init: ngram | suffix` candidates: no teacher data and no training, one eval candidate per knob
    setting, the report and serving config written; a recommended lookup exports nothing."""
    import json
    from pathlib import Path

    from specdistill.cli import main

    root = Path(__file__).resolve().parent.parent
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    candidates = (
        "candidates=[{name: ngram, overrides: {draft.init: ngram, draft.lookup_knobs: ['max=2,min=1', '']}}, "
        "{name: suffix, overrides: {draft.init: suffix}}]"
    )
    assert main(["run", str(root / "configs" / "smoke.yaml"), f"output_dir={out}", candidates]) == 0
    assert not (out / "data").exists() and not (out / "candidates").exists()
    report = json.loads((out / "eval" / "report.json").read_text())
    assert [(c["name"], c["kind"], c["draft"]) for c in report["candidates"]] == [
        ("ngram[max=2,min=1]", "ngram", "ngram:max=2,min=1"),
        ("ngram[defaults]", "ngram", "ngram"),
        ("suffix", "suffix", "suffix"),
    ]
    assert (out / "serving.yaml").is_file() and not (out / "export").exists()
    assert main(["run", str(root / "configs" / "smoke.yaml"), f"output_dir={out}", candidates]) == 0  # up to date
