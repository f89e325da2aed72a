"""Builders and statistics shared by the test modules: tiny random models, analytic joints, goodness-of-fit tests,
tiny training runs and a synthetic eval report.

Test modules import from here (`from helpers import tiny_llama`), never from each other or from conftest.py (which
holds fixtures and hooks only). pytest's default import mode puts tests/ on sys.path; a subprocess script inserts
`TESTS` itself.
"""

from __future__ import annotations

import itertools
import json
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_runtime.engine import generate
from specdec_runtime.sampling import SamplingParams, warp_logits
from specdec_runtime.tree import Tree, parse_tree, sibling_rank, tree_size

# A child process's prelude (dedented source) that stops the run for two minutes right after it writes a checkpoint:
# a SIGKILL sent once the first checkpoint is complete then always lands between two steps of a live run.
PAUSE_AFTER_CHECKPOINT = """
import time
import train.checkpoint
_save = train.checkpoint.save_checkpoint
def _save_then_wait(*args, **kwargs):
    path = _save(*args, **kwargs)
    time.sleep(120)
    return path
train.checkpoint.save_checkpoint = _save_then_wait
"""

TESTS = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------------------------ tiny random models


def tiny_llama(seed: int = 0, vocab_size: int = 64, layers: int = 2, **overrides) -> LlamaForCausalLM:
    """A random LlamaForCausalLM small enough to run hundreds of forwards per second on a CPU."""
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(LlamaConfig(**{**shape, **overrides})).eval()


def spread_llama(seed: int) -> LlamaForCausalLM:
    """A 12-token vocabulary and spread-out logits (initializer_range 0.5), so two seeds' p and q differ a lot."""
    return tiny_llama(seed, vocab_size=12, max_position_embeddings=64, initializer_range=0.5)


def perturbed(model: LlamaForCausalLM, scale: float, seed: int) -> LlamaForCausalLM:
    """A draft that agrees with the target often but not always."""
    draft = tiny_llama(0)
    draft.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(scale * torch.randn(w.shape, generator=gen))
    return draft


LLAMA_PROMPTS = [[5, 17, 3, 40, 22, 9], [11], [60, 2, 33], [7, 7, 7, 7, 7, 7, 7, 7, 1]]


def hf_greedy(model, prompts, max_new: int, eos: int | None = None) -> list[list[int]]:
    """Target-only greedy decoding by HF generate, one prompt at a time (no padding)."""
    rows = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0
        )
        rows.append(out[0, len(prompt) :].tolist())
    return rows


# --------------------------------------------------------------------------------------------- CUDA tiny models


GPU_PROMPTS = [*LLAMA_PROMPTS, [8, 30]]


def gpu_llama(seed: int, vocab_size: int = 64, init: float = 0.2) -> LlamaForCausalLM:
    """A wider tiny Llama on the GPU; a large `init` spreads the logits out: fewer bf16 near-ties."""
    return tiny_llama(
        seed, vocab_size, hidden_size=64, intermediate_size=128, max_position_embeddings=512, initializer_range=init
    ).cuda()


def gpu_perturbed(model: LlamaForCausalLM, scale: float) -> LlamaForCausalLM:
    """A GPU draft near `model`: each weight moved by `scale` times its own spread."""
    draft = gpu_llama(99)
    draft.load_state_dict(model.state_dict())
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(scale * w.std() * torch.randn_like(w))
    return draft


def assert_same_up_to_ties(hf_fp32: LlamaForCausalLM, prompts, got_rows, want_rows, label: str) -> None:
    """Rows equal, or parting at a step where the fp32 target's top two logits are within bf16 noise.

    bf16 verify (gamma + 1 tokens) and decode (1 token) forwards round differently, so an exact tie can break either
    way; everywhere else the tokens must match.
    """
    for prompt, got, want in zip(prompts, got_rows, want_rows):
        split = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if split is None:
            assert got == want, label
            continue
        with torch.no_grad():
            logits = hf_fp32(input_ids=torch.tensor([prompt + want[:split]], device="cuda")).logits[0, -1]
        top = logits.topk(2).values
        assert float(top[0] - top[1]) < 0.05 * float(logits.abs().max()), f"{label}: parted at {split}, not a tie"


