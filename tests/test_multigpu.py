"""The multi-GPU defects of issue 11 that reproduce on 2 CPU processes (torchrun, gloo), plus their single-process
unit tests. Two ranks cannot share one GPU under NCCL, so the multi-rank paths are exercised here over gloo.

One torchrun launch (module fixture) runs every 2-process check and writes one JSON file per rank; each test reads
its check. A check is "ok", or the error it raised, so one failing check does not hide the others:

- teacher: a model loaded under `ACCELERATE_USE_FSDP=true FSDP_CPU_RAM_EFFICIENT_LOADING=true` (fsdp.yaml's
  environment) has rank 0's logits on every rank. The probe model keeps a non-persistent buffer that transformers
  zero-fills on local ranks > 0 in that environment (its "broadcast receiver" path), so the check fails without
  `own_weights_loading`.
- lora: a LoRA student sharded with FSDP2 saves a merged best/ (rank 0 merges a CPU copy built from the gathered
  state; merging the sharded module on one rank hangs), and its adapter checkpoint holds the unsharded adapters.
- grad_norm: the norm the loop logs from a sharded student is the unsharded student's, and a non-finite gradient on
  one rank is non-finite on both.
- nested: a teacher whose `_no_split_modules` nest is sharded children first and computes the full model's logits.
- timeout: the process group created by the CLI's `dist_state` has train.timeout_minutes as its timeout.
- given_sharded: `distill()` refuses a given teacher it would shard (a second full copy), and `shards_teacher`
  (what the pipeline asks before handing its target over) agrees with the recipe.
- run_frees: `specdistill run` with a sharded teacher holds no target of its own while the candidates train (each
  loads its own, on the CPU to shard it), and loads the target again for eval.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch
from helpers.runs import TESTS, train_config

CHECKS = r'''
import copy, json, os, sys, traceback
from pathlib import Path
import torch
import torch.distributed as dist
sys.path.insert(0, TESTS)
from helpers.models import tiny_llama

out = Path(OUT)
from specdistill.pipeline import dist_state

state = dist_state("cpu", timeout_minutes=7)  # creates the process group, as the CLI does
rank = dist.get_rank()
results = {}


def check(name):
    def run(fn):
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()[-3000:]
        dist.barrier()
    return run


def same_on_every_rank(t):
    every = [torch.zeros_like(t) for _ in range(2)]
    dist.all_gather(every, t.contiguous())
    return all(torch.equal(every[0], x) for x in every)


@check("timeout")
def _():
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert backend.options._timeout.total_seconds() == 7 * 60, backend.options._timeout


@check("teacher")
def _():
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from specdec_runtime.loading import load_checkpoint, load_model

    class ProbeConfig(LlamaConfig):
        model_type = "probe_llama"

    class ProbeForCausalLM(LlamaForCausalLM):
        """A Llama whose logits are scaled by a non-persistent buffer that only _init_weights sets."""
        config_class = ProbeConfig

        def __init__(self, config):
            super().__init__(config)
            self.register_buffer("logit_scale", torch.ones(()), persistent=False)

        def _init_weights(self, module):
            super()._init_weights(module)
            if module is self:
                self.logit_scale.fill_(1.0)

        def forward(self, *args, **kwargs):
            result = super().forward(*args, **kwargs)
            result.logits = result.logits * self.logit_scale
            return result

    AutoConfig.register("probe_llama", ProbeConfig)
    AutoModelForCausalLM.register(ProbeConfig, ProbeForCausalLM)
    folder = out / "probe"
    if rank == 0:
        torch.manual_seed(0)
        shape = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, num_hidden_layers=2)
        ProbeForCausalLM(ProbeConfig(vocab_size=64, hidden_size=32, **shape)).save_pretrained(folder)
        from specdec_runtime.loading import load_tokenizer
        load_tokenizer("random:tiny-llama").save_pretrained(folder)
    dist.barrier()
    os.environ |= {"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}
    try:
        loaded = [load_model(str(folder), device="cpu")[0], load_checkpoint(folder)[0]]  # target / eval's drafts
        assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"  # back for accelerate's student preparation
    finally:
        for key in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING"):
            os.environ.pop(key)
    ids = torch.arange(3, 19)[None]
    for model in loaded:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        same = same_on_every_rank(logits)  # every rank takes part before any asserts
        assert float(logits.abs().max()) > 0, f"rank {rank}: zero logits (a zero-filled buffer)"
        assert same, f"rank {rank}: logits differ between the ranks"


def shard(model, layers):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    for layer in layers:  # as accelerate's TRANSFORMER_BASED_WRAP: each decoder layer, then the root
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full_state(model):
    """accelerate's get_state_dict under FSDP2: the full state on rank 0's CPU, a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


