"""EAGLE-3 heads, ours vs the speculators package's trainer (issue 27): training tokens/s and peak memory of each
trainer, and acceptance, tau and speedup of each head on the same builtin:test prompts at T = 0 and 1.

    make install          # puts speculators 0.9.0 (and hs-connectors, its hidden-states reader) in .venv
    python benchmarks/eagle3_vs_speculators.py --pairs same --json runs/eagle3-vs-speculators/result.json   # ~25-50 min
    python benchmarks/eagle3_vs_speculators.py --json runs/eagle3-vs-speculators/result.json   # 3.5 h AVX2, 1 h AMX
    python benchmarks/eagle3_vs_speculators.py --smoke --out /tmp/e3vs --json /tmp/e3vs/result.json   # ~1.5 min

CPU only by design: speculators' trainer runs here through the adapter below; on a GPU neither trainer needs one,
and the two would be compared there in bf16 with speculators' compiled model and fused (Triton) losses.

Data. One teacher dataset from our data stage on --config's target, prompts and sampling (the quickstart's by
default; its `<output_dir>/data` is reused when `specdistill data` already wrote it), with the head's aux hidden
states cached (fp16, every position). It is written once more in speculators' offline format under <out>/
speculators-data: a `datasets` folder (input_ids cut at train.max_seq_len as our loop cuts them, loss_mask = the
response tokens, seq_len), hidden_states/hs_<i>.safetensors (hidden_states (T, 4, H): our stored aux states, then the
target's last pre-norm hidden state from one scoring pass, fp32; token_ids), the training rows then the validation
rows (train_data_ratio puts them in its two splits), and d2t-<V>.npy / t2d-<V>.npy: the draft vocabulary our
recipe counts (the most frequent response tokens, `distill.eagle3.choose_draft_vocab`; speculators' own
token_freq.pt would pick the same ids), given to both.

Recipes, two pairs (--pairs). Shared by both pairs: the data, draft vocabulary, aux layers, training-time-test depth,
learning rate, optimizer steps (--steps, default the config's), fp32, frozen embeddings, and the batch: our
train.batch_size sequences; speculators packs sequences up to --total-seq-len tokens per step, set to the smallest
length (at least the longest sequence) whose batches over the run hold at least our batches' mean tokens: the same
tokens per step on average (`their_packing`). Ours concatenates its batch's sequences into one row
(`draft.pack_sequences`, the default since this comparison found padding to cost 1.74x the real positions) unless
the config says otherwise, and its unroll computes only the rows a loss reads (`distill.eagle3.trained_rows`: with
the loss on response tokens, about 30 % of them; speculators computes every row).
  same         our candidate's recipe on both sides, but AdamW (no weight decay), warm-up then cosine to 0, step loss
               weights ttt_decay^j, the head as the engines lay it out (residual before hidden_norm, no norm before
               fc, pre-norm outputs fed back, full attention); lm_head frozen and clipping at 1 (fixed in speculators);
               the loss on response tokens (its loss mask; distill.loss_on_prompt false). And no forward and
               backward pass holds more than --total-seq-len tokens: a step of ours holding more runs as passes
               within it (train.max_micro_batch_tokens: the same step, less memory).
  recommended  each trainer's own defaults for the rest: ours the config's EAGLE-3 candidate as it is (cosine to
               train.min_lr_ratio; the quickstart's head also trains prompt tokens, with Muon and the residual after
               hidden_norm since this comparison found their lead there, in passes of at most 640 tokens);
               speculators `speculators train --speculator-type eagle3` (Muon on the 2-D weights + AdamW with
               weight decay, linear schedule with 1 % warm-up, step loss weights 1, residual after hidden_norm, an
               RMSNorm before fc, normed outputs fed back, a 2048-token sliding window).
By design and in both pairs, the teacher signal differs: ours learns the target's top-k (data.teacher_cache_top_k)
cached log-probs restricted to the draft vocabulary, masking positions whose target argmax lies outside it;
speculators the target's exact logits over the draft vocabulary (verifier_lm_head(verifier_norm(last hidden
state))), every loss-mask position. Speculators also trains rows one place later (its row t is trained when token
t + 1, the one it reads, is a response token; ours when token t + 2, the one it predicts, is), and saves its head in
bf16 (ours: fp32).

The adapter (`cpu_trainer`), all it changes of speculators' `Trainer`: `local_rank`, which it passes to every `.to()`
(the model, each batch), is the CPU instead of CUDA device 0; `device_type`, its autocast device, is "cpu" instead
of "cuda" (what it falls back to when no accelerator is found), and with fp32 hidden states torch then disables that
autocast, so it computes in fp32 as our loop does on the CPU; its step timer reads the clock without
`torch.accelerator.synchronize()`, which raises where there is no accelerator. Its model, loss, optimizers,
schedulers, data loader and loop are its own, run through its own CLI (`speculators.train.cli.main` on the flags
below), with the options its documentation gives for hardware without its GPU kernels: --draft-attn-impl sdpa (flex
attention needs compiled kernels), --loss-implementation eager (the fused losses are Triton), and --num-workers 0
(as ours: no loader processes next to the two cores' training).

On the 2-core CPU (docs/benchmarks.md) the `same` pair trains in ~12 min and measures in ~21; speculators' own
recipe (`recommended`) ran 27 s a step there, ~2.3 h for 300 steps: 23-26 s of it is one step of torch.optim.Muon,
whose Newton-Schulz iterations run in bf16, which that CPU has no matrix units for (`--optimizer-step HEAD` times
it); on a 2-core host with AMX (AVX-512 BF16) the four trainings took ~12 min and its recipe ran 0.8 s a step.
A training whose result exists for the very same spec under <out>/children is reused (a run stopped after it,
or re-run with other --pairs; on the same machine also later: the `recommended` pair's trainings can be one run,
stopped once they are done, and its eval the next); ours' spec holds its recipe and a digest of our training code
(`our_code`), so a change to either trains it again.

Measurement. Each training runs in a process of its own, the trainers alternating from one pair to the next (ours,
speculators | speculators, ours). tokens/s: the tokens of the sequences each step trains on (prompt and response,
no padding), over the wall time between optimizer steps, the first --warmup-steps steps left out. Peak memory: the
process's peak RSS (VmHWM) over its training steps (reset when the first starts) and over the whole process.
Both final heads (after the same number of steps) are loaded by our eval's loader (speculators' from the folder its
trainer saved, the format vLLM detects); our loader is checked against speculators' own model on that folder (the
training-time-test logits of a validation sequence, every step). Then one paired, repeated A/B per temperature
(`eval.sweep.measure_arms`: target-only and every head on the same first --prompts builtin:test prompts, ABBA
order): each head's acceptance_rate, mean_accepted_length (tau) and speedup with its interval, and per pair the
differences ours - speculators with paired bootstrap intervals over prompts (`recipe_study.paired_difference`) and
the speed ratio ours / speculators with its paired interval (`specdec_runtime.ab.paired_speedup`). Goals (issue
27): the acceptance difference's interval above -0.02, training tokens/s >= 1.5x speculators' at no more peak memory.

Ablation (--ablate KEY=VALUE, repeatable): one more training of ours, the first pair's recipe with these overrides
(e.g. `distill.teacher=online`: the target's exact logits in training instead of the top-k cache, the signal
speculators learns from), measured as one more arm of the same A/B; the JSON's `ablation` holds its training and,
per temperature, its paired differences against ours (what the overrides change) and against speculators.
--ablate-speculators FLAG[=VALUE] (repeatable) is the same on their side: one more training of speculators, the
first pair's flags with these set (`optimizer=adamw` for `--optimizer adamw`, `no-norm-before-fc` for the switch;
a flag the pair already sets is replaced), its differences against speculators (what the flags change) and ours.
Ablating their recipe towards ours, one choice at a time, finds which of its choices their acceptance comes from
before any of them is built into our trainer. Two more settings of that arm change what it trains on, not its
recipe: --their-rows (a copy of its dataset whose loss mask holds other rows, ours among them: `rows_mask`) and
--their-batches ours (its sampler draws our loop's batches, the same rows in each step as ours). `loss_check` is
the step itself: both trainers' gradients on one batch from one head (a test keeps them proportional on our rows);
`trajectory_check` the steps that follow, each trainer's loss, clipping and optimizer from one head on the same
batches, the weights compared after every step (a test keeps them together and parts them with another update).

Training seed (--training-seed N): both trainers' seed (ours' config `seed`, speculators' --seed: the head's
initialisation and the order of the batches); by default the config's. The eval's intervals hold the prompts' and
the sampling's noise, not the trainings'; the same command with another seed and its own --out (its trainings must
not replace the first seed's) is a second draw of both trainings, whose difference shows how far the training
itself moves the comparison. benchmarks/over_seeds.py reads those runs' JSONs: the difference per seed, its mean and
a 95 % Student-t interval over the seeds, the interval the acceptance goal is read on.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benchmarks' helpers

from distill_bench import reset_peak_rss  # noqa: E402
from recipe_study import bootstrap, paired_difference  # noqa: E402

SEED = 0
PAIRS = ("same", "recommended")
TRAINERS = ("ours", "speculators")
LOADER_TOL = 1e-4  # fp32 on both sides, the same weights (its embeddings the target's): they agree to ~1e-7
# Smoke: random:tiny-llama (4 layers, so explicit, distinct aux layers: speculators refuses the default [2, 2, 1]).
SMOKE_CONFIG = "configs/smoke.yaml"
SMOKE_OVERRIDES = [
    "data.max_prompts=6",
    "data.max_validation_prompts=2",
    "data.max_new_tokens=8",
    "candidates=[{name: eagle3, overrides: {draft.init: eagle3, draft.aux_layers: [1, 2, 3], "
    "draft.draft_vocab_size: 64, draft.ttt_depth: 2, draft.freeze_lm_head: true, distill.teacher: cache, "
    "train.batch_size: 2, train.lr: 1.0e-3, train.warmup_steps: 1}}]",
]
SMOKE_ARGS = dict(steps=3, prompts=2, max_new_tokens=8, repeats=1, warmup=0, gamma=2)


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM) since it started or since `reset_peak_rss`, in MiB. Not getrusage's
    ru_maxrss: a process started by another inherits that one's value there (the parent's RSS at the fork)."""
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


