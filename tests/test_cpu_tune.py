"""Layouts of the CPU fast path chosen by timing (specdec_runtime/cpu_tune.py, issue 28): the cheapest layout per
(shape, rows) under injected costs, with broken planners the same check rejects; the per-machine plan cache; greedy
identity with HF under every layout forced on every linear; only the chosen layouts kept; the bandwidth probe, the
weight-streaming floor and the bench JSON's machine block."""

import json
import zlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers.models import LLAMA_PROMPTS, hf_greedy, perturbed, tiny_llama

import specdec_runtime.cpu_tune as cpu_tune
from specdec_runtime.backends import BackendOptions, fast_model, plan_rows
from specdec_runtime.bench import run_bench
from specdec_runtime.cpu import cpu_eagle3, cpu_model, draft_dtype
from specdec_runtime.cpu_tune import (
    FusedLinear,
    Planner,
    WeightSet,
    candidates,
    decode_floor_s,
    layout_summary,
    machine_info,
    machine_key,
    parse_cpuinfo,
    plan_path,
    probe_bandwidth,
    row_table,
    weight_bytes_per_step,
)
from specdec_runtime.eagle3 import Eagle3Draft
from specdec_runtime.engine import generate

# Tiny models: intra-op thread wake-ups cost more than the maths; every plan goes to a cache of the test's own.
pytestmark = pytest.mark.usefixtures("one_thread", "isolated_cache")

ROWS = (1, 2, 3, 8)
SHAPES = [("qkv", 96, 32, 2), ("down_proj", 32, 64, 2), ("lm_head", 64, 32, 1)]  # name, N, K, weights
LINES = [(1.0, 1.0), (2.2, 0.5), (3.5, 0.2)]
"""Fake cost lines (fixed, per row) dealt to the fp32 layouts per shape: the first wins at 1-2 rows, the second at
3, the third at 8 (no ties at ROWS)."""


def line_cost(key: str, layout: str, rows: int) -> float:
    """Chosen costs: each shape deals the lines to the layouts in its own order (crc32: stable across processes)."""
    order = sorted(candidates(torch.float32), key=lambda name: zlib.crc32(f"{key}/{name}".encode()))
    fixed, per_row = LINES[order.index(layout)]
    return fixed + per_row * rows


class FakeTimer:
    """A `cpu_tune.Timer` that runs nothing: `cost(key, layout, rows)`, except that the second repetition of the
    cheapest layout reads 100x (an outlier a mean would fall for; the median must not)."""

    def __init__(self, cost=line_cost):
        self.cost, self.calls, self.seen = cost, 0, {}

    def __call__(self, key, layout, rows, run) -> float:
        self.calls += 1
        rep = self.seen[(key, layout, rows)] = self.seen.get((key, layout, rows), 0) + 1
        best = min(candidates(torch.float32), key=lambda name: self.cost(key, name, rows))
        return self.cost(key, layout, rows) * (100 if rep == 2 and layout == best else 1)


def kn_then_packed(key, layout, rows) -> float:
    """Shape-blind costs: (K, N) fastest up to 2 rows, packed above, row-major never."""
    return {"kn": float(rows), "packed": 2.5}.get(layout, 10.0)


def weight_sets() -> list[WeightSet]:
    gen = torch.Generator().manual_seed(0)
    return [
        WeightSet(name, [torch.randn(n, k, generator=gen) for _ in range(count)], [None] * count, torch.float32)
        for name, n, k, count in SHAPES
    ]


def assert_cheapest(plans: dict[str, dict[int, str]], sets: list[WeightSet]) -> None:
    for ws in sets:
        for rows in ROWS:
            want = min(candidates(ws.dtype), key=lambda layout: line_cost(ws.key, layout, rows))
            assert plans[ws.name][rows] == want, (ws.name, rows)


# ------------------------------------------------------------------------------------------------- the selection