@check("lora")
def _():
    import functools
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    from distill.students import DraftConfig, build_student, merge_student
    from specdec_runtime.loading import load_checkpoint, load_tokenizer
    from train import checkpoint, distributed

    teacher = tiny_llama(vocab_size=64, layers=3)
    student = build_student(teacher, DraftConfig(init="truncate", num_layers=2, lora=True, lora_r=4)).float()
    with torch.no_grad():  # LoRA's B starts at zero: give the adapters something to merge
        gen = torch.Generator().manual_seed(1)
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    want = merge_student(student).state_dict()
    want_adapters = {k: v.clone() for k, v in get_peft_model_state_dict(student).items()}
    shard(student, student.get_base_model().model.layers)

    state = full_state(student)
    tokenizer = load_tokenizer("random:tiny-llama")
    if rank == 0:
        model, state_dict = distributed.best_model(student, state)
        checkpoint.save_best(out / "best", functools.partial(checkpoint.write_model, model=model,
                             state_dict=state_dict, tokenizer=tokenizer), {"step": 1})
        step = out / "step"  # a step checkpoint's model files: the unmerged adapters
        checkpoint.write_model(step, model=student, state_dict=state, tokenizer=tokenizer)
    dist.barrier()
    best, _, merged = load_checkpoint(out / "best")
    assert not merged, "best/ must hold the merged model"
    got = best.state_dict()
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())[:4]
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6, msg=key)
    adapters = load_file(out / "step" / "adapter_model.safetensors")
    assert adapters.keys() == want_adapters.keys(), sorted(adapters.keys() ^ want_adapters.keys())[:4]
    for key, value in want_adapters.items():
        torch.testing.assert_close(adapters[key], value, rtol=0, atol=0, msg=key)


@check("grad_norm")
def _():
    from torch.distributed.tensor import DTensor

    from train.distributed import global_norm

    model = tiny_llama(vocab_size=64, layers=2).train()
    reference = copy.deepcopy(model)
    shard(model, model.model.layers)
    batches = [torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(r)) for r in range(2)]
    model(input_ids=batches[rank], labels=batches[rank]).loss.backward()
    for ids in batches:  # FSDP averages the ranks' gradients
        (reference(input_ids=ids, labels=ids).loss / 2).backward()

    # Every collective first, on every rank; the asserts after.
    total = global_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))  # accelerate's call
    want = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")))
    weight = model.model.layers[0].mlp.up_proj.weight
    share = weight.grad.norm()  # a DTensor with a _NormPartial placement: float() is this rank's share of it
    one, local = global_norm(share), float(share.to_local())
    full = float(reference.model.layers[0].mlp.up_proj.weight.grad.norm())
    if rank == 1:  # a non-finite gradient on one rank only
        weight.grad.to_local().view(-1)[0] = float("inf")
    flag = torch.tensor([float(torch.isfinite(torch.tensor(global_norm(weight.grad.norm()))))])
    agree = same_on_every_rank(flag)

    assert abs(total - want) < 1e-5 * want, (total, want)
    assert isinstance(share, DTensor) and abs(one - full) < 1e-5 * full, (one, full)
    assert abs(local - full) > 1e-3 * full  # the local share differs: the check can fail
    assert agree and flag.item() == 0.0, f"rank {rank} sees a finite norm: the ranks disagree"


