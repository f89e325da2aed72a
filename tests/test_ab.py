"""Paired A/B statistics (specdec_runtime/ab.py): ABBA order, per-token speedup, bootstrap intervals that cover,
costs from in-run phases (exact with an injected clock), per-setting peak memory."""

from __future__ import annotations

import resource
import statistics
import time
from types import SimpleNamespace

import pytest
import torch
from helpers.models import perturbed, tiny_llama

from specdec_runtime.ab import (
    ArmPeaks,
    PeakMemory,
    abba_order,
    bootstrap_ci,
    cost_model,
    decode_s_per_token,
    graph_widths,
    paired_metrics,
    paired_runs,
    paired_speedup,
)
from specdec_runtime.bench import run_bench
from specdec_runtime.engine import generate
from specdec_runtime.llama import Llama, graph_keys, graph_rows
from specdec_runtime.metrics import GenerationStats, Phases, RequestStats


def stats(tokens: list[int], phases: Phases) -> GenerationStats:
    """A call's stats with the given tokens per request and phases (the counters that matter here)."""
    requests = [
        RequestStats(
            new_tokens=n,
            verify_steps=0,
            drafted=0,
            accepted=0,
            position_reached=[],
            position_accepted=[],
            target_forwards=0,
            draft_forwards=0,
            ttft_s=0.1,
            wall_s=1.0,
        )
        for n in tokens
    ]
    return GenerationStats(
        requests, wall_s=1.0 + phases.prefill_s + phases.decode_s, target_forwards=0, draft_forwards=0, phases=phases
    )


def test_abba_order_alternates_and_every_arm_runs_every_unit():
    assert [abba_order("AB", u, r) for r in range(2) for u in range(2)] == [
        list("AB"),
        list("BA"),
        list("BA"),
        list("AB"),
    ]
    calls = []
    runs = paired_runs(lambda u, a, r: calls.append((r, u, a)) or (u, a, r), units=3, arms=("A", "B"), repeats=2)
    assert calls[:4] == [(0, 0, "A"), (0, 0, "B"), (0, 1, "B"), (0, 1, "A")]
    assert runs["A"][2] == [(2, "A", 0), (2, "A", 1)] and len(calls) == 12


def test_speedup_is_per_token_not_wall_time():
    """Speculative decoding that stops earlier (EOS sampled sooner) is not faster per token: speedup 1, where the
    wall-time ratio would say 2."""
    base = stats([21], Phases(verify_s=2.0, verify_forwards=20))  # 20 decode tokens in 2 s
    spec = stats([11], Phases(draft_s=0.4, verify_s=0.6, verify_forwards=5, draft_forwards=10))  # 10 in 1 s
    assert decode_s_per_token([base]) == decode_s_per_token([spec]) == 0.1
    assert paired_speedup([[base]], [[spec]])["speedup"] == pytest.approx(1.0)
    assert base.phases.decode_s / spec.phases.decode_s == 2.0  # the wall-time ratio (finding 4)


def test_speedup_is_the_median_of_paired_unit_ratios():
    base = [[stats([11], Phases(verify_s=t, verify_forwards=10))] for t in (1.0, 2.0, 3.0)]
    spec = [[stats([11], Phases(verify_s=1.0, verify_forwards=4))] for _ in range(3)]
    out = paired_speedup(base, spec)
    assert out["speedup"] == 2.0 and out["units"] == 3
    assert 1.0 <= out["speedup_ci"][0] <= 2.0 <= out["speedup_ci"][1] <= 3.0


def _coverage(interval, trials: int = 300, n: int = 25) -> float:
    """How often `interval` covers the true median (1.5) of lognormal ratios around 1.5, over seeded trials."""
    gen, hits = torch.Generator().manual_seed(1234), 0
    for _ in range(trials):
        ratios = (1.5 * torch.exp(0.2 * torch.randn(n, generator=gen, dtype=torch.float64))).tolist()
        lo, hi = interval(ratios)
        hits += lo <= 1.5 <= hi
    return hits / trials


def test_bootstrap_interval_covers_at_its_level():
    assert bootstrap_ci([1.2, 1.4, 1.3]) == bootstrap_ci([1.2, 1.4, 1.3])  # fixed seed: reproducible
    assert bootstrap_ci([1.3]) == [1.3, 1.3]
    assert 0.88 <= _coverage(bootstrap_ci) <= 0.99

    def without_replacement(values):  # broken: resampling without replacement never varies the median
        med = statistics.median(values)
        return [med, med]

    assert _coverage(without_replacement) < 0.2