def test_the_plan_takes_the_cheapest_layout_per_shape_and_rows_and_broken_planners_fail(monkeypatch):
    monkeypatch.setattr(cpu_tune, "RULE_MARGIN", 0.0)  # the cheapest, strictly (near ties: the test below)
    sets = weight_sets()
    timer = FakeTimer()
    planner = Planner("tune", ROWS, timer)
    plans = {ws.name: planner.choose(ws) for ws in sets}
    assert_cheapest(plans, sets)
    passes = len(SHAPES) * len(ROWS) * 3  # 3 fp32 layouts: each timed once, the close calls again
    assert passes < timer.calls < passes * cpu_tune.TUNE_REPS
    assert len({tuple(p.values()) for p in plans.values()}) > 1  # the winners differ between shapes ...
    assert all(len(set(p.values())) > 1 for p in plans.values())  # ... and with the rows: the check can see both

    def broken(plan_once):
        with monkeypatch.context() as m:
            plan_once(m)
            planner = Planner("tune", ROWS, FakeTimer())
            return {ws.name: planner.choose(ws) for ws in sets}

    slowest = broken(lambda m: m.setattr(cpu_tune, "cheapest", lambda s: max(s, key=lambda k: min(s[k]))))
    real_tune = cpu_tune.tune
    one_row = broken(  # times the first row count only and applies its winner to all
        lambda m: m.setattr(
            cpu_tune, "tune", lambda ws, rows, timer: dict.fromkeys(rows, real_tune(ws, rows[:1], timer)[rows[0]])
        )
    )
    mean = broken(lambda m: m.setattr(cpu_tune, "cheapest", lambda s: min(s, key=lambda k: sum(s[k]))))
    for plans in (slowest, one_row, mean):
        with pytest.raises(AssertionError):
            assert_cheapest(plans, sets)


def test_unplanned_row_counts_take_the_nearest_planned_ones_layout():
    assert row_table({1: "kn", 8: "packed"}) == ("kn",) * 4 + ("packed",) * 4
    assert row_table({2: "kn", 6: "nk"})[3] == "nk"  # 4 rows: a tie, the larger wins
    linear = FusedLinear(torch.randn(6, 4), None, torch.float32, {1: "kn", 8: "packed"}, "x")
    assert [linear.layout(r) for r in (1, 4, 5, 8, 300)] == ["kn", "kn", "packed", "packed", "packed"]


def test_cpu_model_lays_out_every_shape_as_planned():
    hf = tiny_llama(0)
    model = cpu_model(hf, layouts="tune", rows=ROWS, timer=FakeTimer(kn_then_packed))
    summary = layout_summary(model)
    assert list(summary) == ["qkv", "o_proj", "gate_up", "down_proj", "lm_head"]
    assert all(plan == {1: "kn", 2: "kn", 3: "packed", 8: "packed"} for plan in summary.values())
    assert model.cpu_tuning["layouts"] == "tune" and len(model.cpu_tuning["timed_shapes"]) == 5
    qkv = model.layers[1].self_attn.qkv
    assert (qkv.layout(1), qkv.layout(5)) == ("kn", "packed")


def test_the_rule_is_the_fixed_rule_and_times_nothing(isolated_cache):
    timer = FakeTimer()
    summary = layout_summary(cpu_model(tiny_llama(0), layouts="rule", rows=(1, 4, 5, 32), timer=timer))
    assert summary["qkv"] == {1: "kn", 4: "kn", 5: "packed", 32: "packed"}
    assert summary["lm_head"] == dict.fromkeys((1, 4, 5, 32), "packed")  # the head: packed only
    assert timer.calls == 0 and not (isolated_cache / "cpu-plans").exists()


# -------------------------------------------------------------------------------------------------------- the cache