# ------------------------------------------------------------------------------------------------- analytic joints

V = 6  # vocabulary of the trigram toy models
NONE = V  # "no previous token" row of a trigram table


def exact_joint(table: torch.Tensor, prompt: list[int], sampling: SamplingParams) -> torch.Tensor:
    """P(y1, y2, y3) of target-only sampling from a trigram table (V + 1, V, 2, V) after `prompt` -> (V, V, V)."""
    L = len(prompt)
    prev0 = prompt[-2] if L > 1 else NONE

    def p(prev, cur, pos):
        return warp_logits(table[prev, cur, pos % 2], sampling)

    joint = torch.zeros(V, V, V)
    for y1, y2 in itertools.product(range(V), repeat=2):
        joint[y1, y2] = p(prev0, prompt[-1], L - 1)[y1] * p(prompt[-1], y1, L)[y2] * p(y1, y2, L + 1)
    return joint


def llama_joint2(model: LlamaForCausalLM, prompt: list[int], sampling: SamplingParams) -> torch.Tensor:
    """P(y1, y2) of target-only sampling after `prompt` -> (V, V) on the CPU, from full forwards on model.device."""
    vocab, device = model.config.vocab_size, model.device
    with torch.no_grad():
        p1 = warp_logits(model(input_ids=torch.tensor([prompt], device=device)).logits[0, -1], sampling)
        seqs = torch.tensor([prompt + [y] for y in range(vocab)], device=device)
        p2 = warp_logits(model(input_ids=seqs).logits[:, -1], sampling)
    return (p1[:, None] * p2).cpu()


# ------------------------------------------------------------------------------------------------ trigram toy models


class TrigramLM(torch.nn.Module):
    """Logits by (previous token, current token, position parity); the previous token is the last cache column the
    query may attend to before its own: its parent inside a tree, so a rejected token left visible after a rollback
    changes the output. Accepts 2D padding masks (chains) and 4D additive masks (trees)."""

    def __init__(self, table: torch.Tensor):  # (V + 1, V, 2, V): row V is "no previous token"
        super().__init__()
        self.table = table
        self.config = SimpleNamespace(vocab_size=table.shape[-1], max_position_embeddings=1024)
        self.device, self.dtype = torch.device("cpu"), torch.float32

    def forward(self, input_ids, position_ids, attention_mask, cache, use_cache=True, logits_to_keep=0):
        B, T = input_ids.shape
        ids, _ = cache.update(input_ids[:, None, :, None].float(), input_ids[:, None, :, None].float(), 0)
        ids = ids[:, 0, :, 0].long()  # (B, S + T): every column the cache holds, holes included
        S = ids.shape[1] - T
        cols, own = torch.arange(S + T), S + torch.arange(T)
        if attention_mask.dim() == 4:  # additive tree mask (B, 1, T, S + T): 0 = attend
            visible = attention_mask[:, 0] == 0
        else:  # (B, S + T) real columns, causal
            visible = attention_mask.bool()[:, None, :] & (cols <= own[:, None])
        prev_col = torch.where(visible & (cols < own[:, None]), cols, -1).amax(-1)  # (B, T)
        prev = torch.where(prev_col >= 0, ids.gather(1, prev_col.clamp_min(0)), self.table.shape[0] - 1)
        logits = self.table[prev, input_ids, position_ids % 2]  # (B, T, V)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


# Whole sequences with a stop token: 6 = 2 (gamma + 1) for gamma 2, or 2 (depth + 1) for depth-2 trees, so bonus
# tokens and rollbacks both feed forward and rows leave the batch at different steps.
SEQ_V, SEQ_STOP, SEQ_LEN = 4, 3, 6
SEQ_PROMPTS = {"short": [1], "long": [2, 0, 1]}