def test_efficiency_is_at_most_one_with_per_step_overhead():
    """Per-step overhead outside the forwards: target-only pays it once per token, speculative once per step. With
    the target-only *step* (forward + overhead) as the unit, efficiency = 1 - overhead_fraction <= 1; with the
    forward alone it would come out above 1 (the issue's finding 2)."""
    gamma, tau, steps = 3, 2.5, 40
    base = stats([steps + 1], Phases(verify_s=1.0 * steps, other_s=0.5 * steps, verify_forwards=steps))
    spec_steps = int(steps / tau)
    spec = stats(
        [steps + 1],
        Phases(
            draft_s=0.2 * gamma * spec_steps,
            verify_s=1.3 * spec_steps,
            other_s=0.5 * spec_steps,
            verify_forwards=spec_steps,
            draft_forwards=gamma * spec_steps,
        ),
    )
    costs = cost_model(base, spec)
    assert costs["cost_ratio"] == pytest.approx(0.2 / 1.5) and costs["verify_cost_ratio"] == pytest.approx(1.3 / 1.5)
    assert costs["predicted_speedup"] == pytest.approx(tau * 1.5 / (0.2 * gamma + 1.3))
    assert costs["overhead_fraction"] == pytest.approx(0.5 / (0.2 * gamma + 1.8))
    metrics = paired_metrics([[base]], [[spec]], gamma)
    assert metrics["speedup"] == pytest.approx(tau * 1.5 / (0.2 * gamma + 1.8))
    assert metrics["efficiency"] == pytest.approx(1 - costs["overhead_fraction"]) and metrics["efficiency"] < 1
    forward_only_prediction = tau * 1.0 / (0.2 * gamma + 1.3)  # the micro-benchmark's unit: a bare forward
    assert metrics["speedup"] / forward_only_prediction > 1.1


class FakeClock:
    """Time that moves only inside forwards: target forwards cost 1 + 0.25 per extra token, draft forwards 0.2."""

    def __init__(self, target, draft):
        self.now = 0.0
        self.handles = [
            target.register_forward_pre_hook(self._advance(1.0, 0.25), with_kwargs=True),
            draft.register_forward_pre_hook(self._advance(0.2, 0.0), with_kwargs=True),
        ]

    def _advance(self, base: float, per_token: float):
        def hook(module, args, kwargs):
            self.now += base + per_token * (kwargs["input_ids"].shape[1] - 1)

        return hook

    def __call__(self) -> float:
        return self.now


def test_costs_from_in_run_phases_are_exact_with_an_injected_clock():
    target, gamma = tiny_llama(seed=0), 3
    draft = perturbed(target, 0.003, seed=1)  # accepts some drafts, rejects others
    clock = FakeClock(target, draft)
    prompt = [[5, 17, 3, 40, 22, 9]]
    kwargs = dict(num_draft_tokens=gamma, max_new_tokens=25, clock=clock)
    base = generate(target, None, prompt, **kwargs).stats
    spec = generate(target, draft, prompt, **kwargs).stats
    assert base.phases.verify_forwards == 24 and base.phases.other_s == pytest.approx(0, abs=1e-9)
    assert 1.5 < spec.aggregate()["mean_accepted_length"] < gamma + 1 and spec.phases.other_s == pytest.approx(
        0, abs=1e-9
    )
    metrics = paired_metrics([[base]], [[spec]], gamma)
    assert metrics["cost_ratio"] == pytest.approx(0.2) and metrics["verify_cost_ratio"] == pytest.approx(1.75)
    steps = spec.phases.verify_forwards
    assert metrics["predicted_speedup"] == pytest.approx(24 / steps / (gamma * 0.2 + 1.75))
    assert metrics["speedup"] == pytest.approx(metrics["predicted_speedup"])
    assert metrics["efficiency"] == pytest.approx(1.0) and metrics["overhead_fraction"] == pytest.approx(0, abs=1e-9)
    for handle in clock.handles:
        handle.remove()