def test_the_plan_is_cached_per_machine(monkeypatch, isolated_cache):
    hf = tiny_llama(0)
    first = FakeTimer(kn_then_packed)
    summary = layout_summary(cpu_model(hf, rows=ROWS, timer=first))  # "auto"
    assert first.calls > 0 and plan_path(machine_key()).is_relative_to(isolated_cache)
    stored = json.loads(plan_path(machine_key()).read_text())
    assert stored["machine"] == machine_key() and len(stored["shapes"]) == 5

    again = FakeTimer(kn_then_packed)
    model = cpu_model(hf, rows=ROWS, timer=again)
    assert again.calls == 0 and layout_summary(model) == summary and model.cpu_tuning["tune_s"] == 0

    more = FakeTimer(kn_then_packed)  # new row counts: only they are timed
    cpu_model(hf, rows=(*ROWS, 16), timer=more)
    assert more.calls == 5 * (3 + cpu_tune.TUNE_REPS - 1)  # 16 rows, 5 shapes: packed alone is timed again

    retune = FakeTimer(kn_then_packed)
    cpu_model(hf, layouts="tune", rows=ROWS, timer=retune)
    assert retune.calls == first.calls

    monkeypatch.setattr(cpu_tune, "cpu_identity", lambda: ("Another CPU", ("avx2", "fma"), 64))
    elsewhere = FakeTimer(kn_then_packed)
    cpu_model(hf, rows=ROWS, timer=elsewhere)
    assert elsewhere.calls == first.calls  # another machine: its own plan, timed afresh


def test_a_damaged_plan_file_is_timed_again(isolated_cache):
    hf = tiny_llama(0)
    cpu_model(hf, rows=ROWS, timer=FakeTimer(kn_then_packed))
    plan_path(machine_key()).write_text("{not json")
    timer = FakeTimer(kn_then_packed)
    cpu_model(hf, rows=ROWS, timer=timer)
    assert timer.calls > 0 and json.loads(plan_path(machine_key()).read_text())["shapes"]


# ------------------------------------------------------------------------------------------ identity, memory, options