def sequence_tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(V + 1, V, 2, V) target and draft tables that agree often (all-accepted steps take a bonus token) but not
    always (rejections roll back), with a rare stop token so most sequences run to full length."""
    gen = torch.Generator().manual_seed(seed)
    target = 1.5 * torch.randn(SEQ_V + 1, SEQ_V, 2, SEQ_V, generator=gen)
    target[..., SEQ_STOP] -= 1.5
    draft = target + torch.randn(target.shape, generator=gen)
    return target, draft


def sequence_probs(table: torch.Tensor, prompt: list[int], sampling: SamplingParams) -> dict[tuple, float]:
    """P(sequence) of target-only sampling for every sequence a run can emit: SEQ_LEN tokens, or fewer ending in the
    stop token."""
    none, probs = table.shape[0] - 1, {}
    for length in range(1, SEQ_LEN + 1):
        for seq in itertools.product(range(SEQ_V), repeat=length):
            if SEQ_STOP in seq[:-1] or (length < SEQ_LEN and seq[-1] != SEQ_STOP):
                continue
            ctx, prob = list(prompt) + list(seq), 1.0
            for i in range(len(prompt), len(ctx)):
                prev = ctx[i - 2] if i >= 2 else none
                prob *= float(warp_logits(table[prev, ctx[i - 1], (i - 1) % 2], sampling)[ctx[i]])
            probs[seq] = prob
    return probs


def sequence_pvalues(rows: list[list[int]], table: torch.Tensor, sampling: SamplingParams) -> dict[str, float]:
    """Chi-square p-value per prompt kind of emitted sequences (rows of interleaved short, long SEQ_PROMPTS) against
    their exact distribution."""
    pvalues = {}
    for i, kind in enumerate(("short", "long")):
        probs = sequence_probs(table, SEQ_PROMPTS[kind], sampling)
        cells = {seq: c for c, seq in enumerate(probs)}
        counts = torch.zeros(len(cells) + 1)  # the last cell: sequences the target can never emit
        for tokens in rows[i::2]:
            counts[cells.get(tuple(tokens), len(cells))] += 1
        pvalues[kind] = chi_square_pvalue(counts, torch.tensor([*probs.values(), 0.0]))
    return pvalues


# ------------------------------------------------------------------------------------- joints of tiny Llamas

JOINT_PROMPTS = {"short": [5], "long": [3, 9, 1, 7, 2]}


def llama_joint_pvalues(
    target, draft, exact: dict[str, torch.Tensor], sampling: SamplingParams, *, draws: int, generator, **kwargs
) -> tuple[object, dict[str, float]]:
    """(result, chi-square p-value per prompt kind) of the first two tokens of `draws` interleaved short and long
    JOINT_PROMPTS against `exact` (kind -> (V, V) joint, from llama_joint2 on the target); `kwargs` go to generate
    (draft_rule, num_draft_tokens or tree)."""
    result = generate(
        target,
        draft,
        [JOINT_PROMPTS["short"], JOINT_PROMPTS["long"]] * draws,
        sampling=sampling,
        max_new_tokens=2,
        generator=generator,
        **kwargs,
    )
    tokens = torch.tensor(result.tokens)  # (2 * draws, 2)
    pvalues = {}
    for i, kind in enumerate(("short", "long")):
        vocab = exact[kind].shape[-1]
        flat = tokens[i::2, 0] * vocab + tokens[i::2, 1]
        pvalues[kind] = chi_square_pvalue(torch.bincount(flat, minlength=vocab * vocab), exact[kind])
    return result, pvalues


# ------------------------------------------------------------------------------------------------------ statistics


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells expecting < 5 draws are pooled into one."""
    counts, expected = counts.flatten().double(), probs.flatten().double() * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    assert counts[expected == 0].sum() == 0, "a draw the target can never produce"
    keep = expected > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def g_test_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """G-test of categorical samples (n,) against probs (C,); 0 when an impossible outcome shows up."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    observed, expected = counts[probs > 0], samples.numel() * probs[probs > 0]
    g = 2 * torch.where(observed > 0, observed * (observed / expected).log(), 0.0).sum()
    dof = torch.tensor((probs > 0).sum().item() - 1.0, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, g / 2))


# ----------------------------------------------------------------------------------------------------------- trees


def per_row_tree(parents: list[list[int]]) -> Tree:
    """Tree with per-row parents; depth by walking up in Python."""
    depth = []
    for row in parents:
        depth.append([])
        for p in row:
            depth[-1].append(1 if p < 0 else depth[-1][p] + 1)
    parents_t, depth_t = torch.tensor(parents), torch.tensor(depth)
    ranks = sibling_rank(parents_t)
    return Tree(parents_t, depth_t, ranks, int(depth_t.max()), int(ranks.max()) + 1)


# ------------------------------------------------------------------------------------------------ tiny training runs


def make_split(path: Path, teacher, n: int, *, seed: int, top_k: int | None) -> Path:
    """A finished teacher dataset in the data contract's format: random prompt/response ids, optional top-k cache
    from a real teacher forward (so cached and online targets agree)."""
    import datasets

    from distill.data import COMPLETE, features

    g = torch.Generator().manual_seed(seed)
    cols = {"id": [], "category": [], "input_ids": [], "prompt_len": []}
    cols |= {"topk_ids": [], "topk_logprobs": []} if top_k else {}
    for i in range(n):
        P, R = int(torch.randint(3, 8, (1,), generator=g)), int(torch.randint(2, 10, (1,), generator=g))
        ids = torch.randint(3, teacher.config.vocab_size, (P + R,), generator=g)
        cols["id"].append(f"p{i}#0")
        cols["category"].append("test")
        cols["input_ids"].append(ids.tolist())
        cols["prompt_len"].append(P)
        if top_k:
            with torch.no_grad():
                logprobs = torch.log_softmax(teacher(ids[None]).logits[0].float(), dim=-1)  # (T, V)
            values, indices = logprobs[P - 1 : P + R - 1].topk(top_k, dim=-1)  # position t predicts token t + 1
            cols["topk_ids"].append(indices.tolist())
            cols["topk_logprobs"].append(values.tolist())
    datasets.Dataset.from_dict(cols, features=features(top_k)).save_to_disk(str(path))
    (path / COMPLETE).write_text("")
    return path


def make_teacher_data(root: Path, teacher, *, n_train: int = 16, n_eval: int = 5, top_k: int | None = 4):
    from distill.data import TeacherData

    return TeacherData(
        train=make_split(root / "teacher-test", teacher, n_train, seed=0, top_k=top_k),
        eval=make_split(root / "teacher-eval-test", teacher, n_eval, seed=1, top_k=top_k),
    )


def train_config(out: Path, *overrides: str):
    """A config for a few-step run of a 2-layer student of random:tiny-llama on CPU, no W&B."""
    from specdistill.config import load_config

    base = [
        f"output_dir={out}",
        "target.model=random:tiny-llama",
        "target.device=cpu",
        "draft.num_layers=2",
        "train.max_steps=2",
        "train.batch_size=2",
        "train.grad_accum=1",
        "train.max_seq_len=64",
        "train.lr=1e-2",
        "train.warmup_steps=1",
        "train.eval_every=1",
        "train.save_every=1",
        "train.log_every=1",
        "tracking.backend=none",
        "data.max_new_tokens=6",
    ]
    return load_config(None, [*base, *overrides])


def tiny_setup(root: Path):
    """(teacher, tokenizer, teacher data) with the random:tiny-llama target from the (isolated) model cache."""
    from specdec_runtime.loading import load_model

    teacher, tokenizer = load_model("random:tiny-llama", device="cpu")
    return teacher, tokenizer, make_teacher_data(root, teacher)


def reference_run(tmp_path_factory, name: str, *overrides: str) -> tuple[Path, object, Path]:
    """(root, teacher data, candidate folder) of one `draft` run in this process, for a module-scoped fixture; the
    model cache is root/cache, for the subprocess runs compared with it."""
    from specdistill.pipeline import distill_candidate as distill

    root = tmp_path_factory.mktemp(name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDISTILL_CACHE", str(root / "cache"))
        teacher, tokenizer, data = tiny_setup(root)
        cand = distill(train_config(root / name, *overrides), "draft", data, teacher=teacher, tokenizer=tokenizer)
    return root, data, cand


def final_weights(cand: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(cand / "checkpoints" / f"step-{step:06d}" / "model.safetensors")


ADAM_OUTLIERS = 1e-3  # see assert_same_weights


def assert_same_weights(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-4, outliers: float = 0.0
) -> None:
    """Equal up to float noise: every tensor within atol, but for at most an `outliers` share of its elements
    (`ADAM_OUTLIERS` where the two runs reduce in another order).

    Runs that reduce in another order (1 vs 2 processes, accumulated micro-batches) differ by float rounding, and
    the rounding depends on the CPU's kernels (AVX2 vs AVX-512). Adam turns a gradient at the scale of its eps
    (1e-8) into a step of up to lr whatever its sign, so the rare element with such a gradient moves by rounding
    noise: 1 of 16,576 elements was 1.4e-4 apart on an AVX-512 machine. A real defect (a lost micro-batch, a wrong
    normalisation) moves most elements, and the loss and gradient norm (`assert_same_logs`) as well.
    `atol=0` compares bit for bit (resume), with no outliers."""
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name].float(), b[name].float()
        assert x.shape == y.shape, f"{name}: {tuple(x.shape)} vs {tuple(y.shape)}"
        if atol == 0:
            assert torch.equal(x, y), f"{name}: {(x != y).sum().item()} elements differ"
            continue
        off = (x - y).abs() > atol + 1e-5 * y.abs()
        allowed = int(outliers * x.numel())
        assert off.sum().item() <= allowed, (
            f"{name}: {off.sum().item()} of {x.numel()} elements differ by more than {atol} (allowed {allowed}); "
            f"largest {(x - y).abs().max().item():.3g}"
        )


def first_step_gradients(run) -> list[torch.Tensor]:
    """The gradients the first optimizer step of `run()` applies (after accumulation and clipping), in parameter
    order: what gradient accumulation and data parallelism must get right, free of Adam's amplification."""
    grads: list[torch.Tensor] = []

    def record(optimizer, args, kwargs):
        if not grads:
            grads.extend(p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"])

    handle = register_optimizer_step_pre_hook(record)
    try:
        run()
    finally:
        handle.remove()
    return grads


def assert_same_logs(a: list[dict], b: list[dict]) -> None:
    """Same loss, gradient norm and validation metrics at every logged step. Adam hides a constant gradient scale
    in the weights; the gradient norm does not."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        for key in x.keys() - {"step", "train/tokens_per_s"}:
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), (x["step"], key)


def metric_rows(cand: Path) -> list[dict]:
    return [json.loads(line) for line in (cand / "metrics.jsonl").read_text().splitlines()]


def accelerate_launcher(config: str) -> tuple[str, ...]:
    """`python -m accelerate.commands.launch` arguments for the shipped configs/accelerate/`config` on 2 processes,
    on a free port (a fixed one would clash with a run still releasing it)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    path = TESTS.parent / "configs" / "accelerate" / config
    return ("-m", "accelerate.commands.launch", "--config_file", str(path), "--num_processes", "2",
            "--main_process_port", port)  # fmt: skip


# ------------------------------------------------------------------------------------------------ offline W&B runs


def read_wandb_records(run_file: Path) -> list:
    """Records of a `.wandb` transaction log: a 7-byte header, then LevelDB-log framed protobuf `Record`s in 32 KiB
    blocks (chunk header: crc32 u32, length u16, type u8 with 1 = full, 2 = first, 3 = middle, 4 = last)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def offline_run(run_dir: Path, timeout: float = 60.0) -> tuple[list[dict], list, bytes]:
    """(history rows, artifact records, raw bytes) of the single offline W&B run under `run_dir`.

    `run.finish()` can return before wandb-core has flushed the transaction log, so wait for its exit record.
    """
    from google.protobuf.message import DecodeError

    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = read_wandb_records(run_file)
        except DecodeError:  # a record still being written
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    return history, artifacts, run_file.read_bytes()


# ------------------------------------------------------------------------------------------------ synthetic report


CATEGORIES = {"coding": 2, "math": 1, "writing": 3}


def make_setting(
    gamma: int, temperature: float, rule: str, alpha: float, tree: str | None = None, nodes: int | None = None
) -> dict:
    """One setting as eval/results.py writes it; a tree setting has `tree` set and num_draft_tokens = its depth."""
    c, v = 0.2, 1.3
    tau = (1 - alpha ** (gamma + 1)) / (1 - alpha)
    predicted = tau / (gamma * c + v)
    return {
        "num_draft_tokens": gamma,
        "temperature": temperature,
        "draft_rule": rule,
        "tree": tree,
        "acceptance_rate": alpha,
        "mean_accepted_length": tau,
        "nodes_per_step": float(gamma if nodes is None else nodes),
        "per_position_acceptance": [round(alpha + 0.05 * (gamma - i) / gamma, 4) for i in range(gamma)],
        "expected_acceptance": alpha + 0.01,
        "cost_ratio": c,
        "verify_cost_ratio": v,
        "analytic_speedup": predicted * 1.1,
        "predicted_speedup": predicted,
        "speedup": predicted * 0.9,
        "speedup_ci": [predicted * 0.85, predicted * 0.95],
        "units": 3,
        "efficiency": 0.9,
        "overhead_fraction": 0.1,
        "batch_size": 1,
        "ttft_s": 0.05,
        "tpot_s": 0.01 / (1 + alpha),
        "tokens_per_s": 90.0 * alpha,
        "target_tokens_per_s": 56.0,
        "wall_s": 3.2,
        "new_tokens": 768,
        "target_forwards": 250,
        "draft_forwards": 1000,
        "peak_memory_bytes": 123456789,
        "by_category": {
            cat: {"acceptance_rate": alpha - 0.1 * i, "mean_accepted_length": tau, "count": n}
            for i, (cat, n) in enumerate(CATEGORIES.items())
        },
        "by_length": {
            b: {"acceptance_rate": alpha, "mean_accepted_length": tau, "count": 2} for b in ("short", "medium", "long")
        },
    }


TREE_ALPHA = 0.97  # no chain setting has it, so a tree leaking into a chain plot or table is visible


def make_report(tmp_path, *, enabled: bool = True, trees: tuple[str, ...] = ()) -> dict:
    """A report following the report.json contract: 2 candidates, gamma in {1, 2, 4} x (T=0 greedy, T=1 sample),
    plus one setting per tree spec x (T, draft_rule) when `trees` is given; the first candidate with a run_dir
    holding a small metrics.jsonl (and a torn last line, as a killed run leaves)."""
    run_dir = tmp_path / "candidates" / "trunc2-fkl"
    run_dir.mkdir(parents=True)
    rows = [{"step": s, "train/loss": 3.0 / s, "lr": 1e-3} for s in range(1, 9)]
    rows += [
        {"step": s, "eval/loss": 2.5 / s, "eval/expected_acceptance": 0.4 + 0.05 * s, "eval/greedy_match": 0.3}
        for s in (4, 8)
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + '\n{"step": 9, "train/lo')
    candidates = []
    for name, alpha, rd in (("trunc2-fkl", 0.7, str(run_dir)), ("config1-tv", 0.5, None)):
        settings = [
            make_setting(g, t, r, alpha - 0.1 * t) for t, r in ((0.0, "greedy"), (1.0, "sample")) for g in (1, 2, 4)
        ]
        for t, r in ((0.0, "greedy"), (1.0, "sample")):  # interleaved as the sweep writes them: chains, then trees
            for spec in trees:
                depth, nodes = tree_size(parse_tree(spec))
                tree_alpha = TREE_ALPHA - 0.1 * t - 0.01 * nodes / 16 - 0.05 * (0.7 - alpha)
                settings.append(make_setting(depth, t, r, tree_alpha, spec, nodes))
        candidates.append(
            {
                "name": name,
                "draft": str(tmp_path / name / "best"),
                "run_dir": rd,
                "num_parameters": 12345,
                "expected_acceptance": alpha,
                "expected_acceptance_temperature": 1.0,
                "settings": settings,
            }
        )
    best = candidates[0]["settings"][2]
    confirmed = {k: best[k] for k in ("acceptance_rate", "mean_accepted_length", "speedup", "speedup_ci")}
    by_batch = [
        {
            "batch_size": b,
            **confirmed,
            "speedup": best["speedup"] / b**0.5,
            "speedup_ci": [x / b**0.5 for x in best["speedup_ci"]],
            "tokens_per_s": 90.0 * b,
            "target_tokens_per_s": 60.0 * b,
            "ttft_s": 0.05,
            "tpot_s": 0.01 * b**0.5,
            "target_only": {"tokens_per_s": 60.0 * b, "ttft_s": 0.04, "tpot_s": 0.018},
            "units": 3,
        }
        for b in (1, 4)
    ]
    confirmation = {
        "name": "trunc2-fkl",
        "draft": candidates[0]["draft"],
        "num_draft_tokens": 4,
        "draft_rule": "greedy",
        "temperature": 0.0,
        "split": "confirmation",
        "prompts": 3,
        "by_batch_size": by_batch,
    }
    return {
        "schema_version": 1,
        "created_at": "2026-11-29T12:00:00Z",
        "target": "random:tiny-llama",
        "target_fingerprint": "0123456789abcdef",
        "device": "cpu",
        "prompts": {"source": "builtin:test", "count": 6, "categories": CATEGORIES},
        "sweep": {
            "num_draft_tokens": [1, 2, 4],
            "temperatures": [0.0, 1.0],
            "draft_rules": ["greedy", "sample"],
            "trees": list(trees),
            "max_new_tokens": 64,
            "batch_size": 1,
            "batch_sizes": [1, 4],
        },
        "settings": {"backend": "hf-eager", "split": "selection", "repeats": 3, "warmup": 1, "stop_token_ids": [2]},
        "target_only": [
            {
                "temperature": t,
                "tokens_per_s": 56.0,
                "ttft_s": 0.04,
                "tpot_s": 0.018,
                "decode_s": 4.8,
                "calls": 18,
                "peak_memory_bytes": 100000000,
            }
            for t in (0.0, 1.0)
        ],
        "candidates": candidates,
        "confirmation": confirmation,
        "recommendation": {
            "name": "trunc2-fkl",
            "draft": candidates[0]["draft"],
            "num_draft_tokens": 4,
            "draft_rule": "greedy",
            "temperature": 0.0,
            "enabled": enabled,
            "reason": "both gates passed: trunc2-fkl" if enabled else "speedup gate: no candidate beats target-only",
            "gate": "passed" if enabled else "speedup_ci",
            "selection": {**confirmed, "split": "selection"},
            "confirmation": {
                **confirmed,
                "split": "confirmation",
                "batch_size": 1,
                "prompts": 3,
                "max_concurrency": 1,
                "measured_concurrency": [1, 4],
            },
            "max_concurrency": 1,
        },
    }