class StepLog:
    """Per optimizer step of a whole training in its real loop (`--step-log`), for every parameter stepped: the
    learning rate, the norm of its gradient as the optimizer reads it (after clipping) and the norm of its change,
    and its norm after. Global optimizer hooks see every optimizer; a MuonAdamW's two halves, which step inside it,
    are skipped (their parameters are logged with the whole). `name(module)` gives the parameters their names."""

    KEYS = ("lr", "grad", "update", "norm")

    def __init__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.names: dict[int, str] = {}
        self.rows: dict[str, dict[str, list[float]]] = {}
        self._halves: set[int] = set()
        self._before: dict[int, torch.Tensor] = {}
        self._hooks = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]

    def name(self, module: torch.nn.Module) -> None:
        self.names.update({id(p): n for n, p in module.named_parameters()})

    def _stepped(self, opt) -> list[tuple[float, torch.Tensor]]:
        return [(g["lr"], p) for g in opt.param_groups for p in g["params"] if p.grad is not None]

    def _pre(self, opt, args, kwargs) -> None:
        self._halves.update(id(h) for h in getattr(opt, "halves", ()))
        if id(opt) in self._halves:
            return
        for lr, p in self._stepped(opt):
            self._before[id(p)] = p.detach().clone()
            row = self.rows.setdefault(self.names.get(id(p), f"#{id(p)}"), {k: [] for k in self.KEYS})
            row["lr"].append(float(lr))
            row["grad"].append(float(p.grad.norm()))

    @torch.no_grad()
    def _post(self, opt, args, kwargs) -> None:
        if id(opt) in self._halves:
            return
        for _, p in self._stepped(opt):
            row = self.rows[self.names.get(id(p), f"#{id(p)}")]
            row["update"].append(float((p - self._before.pop(id(p))).norm()))
            row["norm"].append(float(p.norm()))

    def close(self) -> dict:
        for hook in self._hooks:
            hook.remove()
        return self.rows


@torch.no_grad()
def load_our_init(model: torch.nn.Module, path: str) -> None:
    """Our head's initial weights (`save_init`) copied into speculators' model in place (its optimizers, built on
    these parameters, have taken no step yet): every parameter it trains must have one of ours, but the RMSNorm
    before fc, which ours lacks and which it starts at ones as ours would."""
    from safetensors.torch import load_file

    ours = {their_name(n): t for n, t in load_file(path).items()}
    for name, p in model.named_parameters():
        if name in ours:
            p.copy_(ours[name])
        elif p.requires_grad and name != "input_norm.weight":
            raise SystemExit(f"--their-init ours: our head has no weight for speculators' {name}")


def their_name(ours: str) -> str:
    """speculators' name of one of our head's parameters (the engines' layout against its module tree)."""
    return ours.replace("midlayer.", "layers.0.").replace("fc.norm.", "input_norm.").replace("fc.proj.", "fc.")


def compare_step_logs(ours: dict, theirs: dict, at=(1, 2, 3, 4, 10, 50, 100, 150, 200, 250, 299, 300)) -> dict:
    """Two trainings' step logs (`StepLog`) side by side, per parameter both stepped: at the steps `at`, the two
    learning rates, gradient norms (after clipping), update norms and weight norms; and over the whole run the
    median of the ratio ours / theirs of each. The same algorithm on the same batches from the same head keeps
    every ratio near 1; different ones part at the step and in the quantity that names the piece."""
    out = {}
    for name, o in ours.items():
        t = theirs.get(their_name(name))
        if t is None:
            continue
        n = min(len(o["update"]), len(t["update"]))
        ratios = {
            k: statistics.median(a / b for a, b in zip(o[k][:n], t[k][:n]) if b) if n else None for k in StepLog.KEYS
        }
        steps = {s: {k: (o[k][s - 1], t[k][s - 1]) for k in StepLog.KEYS} for s in at if s <= n}
        out[name] = {"steps": n, "median_ratio": ratios, "at": steps}
    return out