@pytest.fixture
def two_threads():
    """Two intra-op threads: `split` lays a weight out in one slab per thread (one slab would be `kn` again)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("slabs", [1, 2, 3])
@pytest.mark.parametrize("n_out", [96, 97])
def test_the_split_layout_computes_the_linear_for_any_slab_count(slabs, n_out):
    gen = torch.Generator().manual_seed(0)
    weight, bias, x = (torch.randn(*shape, generator=gen) for shape in ((n_out, 32), (n_out,), (5, 32)))
    w = cpu_tune.split_kn(weight, slabs)
    assert w.shape == (slabs, 32, -(-n_out // slabs))  # the last slab padded with zero columns
    for b in (None, bias):
        torch.testing.assert_close(cpu_tune.run_layout("split", x, w, b, n_out), F.linear(x, weight, b))
        torch.testing.assert_close(cpu_tune.run_layout("split", x[:1], w, b, n_out), F.linear(x[:1], weight, b))


def test_split_is_timed_only_with_more_than_one_thread(two_threads):
    assert "split" in candidates(torch.float32) and "split" in candidates(torch.bfloat16)
    torch.set_num_threads(1)
    assert "split" not in candidates(torch.float32) and "split" in cpu_tune.allowed(torch.float32)


@pytest.mark.parametrize("layout", ["kn", "packed", "nk", "split", "rule", "auto"])
def test_every_layout_on_every_linear_keeps_hf_greedy_output(layout, request):
    if layout == "split":
        request.getfixturevalue("two_threads")  # two slabs
    target, near = tiny_llama(0), perturbed(tiny_llama(0), 0.004, seed=2)
    reference = hf_greedy(target, LLAMA_PROMPTS, 16)
    fast = cpu_model(target, layouts=layout)
    if layout in cpu_tune.LAYOUTS:
        assert all(set(plan.values()) == {layout} for plan in layout_summary(fast).values())
    assert generate(fast, None, LLAMA_PROMPTS, max_new_tokens=16).tokens == reference
    for draft in (cpu_model(near, layouts=layout), cpu_model(near, draft_dtype(), layouts="rule")):
        result = generate(fast, draft, LLAMA_PROMPTS, num_draft_tokens=3, max_new_tokens=16)  # verify: 4-16 rows
        assert result.tokens == reference


def test_a_bf16_draft_may_take_bf16_weights_and_a_target_may_not():
    target, near = tiny_llama(0), perturbed(tiny_llama(0), 0.004, seed=2)
    bf16 = "packed_bf16" if cpu_tune.bf16_native() else "kn_bf16"
    assert bf16 in candidates(torch.bfloat16) and bf16 not in candidates(torch.float32)
    with pytest.raises(ValueError, match="use 'auto'.*kn, packed, nk"):
        cpu_model(target, layouts=bf16)
    draft = cpu_model(near, torch.bfloat16, layouts=bf16)
    assert draft.lm_head.weight.dtype == torch.bfloat16 and draft.lm_head.w_kn is None
    reference = hf_greedy(target, LLAMA_PROMPTS, 16)
    assert generate(cpu_model(target), draft, LLAMA_PROMPTS, num_draft_tokens=3, max_new_tokens=16).tokens == reference


@pytest.mark.parametrize("layout", ["kn", "packed", "nk", "split", "rule"])
def test_every_layout_of_an_eagle3_head_computes_what_the_head_computes(layout, request):
    if layout == "split":
        request.getfixturevalue("two_threads")
    target = tiny_llama(seed=1, layers=6)
    head = Eagle3Draft.from_target(target, torch.arange(0, 64, 2), seed=0).eval()
    H = target.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    hidden, embeds = torch.randn(2, 5, 3 * H, generator=gen), torch.randn(2, 5, H, generator=gen)
    positions = torch.arange(5).expand(2, 5)
    fast = cpu_eagle3(head, torch.float32, layouts=layout)
    assert len(layout_summary(fast)) == 9 and "midlayer.self_attn.q_proj" in layout_summary(fast)
    with torch.no_grad():
        for got, want in zip(fast(hidden, embeds, positions), head(hidden, embeds, positions)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _kept(model) -> dict[str, int]:
    """Bytes per layout kept over the model's `FusedLinear`s."""
    kept = {}
    for m in model.modules():
        if isinstance(m, FusedLinear):
            for layout in cpu_tune.LAYOUTS:
                w = getattr(m, f"w_{layout}")
                kept[layout] = kept.get(layout, 0) + (0 if w is None else w.numel() * w.element_size())
    return {layout: size for layout, size in kept.items() if size}


def test_only_the_chosen_layouts_are_kept():
    hf = tiny_llama(0)
    one = cpu_model(hf, layouts="nk")
    assert set(_kept(one)) == {"nk"} and _kept(one)["nk"] == weight_bytes_per_step(one)  # one copy of each weight
    two = cpu_model(hf, layouts="tune", rows=ROWS, timer=FakeTimer(kn_then_packed))
    assert set(_kept(two)) == {"kn", "packed"}
    packed_only = cpu_model(hf, layouts="tune", rows=(3, 8), timer=FakeTimer(kn_then_packed))
    assert set(_kept(packed_only)) == {"packed"} and packed_only.layers[0].mlp.gate_up.layout(1) == "packed"


def test_backend_options_choose_the_layouts():
    hf = tiny_llama(0)
    rule = fast_model(hf, BackendOptions(cpu_layouts="rule", cpu_layout_rows=(8, 1)))
    assert layout_summary(rule)["qkv"] == {1: "kn", 8: "packed"}
    with pytest.raises(ValueError, match="cpu_layouts='fastest': use one of auto, tune, rule"):
        BackendOptions(cpu_layouts="fastest")
    with pytest.raises(ValueError, match="positive integers"):
        BackendOptions(cpu_layout_rows=(0, 4))
    assert plan_rows(BackendOptions(cpu_layout_rows=(1,)), 4, {1, 5}).cpu_layout_rows == (1, 4, 5, 20)


# ----------------------------------------------------------------------------------------- the machine and the floor