@check("nested")
def _():
    from distill.objectives import teacher_forward
    from train.distributed import shard_teacher

    teacher = tiny_llama(vocab_size=64, layers=2)
    teacher._no_split_modules = ["LlamaDecoderLayer", "LlamaMLP"]  # an MLP unit inside each layer unit
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    want = teacher_forward(teacher, batch).clone()
    shard_teacher(teacher, torch.device("cpu"), 2)
    torch.testing.assert_close(teacher_forward(teacher, batch), want, rtol=0, atol=1e-6)


@check("given_sharded")
def _():
    from helpers.runs import train_config
    from specdistill.pipeline import candidate_run
    from train.loop import DistillRecipe, shards_teacher

    run = candidate_run(train_config(out / "given", "train.shard_teacher=always"), "draft")
    recipe = DistillRecipe(run)
    recipe._setup_accelerator()
    assert recipe.shard and shards_teacher(run)  # the pipeline's forecast is the recipe's decision
    assert not shards_teacher(candidate_run(train_config(out / "given", "train.shard_teacher=auto"), "draft"))
    try:
        recipe._setup_teacher(tiny_llama(vocab_size=64, layers=2), None)
    except ValueError as e:
        assert "pass teacher=None" in str(e), e
    else:
        raise AssertionError("a full teacher was accepted for sharding")


@check("run_frees")
def _():
    import gc, weakref
    import specdec_runtime.loading, train.loop
    from specdistill.config import load_config
    from specdistill.pipeline import run_all

    real_load, real_distill, loads, during = specdec_runtime.loading.load_model, train.loop.distill, [], []

    def counted(spec, **kwargs):
        model, tokenizer = real_load(spec, **kwargs)
        loads.append((spec, weakref.ref(model)))
        return model, tokenizer

    def watched(run, data, *, teacher=None, tokenizer=None):
        gc.collect()
        during.append((run.name, teacher is None, loads[0][1]() is None))  # run's first load: its target
        return real_distill(run, data, teacher=teacher, tokenizer=tokenizer)

    smoke = Path(TESTS).parent / "configs" / "smoke.yaml"
    tiny = ["data.max_prompts=4", "data.max_validation_prompts=2", "data.max_new_tokens=4", "train.max_steps=1",
            "train.batch_size=1", "eval.max_prompts=4", "eval.num_draft_tokens=[1]", "eval.temperatures=[0.0]",
            "eval.draft_rules=[greedy]", "eval.max_new_tokens=4", "eval.repeats=1", "eval.warmup=0", "tracking=none",
            "target.device=cpu", "train.shard_teacher=always",
            "candidates=[{name: fkl}, {name: tv-cache, overrides: {distill.teacher: cache}}]"]
    specdec_runtime.loading.load_model = train.loop.load_model = counted
    train.loop.distill = watched
    try:
        result = run_all(load_config(smoke, [f"output_dir={out / 'run'}", *tiny]))
    finally:
        specdec_runtime.loading.load_model = train.loop.load_model = real_load
        train.loop.distill = real_distill
    assert result["report"].is_file()
    # The sharded fkl loads its own on the CPU, and so does tv-cache once the target is freed; eval loads it again.
    assert during == [("fkl", True, True), ("tv-cache", True, True)], during
    assert [spec for spec, _ in loads].count("random:tiny-llama") == 4, loads