def print_step_logs(label: str, compared: dict) -> None:
    print(f"\n### step logs: {label} (ours / theirs)\n")
    print("| parameter | steps | median ratio: lr | grad | update | norm |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, c in compared.items():
        r = c["median_ratio"]
        cells = [f"{r[k]:.3f}" if r[k] is not None else "n/a" for k in StepLog.KEYS]
        print(f"| {name} | {c['steps']} | " + " | ".join(cells) + " |")
    for name, c in compared.items():
        rows = ", ".join(
            f"{s}: lr {v['lr'][0]:.2e}/{v['lr'][1]:.2e} g {v['grad'][0]:.3f}/{v['grad'][1]:.3f} "
            f"u {v['update'][0]:.2e}/{v['update'][1]:.2e} w {v['norm'][0]:.2f}/{v['norm'][1]:.2f}"
            for s, v in c["at"].items()
        )
        print(f"- {name}: {rows}")


# ----------------------------------------------------------------------------------------------------------------
# Data: one teacher dataset, written in both formats


def head_recipe(args):
    """(the data config, its EAGLE-3 candidate's resolved config): the recipe ours trains and the data it reads."""
    from specdistill.config import load_config

    overrides = (SMOKE_OVERRIDES + [f"output_dir={args.out / 'run'}"] if args.smoke else []) + args.overrides
    cfg = load_config(args.config, overrides)
    cand = cfg.candidate_configs.get(args.candidate)
    if cand is None or cand.draft.init != "eagle3" or cand.distill.teacher != "cache":
        raise SystemExit(
            f"{args.config} has no EAGLE-3 candidate {args.candidate!r} training from the offline cache "
            "(draft.init: eagle3, distill.teacher: cache); pass --candidate NAME"
        )
    return cfg, cand


def write_speculators_data(target, cand, data, out: Path) -> dict:
    """Our teacher data in speculators' offline format under `out` (module docstring), once: a rerun finds it by its
    marker. Returns what the trainers are given: the folder, the vocabulary files, the split sizes, the tokens."""
    import datasets
    from safetensors.torch import save_file

    from distill.data import load_teacher_data
    from distill.eagle3 import cache_aux_index, cached_layers_of, choose_draft_vocab, response_token_counts
    from specdec_runtime.eagle3 import default_aux_layers, vocab_maps

    L, H, V = target.config.num_hidden_layers, target.config.hidden_size, target.config.vocab_size
    aux = list(cand.draft.aux_layers or default_aux_layers(L))
    size, max_len = min(cand.draft.draft_vocab_size, V), cand.train.max_seq_len
    key = {"train": str(data.train), "validation": str(data.validation), "aux_layers": aux, "max_seq_len": max_len}
    key |= {"draft_vocab_size": size}
    marker = out / ".complete"
    if marker.is_file() and json.loads(marker.read_text())["key"] == key:
        return json.loads(marker.read_text())["info"]

    ids, coverage = choose_draft_vocab(response_token_counts(data.train, V), size)
    d2t, t2d = vocab_maps(torch.tensor(ids), V)
    out.mkdir(parents=True, exist_ok=True)
    files = {"d2t": out / f"d2t-{size}.npy", "t2d": out / f"t2d-{size}.npy"}
    np.save(files["d2t"], d2t.numpy())
    np.save(files["t2d"], t2d.numpy())

    # The target's last pre-norm hidden state, which speculators' loss turns into its teacher logits: the input of
    # the final norm (HF's hidden_states[L] is its output).
    last = {}
    hook = target.base_model.norm.register_forward_pre_hook(lambda _, args: last.update(h=args[0]))
    columns = {"input_ids": [], "loss_mask": [], "seq_len": []}
    index, worst = cache_aux_index(cached_layers_of(data.train), aux, H), 0.0
    (out / "hidden_states").mkdir(exist_ok=True)
    try:
        for split in (data.train, data.validation):
            rows = load_teacher_data(split).select_columns(["input_ids", "prompt_len", "aux_hidden"])
            for row in rows.with_format("numpy"):
                tokens = row["input_ids"][:max_len].tolist()
                T = len(tokens)
                stored = torch.from_numpy(np.stack(row["aux_hidden"][:T]).astype(np.float16))[:, index]  # (T, 3H)
                with torch.inference_mode():
                    hidden = target(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
                # Both formats must hold the same layers: the stored states against this pass's, to fp16 rounding.
                fresh = torch.cat([hidden[i][0] for i in aux], -1)
                torch.testing.assert_close(stored.float(), fresh, rtol=5e-3, atol=5e-3)
                worst = max(worst, float((stored.float() - fresh).abs().max()))
                states = torch.cat([stored.float().view(T, 3, H), last["h"][0, :, None].float()], 1)  # (T, 4, H)
                n = len(columns["seq_len"])
                save_file(
                    {"hidden_states": states.contiguous(), "token_ids": torch.tensor(tokens, dtype=torch.long)},
                    out / "hidden_states" / f"hs_{n}.safetensors",
                )
                columns["input_ids"].append(tokens)
                columns["loss_mask"].append([int(t >= row["prompt_len"]) for t in range(T)])
                columns["seq_len"].append(T)
            if split == data.train:
                n_train = len(columns["seq_len"])
    finally:
        hook.remove()
    table = datasets.Dataset.from_dict(columns)
    table.set_format("torch")  # what its loader indexes: tensors (save_to_disk keeps the format)
    table.save_to_disk(str(out / "dataset"))
    lengths = columns["seq_len"][:n_train]
    info = {
        "path": str(out / "dataset"),
        "hidden_states": str(out / "hidden_states"),
        "d2t": str(files["d2t"]),
        "t2d": str(files["t2d"]),
        "draft_vocab": ids,
        "draft_vocab_size": size,
        "coverage": coverage,
        "aux_layers": aux,
        "train_rows": n_train,
        "validation_rows": len(columns["seq_len"]) - n_train,
        "train_tokens": sum(lengths),
        "train_response_tokens": sum(sum(m) for m in columns["loss_mask"][:n_train]),
        "mean_train_len": sum(lengths) / n_train,
        "max_train_len": max(lengths),
        "aux_max_abs_diff": worst,  # stored fp16 vs recomputed fp32: rounding only
    }
    marker.write_text(json.dumps({"key": key, "info": info}))
    return info


ROWS = ("own", "ours", "next", "in-vocab")


def rows_mask(response: torch.Tensor, in_vocab: torch.Tensor, rows: str) -> torch.Tensor:
    """speculators' loss mask (T,) as its offline format stores it, before its shift_batch, that trains `rows`, from
    response (T,) (token t is a response token) and in_vocab (T,) (the target's argmax at position t lies in the
    draft vocabulary). Its shift_batch trains row t when mask[t + 1] is set, row t predicting token t + 2 from the
    target's distribution at t + 1. `own`: its own rows, token t + 1 (the one the row reads) a response token; `ours`
    (`distill.eagle3.unrolled_steps`): token t + 2 (the one it predicts) a response token and the argmax at t + 1 in
    the vocabulary; `next`: the first half only; `in-vocab`: its own rows less those whose argmax lies outside."""
    if rows not in ROWS:
        raise ValueError(f"rows must be one of {ROWS}, not {rows!r}")
    mask = response if rows in ("own", "in-vocab") else torch.cat([response[1:], response.new_zeros(1)])
    return mask & in_vocab if rows in ("ours", "in-vocab") else mask


def their_rows_dataset(target, spec_data: dict, rows: str) -> str:
    """A copy of speculators' dataset (the `datasets` folder; the hidden states are shared) whose loss mask holds
    `rows_mask(.., rows)` instead of its own (--their-rows), for an arm of their trainer that differs from theirs in
    the rows trained only. The argmax is the target's, computed once more here; a rerun finds the copy by its
    marker."""
    import datasets

    out = Path(spec_data["path"]).with_name(f"dataset-rows-{rows}")
    marker, key = out / ".complete", json.dumps({"rows": rows, "data": spec_data["path"], "d2t": spec_data["d2t"]})
    if marker.is_file() and marker.read_text() == key:
        return str(out)
    t2d = torch.from_numpy(np.load(spec_data["t2d"])).bool()
    table = datasets.load_from_disk(spec_data["path"]).with_format(None)
    masks = []
    for ids, own in zip(table["input_ids"], table["loss_mask"]):
        with torch.inference_mode():
            in_vocab = t2d[target(input_ids=torch.tensor([ids])).logits[0].argmax(-1)]  # (T,)
        masks.append(rows_mask(torch.tensor(own, dtype=torch.bool), in_vocab, rows).long().tolist())
    copy = datasets.Dataset.from_dict({"input_ids": table["input_ids"], "loss_mask": masks})
    copy = copy.add_column("seq_len", table["seq_len"])
    copy.set_format("torch")  # as write_speculators_data saves it
    copy.save_to_disk(str(out))
    marker.write_text(key)
    return str(out)


# ----------------------------------------------------------------------------------------------------------------
# The two recipes of each pair


def our_recipe(
    cand, pair: str, out: Path, steps: int, ablate: list[str] = (), pass_tokens: int = 0, seed: int | None = None
):
    """The candidate's resolved config for one of our trainings: its recipe (`same`: as speculators runs it where
    that is fixed there, and with `pass_tokens`, speculators' --total-seq-len, as the most tokens one forward and
    backward pass holds: train.max_micro_batch_tokens), one process, validation and a checkpoint only after the
    last step; `ablate`, `key=value` overrides on top (--ablate: the ablation's training); `seed` (--training-seed)
    replaces the candidate's seed: the head's initialisation and the order of its batches."""
    from distill.students import HEAD_VARIANTS
    from specdistill.config import RootConfig, from_dict, parse_override, set_dotted, to_dict

    data = to_dict(cand)
    fixed = {
        "output_dir": str(out),
        "candidates": [],
        "tracking.backend": "none",
        "train.max_steps": steps,
        "train.grad_accum": 1,
        "train.mixed_precision": "no",
        "train.eval_every": steps,
        "train.save_every": steps,
        "train.log_every": 1,
        "train.keep_last": 1,
        "train.resume": False,
    }
    if seed is not None:
        fixed["seed"] = seed
    if pair == "same":  # speculators clips at 1 and always freezes lm_head; its cosine ends at 0
        fixed |= {"train.min_lr_ratio": 0.0, "train.weight_decay": 0.0, "train.max_grad_norm": 1.0}
        fixed |= {"train.optimizer": "adamw"}
        fixed |= {"draft.freeze_lm_head": True}
        fixed |= {"distill.loss_on_prompt": False}  # its loss mask: the response tokens (the quickstart's head: all)
        fixed |= {f"draft.{k}": False for k in HEAD_VARIANTS}  # its --no-norm-* flags: the engines' layout
        if pass_tokens:  # a step of ours holds train.batch_size sequences whatever their length; its passes do not
            fixed |= {"train.max_micro_batch_tokens": pass_tokens}
    for key, value in fixed.items():
        set_dotted(data, key, value)
    for text in ablate:
        set_dotted(data, *parse_override(text))
    return from_dict(RootConfig, data)


def their_flags(cand, pair: str, spec_data: dict, verifier: str, save: Path, steps: int, seed: int = SEED) -> list:
    """`speculators train` flags (less --total-seq-len and --epochs, which the child sets from its sampler,
    `their_packing`): the shared settings, and for `same` our recipe's; `recommended` leaves the rest at speculators'
    defaults."""
    rows = spec_data["train_rows"] + spec_data["validation_rows"]
    flags = [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", verifier,
        "--data-path", spec_data["path"],
        "--hidden-states-path", spec_data["hidden_states"],
        "--save-path", str(save),
        "--log-dir", str(save.parent / "logs"),
        "--d2t-path", spec_data["d2t"],
        "--t2d-path", spec_data["t2d"],
        "--draft-vocab-size", str(spec_data["draft_vocab_size"]),
        "--target-layer-ids", *map(str, spec_data["aux_layers"]),
        "--ttt-steps", str(cand.draft.ttt_depth),
        "--lr", str(cand.train.lr),
        "--max-steps", str(steps),
        "--train-data-ratio", str((spec_data["train_rows"] + 0.5) / rows),  # int(rows * ratio) = the train rows
        "--hidden-states-dtype", "float32",
        "--num-workers", "0",
        "--draft-attn-impl", "sdpa",
        "--loss-implementation", "eager",
        "--on-missing", "raise",
        "--seed", str(seed),  # its initialisation and its sampler's order
        "--log-freq", "1",
        "--no-resume-from-checkpoint",
    ]  # fmt: skip
    if pair == "same":
        flags += [
            "--optimizer", "adamw",
            "--weight-decay", "0",
            "--scheduler-type", "cosine",
            "--scheduler-warmup-steps", str(cand.train.warmup_steps),
            "--ttt-step-loss-decay", str(cand.draft.ttt_decay),
            "--loss-fn", "kl_div",
            "--no-norm-before-residual",
            "--no-norm-before-fc",
            "--no-norm-output",
            "--full-attention-indices", "0",
        ]  # fmt: skip
    return flags


def with_flags(flags: list[str], settings: list[str]) -> list[str]:
    """`flags` with each `name=value` (`--name value`) or switch (`--name`) of `settings` set: a flag already there
    is replaced (a switch `--no-x` replaces `--x` too, and the other way round), a new one appended."""
    out = list(flags)
    for setting in settings:
        name, _, value = setting.lstrip("-").partition("=")
        base = name.removeprefix("no-")
        forms = {f"--{base}", f"--no-{base}"}
        for i, flag in enumerate(out):
            if flag in forms:  # drop it and, for a valued flag, the values up to the next flag
                end = i + 1
                while end < len(out) and not out[end].startswith("--"):
                    end += 1
                del out[i:end]
                break
        out += [f"--{name}", *([value] if value else [])]
    return out


def head_layout(d) -> str:
    """Our head's layout in words: the engines' original EAGLE-3 one, or with speculators' variants (draft.*)."""
    return ", ".join(
        [
            "residual after hidden_norm" if d.norm_before_residual else "residual before hidden_norm",
            "RMSNorm before fc" if d.norm_before_fc else "no norm before fc",
            "normed outputs fed back" if d.norm_output else "pre-norm outputs fed back",
            "full attention",
        ]
    )


def recipes(cand, total_seq_len: int) -> dict:
    """What each side of each pair trains with, for the JSON (the overrides and flags above, in words)."""
    t, d = cand.train, cand.draft
    shared = {
        "aux_layers": d.aux_layers,
        "ttt_depth": d.ttt_depth,
        "lr": t.lr,
        "batch": f"ours {t.batch_size} sequences{' packed in one row' if d.pack_sequences else ', padded'}; "
        f"speculators up to {total_seq_len} packed tokens",
        "precision": "fp32",
    }
    loss_ours = f"{cand.distill.objective} over the top-{cand.data.teacher_cache_top_k} cache, draft vocabulary"
    loss_theirs = "kl_div over the target's exact logits, draft vocabulary, response (loss-mask) positions"
    positions = "prompt and response positions" if cand.distill.loss_on_prompt else "response positions"
    engines = "residual before hidden_norm, no norm before fc, pre-norm outputs fed back, full attention"  # `same`
    same = {
        "optimizer": "AdamW, no weight decay, clipping at 1",
        "schedule": f"linear warm-up {t.warmup_steps} steps, cosine to 0",
        "ttt_decay": d.ttt_decay,
        "lm_head": "frozen",
        "head": engines,
    }
    ours = {
        "optimizer": (
            f"Muon (weight decay {t.muon_weight_decay}) on 2-D weights + AdamW (weight decay {t.weight_decay})"
            if t.optimizer == "muon"
            else f"AdamW, weight decay {t.weight_decay}"
        )
        + f", clipping at {t.max_grad_norm}",
        "schedule": f"linear warm-up {t.warmup_steps} steps, cosine to {t.min_lr_ratio} x lr",
        "ttt_decay": d.ttt_decay,
        "lm_head": "frozen" if d.freeze_lm_head else "trained",
        "head": head_layout(d),
    }
    theirs = {
        "optimizer": "Muon (momentum 0.95, weight decay 0.1) on 2-D weights + AdamW (weight decay 0.01), clipping at 1",
        "schedule": "linear, 1 % warm-up",
        "ttt_decay": 1.0,
        "lm_head": "frozen",
        "head": "residual after hidden_norm, RMSNorm before fc, normed outputs fed back, sliding window 2048",
    }
    return {
        "same": {
            "shared": shared,
            "ours": same | {"loss": f"{loss_ours}, response positions", "passes": f"<= {total_seq_len} tokens each"},
            "speculators": same | {"loss": loss_theirs},
        },
        "recommended": {
            "shared": shared,
            "ours": ours | {"loss": f"{loss_ours}, {positions}"},
            "speculators": theirs | {"loss": loss_theirs},
        },
    }


# ----------------------------------------------------------------------------------------------------------------
# Trainers (each in its own process: --child ours | speculators)


def run_ours(spec: dict) -> dict:
    """`train.loop.distill` on the recipe's config: wall time between optimizer steps, peak RSS reset when its loop
    starts and read at its closing validation (after the last step)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import train.loop as loop
    from distill.data import TeacherData
    from specdistill.config import load_config
    from specdistill.pipeline import distill_candidate

    cfg = load_config(spec["config"])
    marks = {}
    train, validate = loop.DistillRecipe.train, loop.validation.validate

    def train_measured(self):
        marks["setup_peak_rss_mb"] = peak_rss_mb()
        reset_peak_rss()
        marks["start"] = time.perf_counter()
        return train(self)

    def validate_after_training(*a, **kw):
        marks.setdefault("peak_rss_mb", peak_rss_mb())  # eval_every = max_steps: after the last step only
        return validate(*a, **kw)

    loop.DistillRecipe.train, loop.validation.validate = train_measured, validate_after_training
    log = StepLog() if spec.get("step_log") else None
    build = loop.build_optimizer

    def build_logged(student, train_cfg):  # the loop's own call, on the student it is about to train
        if log is not None:
            log.name(student)
        if spec.get("save_init"):  # its initial weights, for speculators' arm to start from (--their-init ours)
            from safetensors.torch import save_file

            save_file({n: p.detach().contiguous() for n, p in student.named_parameters()}, spec["save_init"])
        return build(student, train_cfg)

    loop.build_optimizer = build_logged
    steps = []  # (optimizer, when) of every step; train.optimizer=muon steps its two halves inside its own step
    hook = register_optimizer_step_post_hook(lambda opt, *_: steps.append((opt, time.perf_counter())))
    cand = distill_candidate(cfg, spec["name"], TeacherData(Path(spec["train"]), Path(spec["validation"])))
    hook.remove()
    halves = {id(h) for opt, _ in steps for h in getattr(opt, "halves", ())}
    ends = [when for opt, when in steps if id(opt) not in halves]
    return {
        "step_s": [b - a for a, b in zip([marks["start"], *ends], ends)],
        "step_tokens": our_step_tokens(spec["train"], cfg.train.max_seq_len, cfg.train.batch_size, cfg.seed, len(ends)),
        "peak_rss_mb": marks["peak_rss_mb"],
        "setup_peak_rss_mb": marks["setup_peak_rss_mb"],
        "process_peak_rss_mb": max(marks["setup_peak_rss_mb"], peak_rss_mb()),
        "head": str(cand / "checkpoints" / f"step-{len(ends):06d}"),
        "draft_vocab": json.loads((cand / "draft_vocab.json").read_text())["ids"],
    } | ({"step_log": log.close()} if log is not None else {})


def our_step_tokens(train: str | Path, max_seq_len: int, batch_size: int, seed: int, steps: int) -> list[int]:
    """Tokens of the batches our loop draws in its first `steps` steps (`distill.batches`: one process, grad_accum
    1), each sequence cut at max_seq_len."""
    from distill.batches import epoch_order
    from distill.data import load_teacher_data

    ds = load_teacher_data(Path(train)).select_columns(["input_ids"])
    lengths = [min(len(x), max_seq_len) for x in ds["input_ids"]]
    per_epoch, tokens = len(ds) // batch_size, []
    for step in range(steps):
        epoch, batch = divmod(step, per_epoch)
        rows = epoch_order(len(ds), seed, epoch)[batch * batch_size : (batch + 1) * batch_size]
        tokens.append(sum(lengths[i] for i in rows))
    return tokens


def cpu_trainer(trainer) -> type:
    """speculators' `Trainer` (module `trainer`: speculators.train.trainer) on the CPU. Its __init__ sets `local_rank`
    (a CUDA ordinal) and `device_type` ("cuda" when no accelerator is found); it moves the model and every batch
    with `.to(self.local_rank)` under `torch.autocast(self.device_type, ...)`: here both read as the CPU, and the
    assignments are ignored. Its per-step timer (`_StepTimer`, on at every --log-freq step) synchronises with
    `torch.accelerator.synchronize()`, which raises without an accelerator: it is swapped for one that reads the
    clock only (CPU work is done when the call returns). Nothing else of the trainer is touched."""

    class CpuStepTimer(trainer._StepTimer):
        def mark(self, name: str) -> None:
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self) -> float | None:
            return time.perf_counter() if self.enabled else None

    trainer._StepTimer = CpuStepTimer  # train_epoch builds its timer from the module's name

    class CpuTrainer(trainer.Trainer):
        local_rank = property(lambda self: torch.device("cpu"), lambda self, value: None)
        device_type = property(lambda self: "cpu", lambda self, value: None)

    return CpuTrainer


def their_packing(data_path: str, rows: int, steps: int, tokens_per_step: float, seed: int = SEED) -> tuple[int, int]:
    """(--total-seq-len, --epochs) for speculators' packing sampler over the training rows: the smallest length (at
    least the longest row, which it would cut) whose first `steps` batches hold `tokens_per_step` tokens on average
    (our batches' mean), and the epochs those batches span. No more epochs are asked: its loop stops at --max-steps
    inside an epoch but still starts every later epoch (one more step each)."""
    import datasets
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = datasets.load_from_disk(data_path).with_format(None)["seq_len"][:rows]
    S = max(lengths)
    while True:
        sampler = MultipackDistributedBatchSamplerV2(S, lengths, num_replicas=1, rank=0, seed=seed)
        batches, epochs = [], 0
        while len(batches) < steps:
            sampler.set_epoch(epochs)
            batches, epochs = batches + list(sampler), epochs + 1
        if statistics.fmean(sum(lengths[i] for i in b) for b in batches[:steps]) >= tokens_per_step:
            return S, epochs
        S = max(S + 1, round(S * 1.02))


def their_spec(
    tag: str, flags: list, save: Path, steps: int, spec_data: dict, tokens_per_step: float, seed: int, batch_size=0
):
    """The spec of one speculators training (`run_speculators`): its flags and what its sampler needs; with
    `batch_size` (--their-batches ours) it draws our loop's batches instead of packing its own."""
    spec = {
        "tag": tag,
        "flags": flags,
        "save": str(save),
        "steps": steps,
        "data_path": spec_data["path"],
        "train_rows": spec_data["train_rows"],
        "tokens_per_step": tokens_per_step,
        "seed": seed,
    }
    return spec | {"our_batches": batch_size} if batch_size else spec  # a finished training's spec stays its own


def our_batches(data_path: str, rows: int, steps: int, batch_size: int, seed: int) -> tuple[list, int, int]:
    """(per epoch the batches of training rows our loop draws, `distill.batches`: one process, grad_accum 1; the
    --total-seq-len that holds the largest of the first `steps`; the epochs they span). Their training split is
    our training rows in our order (`write_speculators_data`), so a row index means the same row on both sides."""
    import datasets

    from distill.batches import epoch_order

    lengths = datasets.load_from_disk(data_path).with_format(None)["seq_len"][:rows]
    per_epoch = rows // batch_size
    epochs = -(-steps // per_epoch)
    batches = []
    for epoch in range(epochs):
        order = epoch_order(rows, seed, epoch)
        batches.append([order[b * batch_size : (b + 1) * batch_size] for b in range(per_epoch)])
    first = [b for epoch in batches for b in epoch][:steps]
    return batches, max(sum(lengths[i] for i in b) for b in first), epochs


def run_speculators(spec: dict) -> dict:
    """speculators' own CLI (`speculators.train.cli.main`) with its Trainer swapped for the CPU adapter plus the
    measurement: wall time between optimizer steps (the last of its optimizers), tokens of each packed batch (from
    its own sampler), peak RSS reset at the start of each epoch's steps and read at their end."""
    import speculators.train.cli as cli
    import speculators.train.trainer as trainer
    from speculators.train.config import TrainConfig

    log = StepLog() if spec.get("step_log") else None

    class Measured(cpu_trainer(trainer)):
        run = None  # the run's trainer, read once cli.main returns

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if log is not None:
                log.name(self.model)
            if spec.get("init_from"):  # --their-init ours: before its first step, the weights ours started from
                load_our_init(self.model, spec["init_from"])
            self.epochs, self.between = [], []  # per epoch its steps; the peaks outside them
            self.optimizers[-1].register_step_post_hook(lambda *_: self.epochs[-1]["ends"].append(time.perf_counter()))
            Measured.run = self

        def train_epoch(self, epoch, **kwargs):
            lengths = self.train_loader.dataset.approx_lengths
            batches = self.train_loader.batch_sampler._generate_batches(epoch)  # what its loader yields this epoch
            self.between.append(peak_rss_mb())  # setup, or the last epoch's validation and checkpoint
            reset_peak_rss()
            self.epochs.append(
                {"start": time.perf_counter(), "ends": [], "tokens": [sum(lengths[i] for i in b) for b in batches]}
            )
            super().train_epoch(epoch, **kwargs)
            self.epochs[-1]["peak"] = peak_rss_mb()

    if spec.get("our_batches"):  # --their-batches ours: its loop, model and loss on the rows of our steps
        from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2 as Sampler

        ours, S, epochs = our_batches(
            spec["data_path"], spec["train_rows"], spec["steps"], spec["our_batches"], spec["seed"]
        )
        packed = Sampler._generate_batches

        def generate(self, epoch):  # the training split's sampler only; validation keeps its packing
            if len(self.lengths) != spec["train_rows"]:
                return packed(self, epoch)
            return [np.array(b) for b in ours[epoch]]

        Sampler._generate_batches = generate
    else:
        S, epochs = their_packing(
            spec["data_path"], spec["train_rows"], spec["steps"], spec["tokens_per_step"], spec["seed"]
        )
    cli.Trainer = Measured
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")  # no accelerator to pin for
        cli.main(TrainConfig.resolve([*spec["flags"], "--total-seq-len", str(S), "--epochs", str(epochs)]))
    run = Measured.run
    step_s = [b - a for e in run.epochs for a, b in zip([e["start"], *e["ends"]], e["ends"])]
    save = Path(spec["save"])
    return {
        "step_s": step_s,
        "step_tokens": [t for e in run.epochs for t in e["tokens"][: len(e["ends"])]],
        "peak_rss_mb": max(e["peak"] for e in run.epochs),
        "setup_peak_rss_mb": run.between[0],
        "process_peak_rss_mb": max(*run.between, peak_rss_mb(), *(e["peak"] for e in run.epochs)),
        "head": str(save / str(epochs - 1)),  # its last epoch's checkpoint: the weights after the last step
        "epochs": epochs,
        "total_seq_len": S,
    } | ({"step_log": log.close()} if log is not None else {})


def our_code() -> str:
    """A digest of our training code (every .py of distill/, train/, specdec_runtime/, specdistill/), so that a
    finished training of ours is reused only by the code that trained it."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for package in ("distill", "train", "specdec_runtime", "specdistill"):
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def our_spec(args, cand, pair: str, tag: str, steps: int, data, ablate: list[str] = (), pass_tokens: int = 0) -> dict:
    """The spec of one of our trainings: its config written under <out>/children, and what makes it reusable."""
    from specdistill.config import dump_yaml

    config = args.out / "children" / f"{tag}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    recipe = dump_yaml(our_recipe(cand, pair, args.out, steps, ablate, pass_tokens, args.training_seed))
    config.write_text(recipe)
    return {
        "tag": tag,
        "config": str(config),
        "recipe": recipe,  # so that a changed recipe (a new default too) is trained again
        "code": our_code(),  # and a change of the code that trains it
        "name": tag,
        "train": str(data.train),
        "validation": str(data.validation),
    }


def child(args, name: str, spec: dict) -> dict:
    """Run `--child name` in a fresh process with `spec`; returns its JSON result."""
    spec = spec | ({"step_log": True} if args.step_log else {})  # a training with its step log is its own
    folder = args.out / "children"
    folder.mkdir(parents=True, exist_ok=True)
    spec_path, result = folder / f"{spec['tag']}.spec.json", folder / f"{spec['tag']}.json"
    # a training finished with this very spec (an interrupted run, or one re-run with other --pairs) is reused:
    # trainings take most of the hour, and a result is only written after its last step. Its tokens/s are those of
    # the machine it ran on: --retrain trains again, so that both trainers' speeds come from one host.
    same = spec_path.is_file() and json.loads(spec_path.read_text()) == json.loads(json.dumps(spec))
    if same and result.is_file() and not args.retrain:
        print(f"  reusing the finished {spec['tag']} training ({result})", flush=True)
        return json.loads(result.read_text())
    spec_path.write_text(json.dumps(spec))
    result.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--child", name, "--spec", str(spec_path), "--result", str(result)]
    env = os.environ | {"TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (folder / f"{spec['tag']}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        sys.exit(f"the {spec['tag']} training failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(result.read_text())


def training_summary(run: dict, warmup_steps: int) -> dict:
    """tokens/s over the timed steps (the first `warmup_steps` left out) and the memory numbers of one training."""
    timed = slice(min(warmup_steps, len(run["step_s"]) - 1), None)
    seconds, tokens = sum(run["step_s"][timed]), sum(run["step_tokens"][timed])
    keys = ("peak_rss_mb", "setup_peak_rss_mb", "process_peak_rss_mb", "head", "total_seq_len")
    return {
        "tokens_per_s": tokens / seconds,
        "steps": len(run["step_s"]),
        "timed_s": seconds,
        "timed_tokens": tokens,
        "mean_step_tokens": statistics.fmean(run["step_tokens"]),
        **{k: run[k] for k in keys if k in run},
    }


def optimizer_step_seconds(head: Path, reps: int = 3) -> dict:
    """One optimizer step of speculators' recommended optimizer on the weights of a head its trainer saved (`head`:
    the folder with model.safetensors), against AdamW on the same weights: what makes the `recommended` pair slow on
    a CPU. The weights go to Muon or AdamW by speculators' own rule (`split_named_params_for_muon`), Muon built as
    `build_optimizers` builds it (torch.optim.Muon, its default Newton-Schulz steps and lr adjustment); frozen in
    training (embeddings, lm_head, the vocabulary maps) -> not optimised. Fastest of `reps` steps, random gradients."""
    from safetensors.torch import load_file
    from speculators.train.optimizers import split_named_params_for_muon

    module = torch.nn.Module()
    for name, tensor in load_file(str(Path(head) / "model.safetensors")).items():
        if tensor.is_floating_point() and not any(k in name for k in ("embed_tokens", "lm_head")):
            module.register_parameter(name.replace(".", "_"), torch.nn.Parameter(tensor.float()))
    muon, _ = split_named_params_for_muon(module)
    params = [p for _, p in muon]

    def fastest(opt) -> float:
        times = []
        for _ in range(reps):
            for p in params:
                p.grad = torch.randn_like(p)
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        return min(times)

    muon_s = fastest(torch.optim.Muon(params, lr=1e-3, adjust_lr_fn="match_rms_adamw"))
    adamw_s = fastest(torch.optim.AdamW(params, lr=1e-3))
    return {
        "muon_weights": {n: list(p.shape) for n, p in muon},
        "muon_step_s": muon_s,
        "adamw_step_s": adamw_s,
        "threads": torch.get_num_threads(),
    }


# ----------------------------------------------------------------------------------------------------------------
# Our loader against speculators' own model


def loader_check(folder: Path, target, tokens: list[int], ours=None) -> dict:
    """The head speculators saved, read by our loader (or `ours`, an `Eagle3Draft` read elsewhere) and by
    speculators' `Eagle3DraftModel`, both fp32, fed the target's aux states of `tokens`: the logits of every
    training-time-test step (our `distill.eagle3.ttt_logits` unroll, its own forward) must agree on every row whose
    tokens exist on both sides, with the same d2t."""
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    from distill.eagle3 import ttt_logits
    from specdec_runtime.eagle3 import Eagle3Draft, embed, target_aux_forward

    ours = ours if ours is not None else Eagle3Draft.from_pretrained(folder, dtype=torch.float32)
    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "sdpa"  # its CPU path; the kernel does not change the maths
    theirs = Eagle3DraftModel.from_pretrained(folder, config=config).float().eval()
    # Its checkpoint keeps a bf16 copy of the target's embeddings; engines (and our runtime) use the target's own.
    theirs._load_verifier_weights(overwrite_embed_tokens=True)
    depth = config.speculators_config.proposal_methods[0].speculative_tokens  # its --ttt-steps
    ids = torch.tensor([tokens])
    T = ids.shape[1]
    seen = []
    hook = theirs.lm_head.register_forward_hook(lambda module, args, out: seen.append(out[0].detach()))
    with torch.no_grad():
        _, aux = target_aux_forward(target, ids, ours.aux_layers(target.config.num_hidden_layers))
        mine = [logits[0] for _, logits in ttt_logits(ours, aux, embed(target, ids), depth)]  # (T, Vd) per step
        try:
            doc = torch.zeros(1, T - 1, dtype=torch.long)  # one document
            theirs(aux[:, : T - 1], ids[:, 1:], doc, position_ids=torch.arange(T - 1)[None], ttt_steps=depth)
        finally:
            hook.remove()
    # Step j's row t reads token t + 1 + j: rows past T - 2 - j read padding, which each side fills its own way.
    diff = max(float((seen[j][: T - 1 - j] - mine[j][: T - 1 - j]).abs().max()) for j in range(depth))
    same_vocab = torch.equal(ours.d2t, theirs.d2t.long())
    return {
        "max_abs_diff": diff,
        "steps": depth,
        "tokens": T,
        "same_d2t": same_vocab,
        "passed": same_vocab and diff <= LOADER_TOL,
    }


def both_heads(folder: Path, target) -> tuple:
    """(ours, theirs, TTT depth, aux layers): one head (the folder speculators saved, in the engines' layout) read by
    both trainers' model classes, fp32, training mode, lm_head frozen on both sides."""
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    from specdec_runtime.eagle3 import Eagle3Draft

    ours = Eagle3Draft.from_pretrained(folder, dtype=torch.float32).train()
    ours.lm_head.weight.requires_grad_(False)  # frozen on both sides
    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "sdpa"
    theirs = Eagle3DraftModel.from_pretrained(folder, config=config).float().train()
    theirs._load_verifier_weights(overwrite_embed_tokens=True)
    depth = config.speculators_config.proposal_methods[0].speculative_tokens
    return ours, theirs, depth, ours.aux_layers(target.config.num_hidden_layers)


def matched_params(ours, theirs) -> dict:
    """{our name: (our parameter, theirs)} for every parameter both train."""
    theirs_params = dict(theirs.named_parameters())
    pairs = {}
    for name, p in ours.named_parameters():
        q = theirs_params[their_name(name)]
        if p.requires_grad and q.requires_grad:
            pairs[name] = (p, q)
    return pairs


def both_losses(ours, theirs, target, rows: list[dict], depth: int, aux_layers, *, ttt_decay, their_rows) -> tuple:
    """(our loss, theirs, our response tokens, their masked rows) on one packed batch of `rows` ({"input_ids",
    "prompt_len"}), the teacher the target online, each side as its trainer computes it: ours
    `distill.eagle3.eagle3_loss` (the sum over the batch's rows / its response tokens), theirs
    `Eagle3DraftModel.forward` on the rows `shift_batch` makes and its collate packs with document ids (the mean over
    its loss-mask rows, per unrolled step), its mask holding `rows_mask(.., their_rows)`."""
    from speculators.losses import resolve_loss_config

    from distill.batches import IGNORE
    from distill.config import DistillConfig
    from distill.eagle3 import collate_eagle3, draft_targets, eagle3_loss, frozen_embedding
    from distill.students import DraftConfig
    from specdec_runtime.eagle3 import target_aux_forward

    batch = collate_eagle3(rows, max_seq_len=1 << 30, pad_id=0, topk=False)
    items = int((batch["labels"] != IGNORE).sum())
    draft_cfg = DraftConfig(init="eagle3", ttt_depth=depth, ttt_decay=ttt_decay, pack_sequences=True)
    embed, online = frozen_embedding(target, "cpu"), DistillConfig(teacher="online")
    our_loss = eagle3_loss(ours, embed, target, batch, items, draft_cfg, online, None, aux_layers=aux_layers)

    # theirs: per row what its offline format stores (aux states, the last pre-norm state, the loss mask), through
    # its shift_batch, then concatenated with document ids as its collate packs them
    last = {}
    hook = target.base_model.norm.register_forward_pre_hook(lambda _, args: last.update(h=args[0]))
    parts = []
    try:
        for d, row in enumerate(rows):
            ids = torch.tensor([row["input_ids"]])
            T = ids.shape[1]
            with torch.no_grad():
                logits, aux = target_aux_forward(target, ids, aux_layers)
            response = torch.arange(T) >= row["prompt_len"]  # (T,)
            in_vocab = draft_targets(ours, logits.float(), None)[1][0]  # (T,): the argmax at t in the vocabulary
            mask = rows_mask(response, in_vocab, their_rows)[None, 1:]  # what its shift_batch keeps
            parts.append((aux[:, :-1], ids[:, 1:], torch.full((1, T - 1), d), mask, last["h"].float()[:, 1:]))
    finally:
        hook.remove()
    aux, ids, docs, mask, states = (torch.cat(x, 1) for x in zip(*parts))
    position = torch.cat([torch.arange(1, ids.shape[1] + 1)[None] for ids in (p[1] for p in parts)], 1)
    their_loss = theirs(
        aux, ids, docs, loss_mask=mask, position_ids=position, verifier_last_hidden_states=states, ttt_steps=depth,
        ttt_step_loss_decay=ttt_decay, loss_config=resolve_loss_config("kl_div", "eager"),
    )[1]  # fmt: skip
    return our_loss, their_loss, items, int(mask.sum())


def loss_check(folder: Path, target, rows: list[dict], *, ttt_decay: float = 1.0, their_rows: str = "ours") -> dict:
    """Both trainers' loss on one packed batch of `rows` from one head (`both_heads`, `both_losses`), fp32: the
    gradient of every parameter both train, as the cosine between the two and the ratio of their norms.

    The rows each side trains differ by design; `their_rows` names those theirs trains (`rows_mask`). With `ours`
    (the default) the gradients must be proportional, the ratio their masked rows against our response tokens (the
    counts each side divides by); with its own rows, one place earlier whatever the argmax, they are not."""
    ours, theirs, depth, aux_layers = both_heads(folder, target)
    our_loss, their_loss, items, masked = both_losses(
        ours, theirs, target, rows, depth, aux_layers, ttt_decay=ttt_decay, their_rows=their_rows
    )
    (our_loss + their_loss).backward()  # disjoint graphs: each model gets its own loss's gradient
    grads = {}
    for name, (p, q) in matched_params(ours, theirs).items():
        if p.grad is None or q.grad is None:
            continue
        g, h = p.grad.flatten().double(), q.grad.flatten().double()
        grads[name] = {"cosine": float(g @ h / (g.norm() * h.norm())), "ratio": float(g.norm() / h.norm())}
    return {"grads": grads, "our_rows": items, "their_rows": masked, "depth": depth}


def trajectory_check(
    folder: Path, target, batches: list[list[dict]], *, optimizer: str = "muon", lr: float = 1e-3, ttt_decay=1.0
) -> list[dict]:
    """Both trainers' optimizer steps from one head on the same batches, their masks holding our rows: per step,
    the largest over parameters of |ours - theirs| / |theirs - start| (the weights' difference against how far
    they moved) and the two gradient norms before clipping. Each side steps as its trainer does: its loss, clipping
    at 1, then its optimizer as it builds it (`train.optimizers.build_optimizer`; speculators'
    `build_optimizers`), with one setting for both (`optimizer`, `lr` for AdamW and Muon, Muon's weight decay 0.1
    and AdamW's 0.01, speculators' defaults) and no schedule. Our loss is scaled by the counts' ratio (their mean
    over the rows against our sum over response tokens, `loss_check`), so both sides start each step from the same
    gradient and what is compared is the update: the same optimizer keeps the weights together (AdamW to float
    rounding; Muon to a few per cent, its Newton-Schulz iterations in bf16), a different one parts them."""
    from types import SimpleNamespace

    from speculators.train.optimizers import build_optimizers

    from train.optimizers import build_optimizer

    ours, theirs, depth, aux_layers = both_heads(folder, target)
    pairs = matched_params(ours, theirs)
    start = {name: q.detach().clone() for name, (_, q) in pairs.items()}
    settings = dict(optimizer=optimizer, lr=lr, weight_decay=0.01, muon_weight_decay=0.1)
    our_opt = build_optimizer(ours, SimpleNamespace(**settings))
    their_opts = build_optimizers(
        theirs,
        SimpleNamespace(
            **settings, muon_lr=lr, muon_momentum=0.95, muon_ns_steps=5, muon_adjust_lr_fn="match_rms_adamw"
        ),
    )
    steps = []
    for rows in batches:
        our_loss, their_loss, items, masked = both_losses(
            ours, theirs, target, rows, depth, aux_layers, ttt_decay=ttt_decay, their_rows="ours"
        )
        our_loss = our_loss * (items / max(masked, 1))  # their gradient exactly (`loss_check`): the update compared
        our_opt.zero_grad()
        for opt in their_opts:
            opt.zero_grad()
        (our_loss + their_loss).backward()
        norms = [float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)) for m in (ours, theirs)]
        our_opt.step()
        for opt in their_opts:
            opt.step()
        with torch.no_grad():
            apart = {n: float((p - q).norm() / (q - start[n]).norm().clamp(min=1e-30)) for n, (p, q) in pairs.items()}
        worst = max(apart, key=apart.get)
        steps.append({"apart": apart[worst], "param": worst, "grad_norm_ours": norms[0], "grad_norm_theirs": norms[1]})
    return steps


# ----------------------------------------------------------------------------------------------------------------
# Eval: every head against target-only, and each pair's heads against each other, on the same prompts


def measure_heads(target, tokenizer, heads: dict[str, Path], prompts, args, backend) -> dict:
    """{temperature: {head: {"target_only": runs, "speculative": runs}}}: one paired, repeated A/B per temperature
    with every head an arm (`eval.sweep.measure_arms`), each head loaded as `specdistill eval` loads a candidate."""
    from eval.results import Setting
    from eval.sweep import Bench, load_draft, measure_arms, resolve_candidates
    from specdec_runtime.backends import fast_model, plan_rows
    from specdec_runtime.loading import stop_token_ids

    backend = plan_rows(backend, 1, {1, 2, args.gamma + 1})
    drafts = {}
    for name, path in heads.items():
        (cand,) = resolve_candidates([path])
        assert cand.kind == "eagle3", f"{path} is read as a {cand.kind} draft"
        drafts[name] = fast_model(load_draft(cand, "cpu", "float32")[0], backend, draft=True)
    bench = Bench(
        fast_model(target, backend),
        args.max_new_tokens,
        stop_token_ids(target, tokenizer),
        SEED,
        args.repeats,
        args.warmup,
    )
    out = {}
    for T in args.temperatures:
        setting = Setting(T, "greedy" if T == 0 else "sample", args.gamma, None, 1)
        arms = measure_arms(bench, {name: (draft, setting) for name, draft in drafts.items()}, prompts)
        out[T] = {name: arm["runs"] for name, arm in arms.items()}
    return out


def per_prompt(runs) -> tuple[list, list]:
    """Per unit (a prompt at batch size 1), pooled over its repeats: (accepted, judged) and (tokens per verify step
    numerator, verify steps), the counts `acceptance_rate` and `mean_accepted_length` pool."""
    acc, tau = [], []
    for unit in runs:
        reqs = [r for stats in unit for r in stats.requests]
        accepted, steps = sum(sum(r.position_accepted) for r in reqs), sum(r.verify_steps for r in reqs)
        acc.append((accepted, sum(sum(r.position_reached) for r in reqs)))
        tau.append((sum(r.accepted for r in reqs) + steps, steps))
    return acc, tau


def head_metrics(runs: dict, gamma: int) -> dict:
    from specdec_runtime.ab import paired_metrics

    acc, tau = per_prompt(runs["speculative"])
    m = paired_metrics(runs["target_only"], runs["speculative"], gamma)
    return {
        "acceptance_rate": m["acceptance_rate"],
        "acceptance_rate_ci": bootstrap(acc),
        "mean_accepted_length": m["mean_accepted_length"],
        "mean_accepted_length_ci": bootstrap(tau),
        "speedup": m["speedup"],
        "speedup_ci": m["speedup_ci"],
        "units": m["units"],
    }


def head_difference(ours: dict, theirs: dict) -> dict:
    """Ours - speculators' on the same prompts, paired (the prompts resampled once for both), and the speed ratio."""
    from specdec_runtime.ab import paired_speedup

    (acc_o, tau_o), (acc_t, tau_t) = per_prompt(ours["speculative"]), per_prompt(theirs["speculative"])
    d_acc, ci_acc = paired_difference(acc_t, acc_o)
    d_tau, ci_tau = paired_difference(tau_t, tau_o)
    speed = paired_speedup(theirs["speculative"], ours["speculative"])  # their s/token over ours: ours' speed ratio
    return {
        "acceptance_rate": d_acc,
        "acceptance_rate_ci": ci_acc,
        "mean_accepted_length": d_tau,
        "mean_accepted_length_ci": ci_tau,
        "speed_ratio": speed["speedup"],
        "speed_ratio_ci": speed["speedup_ci"],
    }


# ----------------------------------------------------------------------------------------------------------------
# Parent: data, the trainings, the loader checks, the eval, the table


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="the data and our recipe (default configs/quickstart.yaml)")
    ap.add_argument("--candidate", default="eagle3", help="the config's EAGLE-3 candidate: our recipe")
    ap.add_argument("--out", type=Path, default=Path("runs/eagle3-vs-speculators"))
    ap.add_argument("--pairs", nargs="+", choices=PAIRS, default=list(PAIRS))
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of every training (default: ours')")
    ap.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of tokens/s")
    ap.add_argument("--prompts", type=int, default=20, help="first N builtin:test prompts (all categories)")
    ap.add_argument("--gamma", type=int, default=3, help="num_draft_tokens (chains)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls per arm before the A/B")
    ap.add_argument(
        "--ablate",
        action="append",
        metavar="KEY=VALUE",
        help="train one more head of ours: the first pair's recipe with this override (repeatable, e.g. "
        "--ablate distill.teacher=online), measured as one more arm of the same A/B",
    )
    ap.add_argument(
        "--ablate-speculators",
        action="append",
        metavar="FLAG[=VALUE]",
        help="train one more head of speculators: the first pair's flags with this one set, without its dashes "
        "(repeatable, e.g. --ablate-speculators optimizer=adamw --ablate-speculators no-norm-before-fc), measured "
        "as one more arm of the same A/B",
    )
    ap.add_argument(
        "--their-rows",
        choices=ROWS[1:],
        help="the speculators ablation arm (--ablate-speculators, or alone the first pair's flags) trains the rows "
        "this names instead of its own (`their_rows_dataset`): ours, next (the token predicted is a response token), "
        "in-vocab (its rows whose target argmax lies in the draft vocabulary)",
    )
    ap.add_argument(
        "--their-batches",
        choices=["ours"],
        help="the speculators ablation arm draws our loop's batches (our epoch order, train.batch_size sequences a "
        "step, --total-seq-len raised to hold the largest) instead of packing its own",
    )
    ap.add_argument(
        "--their-init",
        choices=["ours"],
        help="the speculators ablation arm starts from the very weights our ablation arm (--ablate) starts from, "
        "copied into its model before its first step (`load_our_init`)",
    )
    ap.add_argument("--smoke", action="store_true", help="random:tiny-llama, a few prompts and steps (the test)")
    ap.add_argument(
        "--retrain",
        action="store_true",
        help="train every arm again, even one finished with the same spec (its speed was measured on that machine)",
    )
    ap.add_argument(
        "--training-seed",
        type=int,
        default=None,
        help="seed of every training: ours' config `seed`, speculators' --seed (its initialisation and sampler); "
        "default the config's, for both. Another seed, in its own --out, measures how much the trainings "
        "themselves move the comparison, which the eval's intervals (over prompts) do not hold",
    )
    ap.add_argument(
        "--step-log",
        action="store_true",
        help="log every optimizer step of every training (per parameter: lr, gradient norm after clipping, update "
        "norm, weight norm: `StepLog`) and compare the trainers' logs step by step; a training with its log is "
        "trained anew (its spec differs)",
    )
    ap.add_argument("--train-only", action="store_true", help="train (and with --step-log compare), do not measure")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument(
        "--optimizer-step",
        type=Path,
        metavar="HEAD",
        help="only time one step of speculators' recommended optimizer (Muon) against AdamW on the weights of the "
        "head its trainer saved in HEAD (why the recommended pair is slow on a CPU), and exit",
    )
    ap.add_argument("--child", choices=TRAINERS, help=argparse.SUPPRESS)
    ap.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="dotted overrides of --config (e.g. data.num_samples=1)")
    args = ap.parse_intermixed_args(argv)
    if args.smoke:
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv or sys.argv[1:])}
        for key, value in SMOKE_ARGS.items():
            if key not in given:
                setattr(args, key, value)
    args.config = args.config or (SMOKE_CONFIG if args.smoke else "configs/quickstart.yaml")
    if args.their_init and not args.ablate:
        ap.error("--their-init ours starts speculators' ablation arm from our ablation arm's weights: give --ablate")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.optimizer_step:
        print(json.dumps(optimizer_step_seconds(args.optimizer_step), indent=1))
        return 0
    if args.child:
        run = {"ours": run_ours, "speculators": run_speculators}[args.child]
        args.result.write_text(json.dumps(run(json.loads(args.spec.read_text()))))
        return 0
    from specdec_runtime.cpu_tune import machine_info
    from specdec_runtime.loading import resolve_model_path
    from specdistill.pipeline import dist_state, eval_prompts, load_target, stage_data

    start = time.perf_counter()
    torch.manual_seed(SEED)
    cfg, cand = head_recipe(args)
    seed = cand.seed if args.training_seed is None else args.training_seed
    steps = args.steps or cand.train.max_steps
    dist = dist_state("cpu")
    loaded = load_target(cfg, dist)
    target, tokenizer, _ = loaded
    data = stage_data(cfg, dist, loaded)  # cached when `specdistill data CONFIG` wrote it
    spec_data = write_speculators_data(target, cand, data, args.out / "speculators-data")
    ours_tokens = our_step_tokens(data.train, cand.train.max_seq_len, cand.train.batch_size, seed, steps)
    verifier = resolve_model_path(cfg.target.model)[0]
    # speculators' packed step length: in pair `same` also the most tokens one pass of ours holds
    tokens_per_step = statistics.fmean(ours_tokens)
    pass_tokens = their_packing(spec_data["path"], spec_data["train_rows"], steps, tokens_per_step, seed)[0]

    trainings = {}
    for p, pair in enumerate(args.pairs):
        for who in TRAINERS if p % 2 == 0 else reversed(TRAINERS):  # ABBA over the pairs
            tag = f"{pair}-{who}"
            if who == "ours":
                spec = our_spec(args, cand, pair, tag, steps, data, pass_tokens=pass_tokens)
            else:
                save = args.out / "speculators" / pair / "checkpoints"
                flags = their_flags(cand, pair, spec_data, verifier, save, steps, seed)
                spec = their_spec(tag, flags, save, steps, spec_data, tokens_per_step, seed)
            print(f"[{time.perf_counter() - start:.0f} s] training {tag} ({steps} steps)", flush=True)
            trainings[tag] = child(args, who, spec)
    our_init = None
    if args.ablate:  # one more of ours: the first pair's recipe with the overrides, an arm of the same A/B
        tag = f"{args.pairs[0]}-ours-ablation"
        print(f"[{time.perf_counter() - start:.0f} s] training {tag} ({' '.join(args.ablate)})", flush=True)
        ablated = our_spec(args, cand, args.pairs[0], tag, steps, data, args.ablate, pass_tokens)
        if args.their_init:
            our_init = str(args.out / "children" / f"{tag}.init.safetensors")
            ablated["save_init"] = our_init
        trainings[tag] = child(args, "ours", ablated)
    if args.their_rows:  # the ablation arm of theirs reads a copy of its data with other loss-mask rows
        rows = their_rows_dataset(target, spec_data, args.their_rows)
        args.ablate_speculators = [*(args.ablate_speculators or []), f"data-path={rows}"]
    if their_changes(args):  # one more of theirs: the first pair's flags with these set
        tag, pair = f"{args.pairs[0]}-speculators-ablation", args.pairs[0]
        print(f"[{time.perf_counter() - start:.0f} s] training {tag} ({' '.join(their_changes(args))})", flush=True)
        save = args.out / "speculators" / f"{pair}-ablation" / "checkpoints"
        flags = with_flags(
            their_flags(cand, pair, spec_data, verifier, save, steps, seed), args.ablate_speculators or []
        )
        size = cand.train.batch_size if args.their_batches else 0
        spec = their_spec(tag, flags, save, steps, spec_data, tokens_per_step, seed, size)
        trainings[tag] = child(args, "speculators", spec | ({"init_from": our_init} if our_init else {}))

    if args.step_log or args.train_only:
        logs = step_log_report(args, trainings) if args.step_log else {}
        summaries = {tag: training_summary(run, args.warmup_steps) for tag, run in trainings.items()}
        for tag, t in summaries.items():
            print(f"{tag}: {t['tokens_per_s']:.0f} tokens/s, peak RSS {t['peak_rss_mb']:.0f} MiB in training")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            report = {"steps": steps, "training_seed": seed, "trainings": summaries, "step_logs": logs}
            args.json.write_text(json.dumps(report, indent=2))
        if args.train_only:
            return 0

    probe = load_teacher_row(data.validation, cand.train.max_seq_len, limit=64)
    prompts = eval_prompts("builtin:test", tokenizer, args.prompts, trained_on=cfg.data)
    heads = {tag: Path(run["head"]) for tag, run in trainings.items()}
    print(f"[{time.perf_counter() - start:.0f} s] measuring {len(heads)} heads on {len(prompts)} prompts", flush=True)
    measured = measure_heads(target, tokenizer, heads, prompts, args, cfg.target.backend)

    results = {}
    for pair in args.pairs:
        ours, theirs = trainings[f"{pair}-ours"], trainings[f"{pair}-speculators"]
        train = {who: training_summary(trainings[f"{pair}-{who}"], args.warmup_steps) for who in TRAINERS}
        train["tokens_per_s_ratio"] = train["ours"]["tokens_per_s"] / train["speculators"]["tokens_per_s"]
        for key in ("peak_rss_mb", "process_peak_rss_mb"):
            train[key.replace("_mb", "_ratio")] = train["ours"][key] / train["speculators"][key]
        evals = {}
        for T, runs in measured.items():
            o, t = runs[f"{pair}-ours"], runs[f"{pair}-speculators"]
            evals[f"T={T:g}"] = {
                "ours": head_metrics(o, args.gamma),
                "speculators": head_metrics(t, args.gamma),
                "difference": head_difference(o, t),
            }
        check = loader_check(Path(theirs["head"]), target, probe)
        goals = {
            "acceptance_at_least_theirs": all(e["difference"]["acceptance_rate_ci"][0] > -0.02 for e in evals.values()),
            "tokens_per_s_at_least_1.5x": train["tokens_per_s_ratio"] >= 1.5,
            "peak_memory_at_most_theirs": train["peak_rss_ratio"] <= 1.0,
        }
        same_vocab = ours["draft_vocab"] == spec_data["draft_vocab"]
        results[pair] = {
            "training": train,
            "eval": evals,
            "loader_check": check,
            "same_draft_vocab": same_vocab,
            "goals": goals,
            "recipes": recipes(cand, theirs["total_seq_len"])[pair],
        }
        if args.ablate and pair == args.pairs[0]:
            results[pair]["ablation"] = ablation_summary(args, trainings, measured, pair, "ours", args.ablate)
        if their_changes(args) and pair == args.pairs[0]:
            results[pair]["speculators_ablation"] = ablation_summary(
                args, trainings, measured, pair, "speculators", their_changes(args)
            )

    settings = {
        "config": args.config,
        "candidate": args.candidate,
        "target": cfg.target.model,
        "steps": steps,
        "training_seed": seed,
        "prompts": len(prompts),
        "prompt_source": "builtin:test",
        "gamma": args.gamma,
        "temperatures": args.temperatures,
        "draft_rules": {f"T={T:g}": "greedy" if T == 0 else "sample" for T in args.temperatures},
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "warmup_steps": args.warmup_steps,
        "speculators": importlib.metadata.version("speculators"),
        "machine": machine_info(probe=False),  # CPU model, ISA flags, cores, torch threads and version
        "smoke": args.smoke,
        "wall_s": time.perf_counter() - start,
    }
    data_info = {k: v for k, v in spec_data.items() if k != "draft_vocab"}
    data_info |= {"teacher_train": str(data.train), "teacher_validation": str(data.validation)}
    report = {"settings": settings, "data": data_info, "pairs": results}
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def step_log_report(args, trainings: dict) -> dict:
    """Each pair's two step logs compared (ours / theirs), and an ablation arm against the other trainer's
    ablation arm when both ran (the two trainers on one recipe), else against the other trainer's pair head."""
    pair = args.pairs[0]
    compared = {p: (f"{p}-ours", f"{p}-speculators") for p in args.pairs}
    arms = [f"{pair}-{who}-ablation" for who in TRAINERS]
    if any(arm in trainings for arm in arms):
        compared["ablation"] = tuple(arm if arm in trainings else f"{pair}-{who}" for arm, who in zip(arms, TRAINERS))
    report = {}
    for label, (ours, theirs) in compared.items():
        report[label] = {
            "ours": ours,
            "theirs": theirs,
            "compared": compare_step_logs(trainings[ours]["step_log"], trainings[theirs]["step_log"]),
            "validation_greedy_match_0": [validation_match(trainings[tag]) for tag in (ours, theirs)],
        }
        print_step_logs(f"{ours} / {theirs}", report[label]["compared"])
        ours_match, their_match = report[label]["validation_greedy_match_0"]
        print(f"validation, first draft step's greedy match: {ours_match} / {their_match}")
    return report