def test_peak_memory_is_per_block_on_cpu():
    """RSS sampled during the block: a block that allocates nothing does not inherit an earlier block's peak,
    which the process-lifetime ru_maxrss would report."""
    with PeakMemory("cpu") as big:
        x = torch.ones(160 * 2**20 // 4)  # 160 MiB, touched
        time.sleep(0.1)
    del x
    time.sleep(0.05)
    with PeakMemory("cpu") as small:
        time.sleep(0.05)
    assert big.bytes - small.bytes > 100 * 2**20
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 >= big.bytes - 2**20  # what ru_maxrss says


def test_warm_up_captures_every_graph_a_timed_run_replays(monkeypatch):
    """Every (width, rows) CUDA graph key a timed call of `bench` asks `Llama.step` for was captured by the warm-up's
    `capture_graphs`: the draft's refeed width 2, a short unit's 2-token prefill, tree widths, and the row buckets a
    shrinking batch passes through. Checked on the CPU by recording the keys (capture is a no-op there)."""
    events: list[tuple] = []
    step, capture = Llama.step, Llama.capture_graphs

    def recording_step(self, tokens, *args):
        events.append(("step", id(self), (tokens.shape[1], graph_rows(tokens.shape[0], self.cache_shape[0]))))
        return step(self, tokens, *args)

    def recording_capture(self, widths, max_rows):
        events.append(("capture", id(self), graph_keys(widths, max_rows, self.cache_shape[0])))
        return capture(self, widths, max_rows)

    monkeypatch.setattr(Llama, "step", recording_step)
    monkeypatch.setattr(Llama, "capture_graphs", recording_capture)
    target = tiny_llama(seed=0)
    draft = perturbed(target, 0.003, seed=1)  # accepts most drafts: full acceptance refeeds 2 tokens
    prompts = [[5, 17, 3, 40, 22, 9], [11, 4, 8], [60, 2, 33], [7, 7, 7, 7], [11], [4, 9], [3], [8, 8]]
    run_bench(
        target,
        draft,
        SimpleNamespace(eos_token_id=None, pad_token_id=0),
        prompts,
        num_draft_tokens=3,
        max_new_tokens=16,
        temperature=1.0,
        draft_rule="sample",
        batch_size=4,
        seed=0,
        repeats=2,
        tree="2,2",
    )
    last = max(i for i, e in enumerate(events) if e[0] == "capture")
    planned: dict[int, set] = {}
    for kind, model, keys in events[: last + 1]:
        if kind == "capture":
            planned.setdefault(model, set()).update(keys)
    timed: dict[int, set] = {}
    for _, model, key in events[last + 1 :]:
        timed.setdefault(model, set()).add(key)
    assert len(timed) == 2 and set(timed) <= set(planned)  # target and draft, both warmed
    for model, keys in timed.items():
        assert keys <= planned[model], keys - planned[model]
    hit = set().union(*timed.values())
    assert {(2, 1), (2, 2), (2, 4), (1, 1), (1, 2), (4, 4)} <= hit  # refeed / short prefill, shrinking rows, gamma + 1
    # the same check rejects a warm-up that forgets width 2 (the refeed) or the smaller row buckets
    no_refeed = {m: {k for k in keys if k[0] != 2} for m, keys in planned.items()}
    assert any(not keys <= no_refeed[m] for m, keys in timed.items())
    full_batch_only = {m: {k for k in keys if k[1] == 4} for m, keys in planned.items()}
    assert any(not keys <= full_batch_only[m] for m, keys in timed.items())


def test_graph_widths_cover_chain_tree_and_target_only_steps():
    assert graph_widths(3) == ({1, 2, 4}, {1, 2})
    assert graph_widths(3, "2,2") == ({1, 2, 7}, {1, 2})  # the draft forwards level 1 (2 nodes); 6 nodes + root
    assert graph_widths(2, "4,2,2,1") == ({1, 2, 45}, {1, 2, 4, 8, 16})
    assert graph_keys({1, 4}, 5, 8) == {(1, 1), (1, 2), (1, 4), (1, 8), (4, 1), (4, 2), (4, 4), (4, 8)}
    assert graph_keys({1}, 5, 5) == {(1, 1), (1, 2), (1, 4), (1, 5)}  # capped at the cache's rows


def test_each_arm_gets_its_own_peak_memory():
    """`ArmPeaks` keeps each arm's peak apart: an arm that allocates 160 MiB does not lend it to the other arm."""

    def run(unit, arm, repeat):
        if arm == "speculative":
            x = torch.ones(160 * 2**20 // 4)  # touched
            time.sleep(0.05)
            del x
        else:
            time.sleep(0.02)
        return arm

    peaks = ArmPeaks(run, "cpu")
    runs = paired_runs(peaks, units=2, arms=("target_only", "speculative"), repeats=2)
    assert runs["speculative"][1] == ["speculative", "speculative"]
    assert set(peaks.bytes) == {"target_only", "speculative"}
    assert peaks.bytes["speculative"] - peaks.bytes["target_only"] > 100 * 2**20