def test_cpuinfo_gives_the_model_name_and_the_gemm_flags():
    text = "processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_tile\n\n"
    text += "processor\t: 1\nmodel name\t: Some Xeon\nflags\t\t: fpu\n"
    assert parse_cpuinfo(text) == ("Some Xeon", ["amx_tile", "avx2", "avx512_bf16", "avx512f", "fma"])


def test_machine_info_probes_the_bandwidth_once_per_machine(monkeypatch):
    assert probe_bandwidth(seconds=0.01, megabytes=4) > 0
    probes = []
    monkeypatch.setattr(cpu_tune, "probe_bandwidth", lambda: probes.append(1) or 12.5)
    assert machine_info(probe=False)["bandwidth_gb_s"] is None
    info = machine_info()
    assert set(info) == {"cpu", "flags", "cores", "torch_threads", "torch", "bandwidth_gb_s"}
    assert info["bandwidth_gb_s"] == 12.5 and info["torch_threads"] == 1 and json.loads(json.dumps(info)) == info
    assert machine_info()["bandwidth_gb_s"] == 12.5 and len(probes) == 1  # cached with the plan


def test_the_floor_is_the_weight_bytes_of_a_step_over_the_bandwidth():
    hf = tiny_llama(0)
    fp32 = sum(p.numel() * 4 for name, p in hf.named_parameters() if "proj" in name) + hf.lm_head.weight.numel() * 4
    assert weight_bytes_per_step(hf) == weight_bytes_per_step(cpu_model(hf)) == fp32
    assert decode_floor_s(cpu_model(hf), 10.0) == pytest.approx(fp32 / 10e9)
    bf16 = "packed_bf16" if cpu_tune.bf16_native() else "kn_bf16"
    assert weight_bytes_per_step(cpu_model(hf, torch.bfloat16, layouts=bf16)) == fp32 // 2  # reads half the bytes


def test_the_bench_json_records_the_machine_and_the_floor(monkeypatch):
    monkeypatch.setattr(cpu_tune, "probe_bandwidth", lambda: 10.0)
    target = tiny_llama(0)
    result = run_bench(target, perturbed(target, 0.004, seed=2), SimpleNamespace(eos_token_id=None, pad_token_id=0),
                       LLAMA_PROMPTS[:2], num_draft_tokens=10, max_new_tokens=6, temperature=0.0, batch_size=1,
                       seed=0, repeats=1)  # fmt: skip
    machine = result["machine"]
    assert machine["bandwidth_gb_s"] == 10.0 and machine["cpu"] and machine["cores"] >= 1
    assert machine["decode_floor_s"] == pytest.approx(decode_floor_s(cpu_model(target), 10.0))
    assert machine["decode_step_over_floor"] == pytest.approx(machine["decode_step_s"] / machine["decode_floor_s"])
    assert set(machine["layouts"]["target"]) == {"qkv", "o_proj", "gate_up", "down_proj", "lm_head"}
    assert 11 in machine["layouts"]["target"]["qkv"]  # planned for the run's verify width, gamma + 1
    json.dumps(result)


def test_a_near_tie_keeps_the_rules_layout_and_a_clear_win_replaces_it():
    """Timed alone, layouts within RULE_MARGIN swap places from run to run (and a near tie lost in the loop): the
    fixed rule's layout keeps them; a layout clearly faster replaces it. Plain `cheapest` fails the first half."""
    from specdec_runtime.cpu_tune import RULE_MARGIN, cheapest, keep_rule

    near = {"kn": [1.0, 1.0, 1.0], "packed": [1.0 + RULE_MARGIN / 2] * 3, "nk": [3.0]}
    clear = {"kn": [1.0, 1.0, 1.0], "packed": [1.0 + 2 * RULE_MARGIN] * 3, "nk": [3.0]}
    for choose in (keep_rule, lambda samples, rule: cheapest(samples)):
        picks = (choose(near, "packed"), choose(clear, "packed"))
        assert (picks == ("packed", "kn")) == (choose is keep_rule)