def validation_match(run: dict) -> float | None:
    """A finished training's greedy match of its first draft step on the validation split, from its own logs: ours'
    last `eval/greedy_match_0` in metrics.jsonl, speculators' `full_acc_0_epoch` of its last epoch's checkpoint
    (the same response tokens, each trainer's own rows)."""
    head = Path(run["head"])
    if (head / "val_metrics.json").is_file():
        return json.loads((head / "val_metrics.json").read_text()).get("full_acc_0_epoch")
    rows = [json.loads(line) for line in (head.parents[1] / "metrics.jsonl").read_text().splitlines()]
    return next((r["eval/greedy_match_0"] for r in reversed(rows) if "eval/greedy_match_0" in r), None)


def their_changes(args) -> list[str]:
    """What the speculators ablation arm changes: its flags (--ablate-speculators, --their-rows's data-path),
    `batches=ours` with --their-batches and `init=ours` with --their-init."""
    extra = [f"batches={args.their_batches}"] if args.their_batches else []
    return [*(args.ablate_speculators or []), *extra, *([f"init={args.their_init}"] if args.their_init else [])]


def ablation_summary(args, trainings: dict, measured: dict, pair: str, who: str, overrides: list[str]) -> dict:
    """An ablated head of `who` (--ablate: ours; --ablate-speculators: theirs) against the pair's two: its
    training, its metrics and, per temperature, the paired differences ablation - ours and ablation - speculators
    (against its own trainer's head: what the overrides changed)."""
    tag = f"{pair}-{who}-ablation"
    evals = {}
    for T, runs in measured.items():
        a = runs[tag]
        evals[f"T={T:g}"] = {
            "ablation": head_metrics(a, args.gamma),
            "minus_ours": head_difference(a, runs[f"{pair}-ours"]),
            "minus_speculators": head_difference(a, runs[f"{pair}-speculators"]),
        }
    training = training_summary(trainings[tag], args.warmup_steps)
    return {"trainer": who, "overrides": overrides, "training": training, "eval": evals}