(out / f"rank{rank}.json").write_text(json.dumps(results))
import gc
gc.collect()  # the checks' sharded modules (cycles) freed before their process group: see test_train_multiproc.py
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list[str]]:
    """{check: [rank 0's result, rank 1's result]} of one 2-process gloo launch of CHECKS."""
    out = tmp_path_factory.mktemp("multigpu")
    script = out / "checks.py"
    script.write_text(f"TESTS = {str(TESTS)!r}\nOUT = {str(out)!r}\n" + textwrap.dedent(CHECKS))
    env = os.environ | {"OMP_NUM_THREADS": "1", "SPECDISTILL_CACHE": str(out / "cache")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {name: [ranks[0][name], ranks[1][name]] for name in ranks[0]}


def assert_ok(results: list[str]) -> None:
    for rank, result in enumerate(results):
        assert result == "ok", f"rank {rank}:\n{result}"


def test_every_rank_loads_the_teacher_itself_under_fsdp_cpu_ram_efficient_loading(two_ranks):
    assert_ok(two_ranks["teacher"])


def test_lora_student_sharded_with_fsdp2_saves_a_merged_best_and_its_adapters(two_ranks):
    assert_ok(two_ranks["lora"])


def test_fsdp2_grad_norm_is_the_unsharded_norm_and_non_finite_on_every_rank(two_ranks):
    assert_ok(two_ranks["grad_norm"])


def test_nested_no_split_modules_are_sharded_children_first(two_ranks):
    assert_ok(two_ranks["nested"])


def test_the_cli_process_group_has_the_configured_timeout(two_ranks):
    assert_ok(two_ranks["timeout"])


def test_distill_refuses_a_given_teacher_to_shard(two_ranks):
    assert_ok(two_ranks["given_sharded"])


def test_run_frees_its_target_while_a_sharded_teacher_trains(two_ranks):
    assert_ok(two_ranks["run_frees"])


# ----------------------------------------------------------------------------------------------------------------
# One process


def test_fsdp_plugin_reduces_bf16_gradients_in_fp32(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin

    from train.distributed import fsdp_plugin

    assert fsdp_plugin("bf16") is None  # no FSDP launcher: accelerate decides alone
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    ours, theirs = fsdp_plugin("bf16"), FullyShardedDataParallelPlugin()
    for plugin in (ours, theirs):
        plugin.set_mixed_precision("bf16")  # what AcceleratorState does with mixed_precision=bf16
    assert ours.mixed_precision_policy.param_dtype == torch.bfloat16
    assert ours.mixed_precision_policy.reduce_dtype == torch.float32
    assert theirs.mixed_precision_policy.reduce_dtype == torch.bfloat16  # accelerate's own: bf16 reduction
    assert fsdp_plugin("no").mixed_precision_policy is None


def test_dtype_auto_resolves_for_the_training_device():
    from train.distributed import training_dtype

    assert training_dtype("auto", torch.device("cuda", 3)) == "bfloat16"  # even when loaded on the CPU to shard
    assert training_dtype("auto", torch.device("cpu")) == "float32"
    assert training_dtype("float16", torch.device("cuda")) == "float16"
    assert training_dtype("float32", torch.device("cuda")) == "float32"


def test_process_group_kwargs_carry_the_timeout():
    from datetime import timedelta

    from train.distributed import process_group_kwargs

    (kwargs,) = process_group_kwargs(90)
    assert kwargs.to_kwargs() == {"timeout": timedelta(minutes=90)}
    (gloo,) = process_group_kwargs(5, gloo=True)
    assert gloo.to_kwargs() == {"backend": "gloo", "timeout": timedelta(minutes=5)}


def test_teacher_data_shards_give_every_rank_work_and_the_same_rows(tmp_path, isolated_cache):
    """The preset's 300 prompts in shards of 256 leave no rank without a shard on 8 GPUs, and 3 processes (other
    shard boundaries than 1 process) write the same sampled rows as one."""
    from distill.config import DataConfig
    from distill.data import generate_teacher_data, load_teacher_data, shard_spans, shards_for_rank
    from specdec_runtime.loading import load_model

    preset = DataConfig(num_samples=2, batch_size=32, shard_size=256)
    for world in (1, 2, 8, 16):
        spans = shard_spans(300 * 2, preset, world)
        rows = [sum(spans[i][1].stop - spans[i][1].start for i in shards_for_rank(len(spans), r, world))
                for r in range(world)]  # fmt: skip
        assert min(rows) > 0 and sum(rows) == 600, (world, rows)
        assert all(s[1].start % 32 == 0 for s in spans)  # whole batches: the seeds do not move
    assert len(shard_spans(600, preset, 1)) == 2  # one process keeps shards of ~256 prompts

    prompts = tmp_path / "p.jsonl"
    rows = [{"id": f"p{i}", "prompt": f"Tell me {i}" + "!" * i} for i in range(7)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    held = tmp_path / "e.jsonl"
    held.write_text(json.dumps({"id": "e0", "prompt": "What is it?"}) + "\n")
    cfg = DataConfig(prompts=str(prompts), validation_prompts=str(held), max_new_tokens=4, batch_size=2, shard_size=4,
                     temperature=1.0, top_p=1.0)  # fmt: skip
    teacher, tokenizer = load_model("random:tiny-llama", device="cpu")

    def generate(out, rank, world):
        return generate_teacher_data(teacher, tokenizer, cfg, out, teacher_id="t", seed=3, rank=rank, world_size=world)

    single = generate(tmp_path / "one", 0, 1)
    written = set()
    for rank in (1, 2):  # each writes its own shards; rank 0 writes its own, then merges
        generate(tmp_path / "three", rank, 3)
        (root,) = (tmp_path / "three").glob("teacher-????????????")
        now = {p.name for p in (root / "shards").iterdir()}
        assert now - written, f"rank {rank} of 3 wrote no shard"
        written = now
    three = generate(tmp_path / "three", 0, 3)
    assert load_teacher_data(three.train).to_list() == load_teacher_data(single.train).to_list()


def test_checkpoint_saves_and_restores_only_its_own_cuda_device_rng(monkeypatch):
    """Saved with 2 visible devices, resumed with 1 (CUDA_VISIBLE_DEVICES narrowed per process): the state is the
    current device's only. torch.cuda is faked (no GPU here); the device-index check is the real one's."""
    from train import checkpoint

    class FakeCuda:
        def __init__(self, devices: int):
            self.devices, self.states = devices, {i: torch.full((8,), i, dtype=torch.uint8) for i in range(devices)}

        def get_rng_state(self, device="cuda"):
            return self.states[0].clone()

        def get_rng_state_all(self):
            return [self.states[i].clone() for i in range(self.devices)]

        def set_rng_state(self, state, device="cuda"):
            index = device if isinstance(device, int) else 0
            if index >= self.devices:
                raise IndexError(f"device {index} of {self.devices}")
            self.states[index] = state.clone()

        def install(self, mp):
            mp.setattr(torch.cuda, "is_available", lambda: True)
            mp.setattr(torch.cuda, "current_device", lambda: 0)
            for name in ("get_rng_state", "get_rng_state_all", "set_rng_state"):
                mp.setattr(torch.cuda, name, getattr(self, name))
                mp.setattr(torch.cuda.random, name, getattr(self, name))

    with monkeypatch.context() as mp:
        FakeCuda(2).install(mp)
        saved = checkpoint.rng_from_json(json.loads(json.dumps(checkpoint.rng_to_json(checkpoint.rng_state()))))
    one = FakeCuda(1)
    one.states[0].fill_(9)
    with monkeypatch.context() as mp:
        one.install(mp)
        checkpoint.set_rng_state(saved)
    assert one.states[0].tolist() == [0] * 8  # device 0's state, restored on device 0


def test_resume_reads_the_optimizer_state_memory_mapped(tmp_path):
    """Every rank reads the full optimizer state on resume: memory-mapped, it costs page cache shared by the ranks,
    not a private copy each (64 MB of Adam state here)."""
    from safetensors.torch import save_file

    from train import checkpoint

    def write(folder: Path) -> None:
        save_file({"w": torch.ones(2)}, folder / checkpoint.MODEL_FILE)

    moments = {"state": {0: {"exp_avg": torch.randn(16_000_000), "step": torch.tensor(3.0)}}, "param_groups": []}
    files = dict(optimizer=moments, scheduler={}, rng=[checkpoint.rng_state()], config_yaml="{}\n")
    path = checkpoint.save_checkpoint(tmp_path, checkpoint.TrainerState(step=1), write_model_fn=write, **files)
    process = psutil.Process()
    before = process.memory_full_info().uss
    ckpt = checkpoint.read_checkpoint(path, adapter=False)
    grown = process.memory_full_info().uss - before
    assert grown < 16e6, f"{grown / 1e6:.0f} MB private memory for a 64 MB optimizer state"
    assert torch.equal(ckpt.optimizer["state"][0]["exp_avg"], moments["state"][0]["exp_avg"])


def test_a_bf16_teacher_file_loads_memory_mapped_in_bf16(tmp_path, isolated_cache):
    """With dtype auto resolved for the GPU a sharded teacher trains on (bf16), a bf16 checkpoint loaded on the CPU
    keeps its weights in the file's pages (one page-cache copy for all ranks); an fp32 upcast is a private copy.
    Measured in a fresh process: in this one, memory freed by earlier tests can take the upcast without growing it."""
    script = tmp_path / "load.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, sys
        import psutil, torch
        sys.path.insert(0, {str(TESTS)!r})
        from helpers.models import tiny_llama
        from specdec_runtime.loading import load_model, load_tokenizer

        folder = {str(tmp_path / "bf16")!r}
        model = tiny_llama(vocab_size=512, hidden_size=512, intermediate_size=2048, layers=4)
        model.to(torch.bfloat16).save_pretrained(folder)
        load_tokenizer("random:tiny-llama").save_pretrained(folder)
        del model
        process, sizes = psutil.Process(), {{}}
        for dtype in ("bfloat16", "float32"):
            before = process.memory_full_info().uss
            model, _ = load_model(folder, dtype=dtype, device="cpu")
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            sizes[dtype] = (process.memory_full_info().uss - before) / params
            del model
        print(json.dumps(sizes))
    """)
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=os.environ)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sizes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sizes["bfloat16"] < 0.3 < 0.9 < sizes["float32"], sizes


def test_a_pretrained_student_keeps_its_fp32_weights_under_a_bf16_target(tmp_path, isolated_cache):
    """target.dtype=bfloat16 (what `auto` is on a GPU): the teacher runs in bf16, the student is loaded in fp32, not
    in bf16 and then upcast (which would round every weight)."""
    from specdec_runtime.loading import load_model
    from specdistill.pipeline import candidate_run
    from train.loop import DistillRecipe

    source, tokenizer = load_model("random:tiny-llama", dtype="float32", device="cpu")
    folder = tmp_path / "student"
    source.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    want = source.state_dict()
    assert any(not torch.equal(w, w.bfloat16().float()) for w in want.values())  # bf16 would change them

    overrides = ("target.dtype=bfloat16", "draft.init=pretrained", f"draft.pretrained={folder}")
    recipe = DistillRecipe(candidate_run(train_config(tmp_path / "run", *overrides), "draft"))
    recipe._setup_accelerator()
    teacher, recipe.tokenizer = recipe._setup_teacher(None, None)
    student = recipe._setup_student(teacher, None)  # teacher data: for EAGLE-3 students only
    assert teacher.dtype == torch.bfloat16
    got = student.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == torch.float32 and torch.equal(got[key], want[key]), key


def test_run_loads_the_target_once(tmp_path, isolated_cache, monkeypatch):
    """`specdistill run` hands its loaded target to every candidate (online and offline-cache) instead of loading a
    second one next to it: one load of the target spec in the whole run."""
    import specdec_runtime.loading
    import train.loop
    from specdistill.config import load_config
    from specdistill.pipeline import run_all

    real, loads = specdec_runtime.loading.load_model, []

    def counted(spec, **kwargs):
        loads.append(spec)
        return real(spec, **kwargs)

    monkeypatch.setattr(specdec_runtime.loading, "load_model", counted)
    monkeypatch.setattr(train.loop, "load_model", counted)
    smoke = Path(__file__).parent.parent / "configs" / "smoke.yaml"
    tiny = ["data.max_prompts=4", "data.max_validation_prompts=2", "data.max_new_tokens=4", "train.max_steps=1",
            "eval.max_prompts=2", "eval.num_draft_tokens=[1]", "eval.temperatures=[0.0]", "eval.draft_rules=[greedy]",
            "eval.max_new_tokens=4", "eval.repeats=1", "eval.warmup=0", "tracking=none"]  # fmt: skip
    result = run_all(load_config(smoke, [f"output_dir={tmp_path / 'run'}", *tiny]))
    assert result["report"].is_file()
    assert loads.count("random:tiny-llama") == 1, loads