def load_teacher_row(path: Path, max_len: int, *, limit: int) -> list[int]:
    """The first sequence of a teacher split, cut at `limit` tokens: the loader check's probe."""
    from distill.data import load_teacher_data

    return list(load_teacher_data(path)[0]["input_ids"][: min(max_len, limit)])


def ci(value: float | None, interval, fmt: str = "{:.3f}") -> str:
    if value is None:
        return "n/a"
    lo, hi = interval or (value, value)
    return f"{fmt.format(value)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def print_table(report: dict) -> None:
    s = report["settings"]
    m = s["machine"]
    print(
        f"\n{s['target']}, {s['steps']} steps per training, {s['prompts']} {s['prompt_source']} prompts, gamma "
        f"{s['gamma']}, {s['repeats']} repeats; {m['cpu']}, {m['torch_threads']} threads (torch {m['torch']}, "
        f"speculators {s['speculators']})"
    )
    for pair, r in report["pairs"].items():
        tr = r["training"]
        o, t = tr["ours"], tr["speculators"]
        rows = [
            ("training tokens/s", f"{o['tokens_per_s']:.0f}", f"{t['tokens_per_s']:.0f}", tr["tokens_per_s_ratio"]),
            ("peak RSS, training (MiB)", f"{o['peak_rss_mb']:.0f}", f"{t['peak_rss_mb']:.0f}", tr["peak_rss_ratio"]),
            ("peak RSS, process (MiB)", f"{o['process_peak_rss_mb']:.0f}", f"{t['process_peak_rss_mb']:.0f}",
             tr["process_peak_rss_ratio"]),
        ]  # fmt: skip
        rows = [(label, a, b, f"{ratio:.2f}x") for label, a, b, ratio in rows]
        for T, e in r["eval"].items():
            eo, et, d = e["ours"], e["speculators"], e["difference"]
            for label, key, fmt, signed in (
                ("acceptance", "acceptance_rate", "{:.3f}", "{:+.3f}"),
                ("tau", "mean_accepted_length", "{:.2f}", "{:+.2f}"),
            ):
                cells = [ci(x[key], x[f"{key}_ci"], fmt) for x in (eo, et)]
                rows.append((f"{T} {label}", *cells, ci(d[key], d[f"{key}_ci"], signed)))
            cells = [ci(x["speedup"], x["speedup_ci"], "{:.2f}") + "x" for x in (eo, et)]
            rows.append((f"{T} speedup", *cells, "speed " + ci(d["speed_ratio"], d["speed_ratio_ci"], "{:.2f}") + "x"))
        print(f"\n## pair `{pair}`\n\n| | ours | speculators | ours vs speculators |\n| --- | ---: | ---: | ---: |")
        for row in rows:
            print("| " + " | ".join(row) + " |")
        c = r["loader_check"]
        print(
            f"\nloader check (our loader vs speculators' model on its saved head, {c['steps']} TTT steps, "
            f"{c['tokens']} tokens): max |logit diff| {c['max_abs_diff']:.1e}, same d2t {c['same_d2t']} -> "
            f"{'passed' if c['passed'] else 'FAILED'}; same draft vocabulary: {r['same_draft_vocab']}"
        )
        print("goals: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in r["goals"].items()))
        for a in (r[k] for k in ("ablation", "speculators_ablation") if k in r):
            training = a["training"]
            print(
                f"\nablation of {a['trainer']} ({' '.join(a['overrides'])}): training "
                f"{training['tokens_per_s']:.0f} tokens/s, peak RSS {training['peak_rss_mb']:.0f} MiB\n\n"
                "| | ablation | ablation - ours | ablation - speculators |\n| --- | ---: | ---: | ---: |"
            )
            for T, e in a["eval"].items():
                for label, key in (("acceptance", "acceptance_rate"), ("tau", "mean_accepted_length")):
                    m, do, dt = e["ablation"], e["minus_ours"], e["minus_speculators"]
                    cells = [ci(m[key], m[f"{key}_ci"])] + [ci(d[key], d[f"{key}_ci"], "{:+.3f}") for d in (do, dt)]
                    print(f"| {T} {label} | " + " | ".join(cells) + " |")
    print(f"\nwall {s['wall_s']:.0f} s")


if __name__ == "__main__":
    raise SystemExit(main())
