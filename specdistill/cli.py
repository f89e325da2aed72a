"""The `specdistill` command line: composes configs and dispatches to the stages.

    specdistill config show configs/quickstart.yaml train.max_steps=20
    specdistill generate --target embedded:smollm2-135m-instruct "What is speculative decoding?"
    python -m specdistill ...                        # the same, as a module
    torchrun --nproc_per_node 2 -m specdistill ...   # multi-process stages (distill, data, eval)

User errors (`specdec_runtime.errors.UserError`: bad config, missing or unreadable file, unloadable model,
vocabulary mismatch, unwritable output) print one line and exit with code 2; set SPECDISTILL_DEBUG=1 to see the
traceback instead. Any other exception is a bug: its traceback is shown, followed by one line asking for a report,
and the exit code is 1.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import time
import traceback
from pathlib import Path

from specdec_runtime.errors import UserError

EXAMPLES = {
    "config": "example: specdistill config show configs/quickstart.yaml train.max_steps=20 distill.objective=tv",
    "bench": "example: specdistill bench --target embedded:smollm2-135m-instruct --draft runs/quickstart/candidates/"
    "eagle3/best --prompts builtin:test --num-prompts 8 --num-draft-tokens 4 --json bench.json",
    "data": "example: specdistill data configs/quickstart.yaml data.max_prompts=50\n"
    "         torchrun --nproc_per_node 2 -m specdistill data configs/smoke.yaml\n"
    "         specdistill data CONFIG data.generator=endpoint data.endpoint.url=http://localhost:8000/v1 "
    "data.endpoint.model=MODEL --fetch-only",
    "distill": "example: specdistill distill configs/quickstart.yaml train.max_steps=100\n"
    "         accelerate launch --config_file configs/accelerate/ddp.yaml -m specdistill distill CONFIG\n"
    "         torchrun --nproc_per_node 2 -m specdistill distill configs/smoke.yaml   (CPU, gloo)",
    "eval": "example: specdistill eval configs/quickstart.yaml\n"
    "         specdistill eval --target embedded:smollm2-135m-instruct --drafts runs/quickstart/candidates/"
    "eagle3 ngram suffix --prompts spec_bench.jsonl --out runs/my-eval eval.num_draft_tokens=[2,4]",
    "promote": "example: specdistill promote runs/quickstart/eval/report.json --dry-run\n"
    "         specdistill promote runs/my-eval/report.json --serving deploy/serving.yaml --export-dir deploy/drafts",
    "export": "example: specdistill export runs/quickstart/candidates/eagle3/best runs/quickstart/export/x",
    "run": "example: specdistill run configs/quickstart.yaml      (data -> distill -> eval -> promote, which exports)",
    "generate": "example: specdistill generate --target embedded:smollm2-135m-instruct --max-new-tokens 64 "
    '"Explain speculative decoding in one sentence."',
}


TREE_HELP = (
    "draft a token tree instead of a chain: '4,2,2,1' (branching per depth) or 'dynamic:NODES' (EAGLE-2, "
    "NODES verified per step); its depth replaces --num-draft-tokens"
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specdistill",
        description="Distill draft models for speculative decoding, measure their real acceptance, promote the best.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    cfg = sub.add_parser("config", help="inspect configs", epilog=EXAMPLES["config"])
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = cfg_sub.add_parser("show", help="print the resolved config as YAML", epilog=EXAMPLES["config"])
    show.add_argument("config", help="YAML config file, e.g. configs/quickstart.yaml")
    show.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.lr=3e-4")
    show.add_argument("--docs", action="store_true", help="list every key with its documentation instead")

    gen = sub.add_parser(
        "generate",
        help="decode one prompt with the target (and a draft, if given)",
        epilog=EXAMPLES["generate"],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--max-new-tokens", type=POSITIVE, default=128)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--tree", default=None, help=TREE_HELP)
    gen.add_argument("--no-chat-template", action="store_true", help="feed PROMPT as raw text")
    gen.add_argument("prompt", help="the user message")

    bench = sub.add_parser(
        "bench",
        help="target-only vs speculative (ours) vs HF assisted generation, one run",
        epilog=EXAMPLES["bench"],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_args(bench)
    bench.add_argument("--prompts", default="builtin:test", help="prompt file or builtin:test")
    bench.add_argument("--num-prompts", type=POSITIVE, default=8)
    bench.add_argument("--num-draft-tokens", type=POSITIVE, default=4)
    bench.add_argument(
        "--tree",
        default=None,
        help="also run a token tree, '4,2,2,1' (branching per depth) or "
        "'dynamic:NODES' (EAGLE-2), reported next to the chain of --num-draft-tokens",
    )
    bench.add_argument("--max-new-tokens", type=POSITIVE, default=128)
    bench.add_argument("--temperature", type=_number_in(0, 100), default=0.0)
    bench.add_argument("--batch-size", type=POSITIVE, default=1)
    bench.add_argument("--repeats", type=POSITIVE, default=3, help="timed ABBA repeats of the paired A/B (default 3)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--json", default=None, help="also write the results as JSON here")
    bench.add_argument(
        "--cpu-compile",
        action="store_true",
        help="on the CPU, compile the fast path's decode/verify steps with Inductor (~30 s per graph, outside timing)",
    )
    bench.add_argument(
        "--cpu-layouts",
        choices=["auto", "tune", "rule"],
        default="auto",
        help="on the CPU, the fast path's weight layouts: auto = timed fastest on this machine (cached plan), "
        "tune = time them again, rule = the fixed rule (default auto)",
    )

    for name, text in (
        ("data", "generate the teacher's distillation data (resumable)"),
        ("distill", "distill every candidate draft (runs `data` first; resumable)"),
        ("run", "data -> distill -> eval -> promote (check, export, serving config), skipping finished stages"),
    ):
        stage = sub.add_parser(
            name, help=text, epilog=EXAMPLES[name], formatter_class=argparse.RawDescriptionHelpFormatter
        )
        stage.add_argument("config", help="YAML config, e.g. configs/quickstart.yaml")
        stage.add_argument("overrides", nargs="*", help="dotted key=value overrides")
        if name == "data":
            stage.add_argument(
                "--fetch-only",
                action="store_true",
                help="data.generator=endpoint: only collect the server's responses, loading no model weights (the "
                "server may hold every GPU); the scoring pass runs with the next `data`, `distill` or `run`",
            )
        if name == "run":
            stage.add_argument(
                "--force",
                action="store_true",
                help="promote even where the report's enable decision disagrees with the gates, and replace a "
                "serving config that is not valid YAML (both recorded in its history)",
            )

    ev = sub.add_parser(
        "eval",
        help="measure acceptance and speedup of candidate drafts against target-only",
        epilog=EXAMPLES["eval"],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ev.add_argument("config", nargs="?", default=None, help="YAML config (its candidates are evaluated)")
    ev.add_argument("overrides", nargs="*", help="dotted key=value overrides (eval.*, serving.*, target.*)")
    ev.add_argument("--target", default=None, help="target model spec (overrides target.model)")
    ev.add_argument(
        "--drafts",
        nargs="+",
        default=None,
        help="draft folders, checkpoint folders, distillation run directories, or the zero-training drafts "
        "ngram[:max=N,min=N] and suffix[:depth=N,factor=F,prob=P,cached=N]",
    )
    ev.add_argument("--prompts", default=None, help="eval prompt file (prompt / messages / Spec-Bench turns)")
    ev.add_argument("--out", default=None, help="output folder (default <output_dir>/eval)")

    pr = sub.add_parser(
        "promote",
        help="check the recommended draft against the target, export it, write the serving config",
        epilog=EXAMPLES["promote"],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pr.add_argument("report", help="report.json written by `specdistill eval`")
    pr.add_argument("--serving", default=None, help="serving config to write (default: the run's serving.path)")
    pr.add_argument(
        "--export-dir",
        default=None,
        help="folder the draft is exported into, as <dir>/<name> (default: the run's <output_dir>/export, else "
        "export/ next to the serving config)",
    )
    pr.add_argument("--dry-run", action="store_true", help="print the diff, write nothing")
    pr.add_argument(
        "--force",
        action="store_true",
        help="replace a serving config that is not valid YAML, and promote a report whose `enabled` disagrees with "
        "its confirmation numbers under the serving gates (recorded in serving.yaml)",
    )

    ex = sub.add_parser(
        "export", help="write a checkpoint as a standalone HF draft folder with a model card", epilog=EXAMPLES["export"]
    )
    ex.add_argument("checkpoint", help="best/ or checkpoints/step-N folder (LoRA adapters are merged)")
    ex.add_argument("out_dir")
    ex.add_argument("--report", default=None, help="eval report.json whose numbers go into the model card")
    ex.add_argument(
        "--force",
        action="store_true",
        help="replace an existing non-empty OUT_DIR (swapped for the export once it is complete; never the "
        "checkpoint's own folder or one around it)",
    )
    return p


def _at_least(low: int):
    """argparse type: an integer >= low, refused with the flag named (argparse adds it) and the bound."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _number_in(low: float, high: float, *, low_open: bool = False):
    """argparse type: a number in [low, high] ((low, high] with low_open)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low < value if low_open else low <= value) or value > high:
            raise argparse.ArgumentTypeError(f"must be in {'(' if low_open else '['}{low}, {high}], got {value}")
        return value

    return parse


POSITIVE = _at_least(1)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        default="embedded:smollm2-135m-instruct",
        help="target model spec: HF id, local folder, .gguf file or embedded:smollm2-135m-instruct",
    )
    p.add_argument(
        "--draft",
        default=None,
        help="draft model spec, or a zero-training draft: ngram[:max=N,min=N] (prompt lookup) or "
        "suffix[:depth=N,factor=F,prob=P,cached=N] (suffix decoding); omit for target-only decoding",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--trust-remote-code", action="store_true")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-draft-tokens", type=POSITIVE, default=4, help="gamma: tokens drafted per target verify step")
    p.add_argument(
        "--draft-rule",
        default="greedy",
        choices=["greedy", "sample"],
        help="greedy: draft proposes its argmax (vLLM default); sample: exact rejection sampling",
    )
    p.add_argument("--temperature", type=_number_in(0, 100), default=0.0, help="0 = greedy decoding")
    p.add_argument("--top-k", type=_at_least(0), default=0, help="0 = off")
    p.add_argument("--top-p", type=_number_in(0, 1, low_open=True), default=1.0, help="1.0 = off")


# ----------------------------------------------------------------------------------------------------------------


def cmd_config(args: argparse.Namespace) -> None:
    from specdistill.config import dump_yaml, field_docs, load_config

    cfg = load_config(args.config, args.overrides)
    if not args.docs:
        print(dump_yaml(cfg), end="")
        return

    def show(obj, prefix: str) -> None:  # sections and sub-sections (data.endpoint) list their own keys
        for key, doc in field_docs(type(obj)).items():
            value = getattr(obj, key)
            if hasattr(value, "__dataclass_fields__"):
                show(value, f"{prefix}{key}.")
            else:
                print(f"{prefix}{key}: {' '.join(doc.split())}")

    show(cfg, "")


def cmd_generate(args: argparse.Namespace) -> None:
    import torch

    from specdec_runtime.engine import SamplingParams, generate
    from specdec_runtime.loading import load_model, stop_token_ids
    from specdec_runtime.tree import parse_tree

    if args.tree and not args.draft:
        raise UserError("--tree needs --draft: a token tree is proposed by a draft model (omit --tree to decode alone)")
    if args.tree and _is_lookup(args.draft):
        raise UserError("--tree needs a draft model: a lookup drafts chains; omit --tree")
    if args.tree:
        parse_tree(args.tree)  # a bad spec fails before the models load
    _check_local_model(args.draft)
    target, tokenizer = load_model(
        args.target, dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code
    )
    draft = _load_draft(args, tokenizer) if args.draft else None
    prompt = tokenizer.encode(args.prompt) if args.no_chat_template else chat_prompt_ids(tokenizer, args.prompt)
    if not prompt:
        raise UserError("PROMPT encodes to no tokens; give a non-empty user message")
    generator = torch.Generator(device=target.device).manual_seed(args.seed)
    start = time.perf_counter()
    result = generate(
        target,
        draft,
        [prompt],
        num_draft_tokens=args.num_draft_tokens,
        draft_rule=args.draft_rule,
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p),
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=stop_token_ids(target, tokenizer),
        generator=generator,
        tree=args.tree,
    )
    wall = time.perf_counter() - start
    print(tokenizer.decode(result.tokens[0], skip_special_tokens=True))
    stats = result.stats.aggregate()
    parts = [f"new_tokens={stats['new_tokens']}", f"tokens_per_s={stats['new_tokens'] / wall:.1f}"]
    if draft is not None:
        alpha, tau = stats["acceptance_rate"], stats["mean_accepted_length"]  # None: nothing was drafted
        parts = [
            f"acceptance_rate={alpha:.3f}" if alpha is not None else "acceptance_rate=- (nothing drafted)",
            f"mean_accepted_length={tau:.2f}" if tau is not None else "mean_accepted_length=-",
        ] + parts
        if args.tree:
            parts.insert(2, f"nodes_per_step={stats['nodes_per_step']:.1f}")
    print("[" + " ".join(parts) + "]", file=sys.stderr)


def cmd_bench(args: argparse.Namespace) -> None:
    import json

    import torch

    from distill.prompts import load_prompts, render_chat
    from specdec_runtime.backends import BackendOptions
    from specdec_runtime.bench import format_bench_table, run_bench
    from specdec_runtime.loading import load_model
    from specdec_runtime.tree import parse_tree

    if not args.draft:
        raise UserError("bench needs --draft (the target-only and HF-assisted runs are measured against it)")
    if args.json and Path(args.json).is_dir():
        raise UserError(f"--json {args.json} is a folder; give a file path, e.g. {Path(args.json) / 'bench.json'}")
    if args.tree and _is_lookup(args.draft):
        raise UserError("--tree needs a draft model: a lookup drafts chains; omit --tree")
    if args.tree:
        parse_tree(args.tree)  # a bad spec fails before the models load
    records = load_prompts(args.prompts, limit=args.num_prompts)
    if args.batch_size > len(records):
        raise UserError(
            f"--batch-size {args.batch_size} needs at least {args.batch_size} prompts, and {args.prompts} gives "
            f"{len(records)} (--num-prompts {args.num_prompts}); lower --batch-size or pass more prompts"
        )
    _check_local_model(args.draft)
    target, tokenizer = load_model(
        args.target, dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code
    )
    draft = _load_draft(args, tokenizer)
    prompts = [render_chat(tokenizer, r.messages) for r in records]
    torch.manual_seed(args.seed)
    result = run_bench(
        target,
        draft,
        tokenizer,
        prompts,
        num_draft_tokens=args.num_draft_tokens,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        batch_size=args.batch_size,
        seed=args.seed,
        repeats=args.repeats,
        tree=args.tree,
        backend=BackendOptions(cpu_compile=args.cpu_compile, cpu_layouts=args.cpu_layouts),
    )
    result.update(target=args.target, draft=args.draft, prompts=args.prompts, num_prompts=len(prompts))
    print(format_bench_table(result))
    if args.json:
        from specdec_runtime.atomic import write_text

        write_text(Path(args.json), json.dumps(result, indent=2))


def _stage_config(args: argparse.Namespace):
    from specdistill.config import load_config

    return load_config(args.config, args.overrides)


def cmd_data(args: argparse.Namespace) -> None:
    from specdistill.pipeline import check_prompt_roles, dist_state, fetch_responses_stage, print0, run_lock, stage_data

    cfg = _stage_config(args)
    check_prompt_roles(cfg)  # before the lock writes anything
    dist = dist_state(cfg.target.device, cfg.train.timeout_minutes)
    with run_lock(cfg.output_dir, dist):
        if args.fetch_only:
            stores = fetch_responses_stage(cfg, dist)
            print0(dist, f"responses: {', '.join(map(str, stores))}; `specdistill data` (no --fetch-only) scores them")
            return
        data = stage_data(cfg, dist)
    print0(dist, f"teacher data: train {data.train}, validation {data.validation}")


def cmd_distill(args: argparse.Namespace) -> None:
    from specdistill.config import save_resolved
    from specdistill.pipeline import check_prompt_roles, dist_state, print0, run_distill, run_lock, stage_data

    cfg = _stage_config(args)
    check_prompt_roles(cfg)  # before the lock writes anything
    dist = dist_state(cfg.target.device, cfg.train.timeout_minutes)
    with run_lock(cfg.output_dir, dist):
        if dist.is_main:
            save_resolved(cfg, Path(cfg.output_dir) / "config.yaml")
        dirs = run_distill(cfg, stage_data(cfg, dist))
    for name, path in dirs.items():
        print0(dist, f"candidate {name}: {path}")


def cmd_eval(args: argparse.Namespace) -> None:
    from eval.sweep import resolve_candidates
    from specdistill.config import load_config
    from specdistill.pipeline import check_shared_dir, config_candidates, dist_state, print0, run_lock, stage_eval

    overrides = list(args.overrides)
    if args.config and "=" in args.config and not Path(args.config).is_file():  # no CONFIG, only overrides
        args.config, overrides = None, [args.config, *overrides]
    if args.target:
        overrides.append(f"target.model={args.target}")
    if args.prompts:
        overrides.append(f"eval.prompts={args.prompts}")
    if args.config is None and not (args.target and args.drafts):
        raise UserError("eval needs a CONFIG, or --target and --drafts (and usually --prompts and --out)")
    cfg = load_config(args.config, overrides)
    out = Path(args.out) if args.out else Path(cfg.output_dir) / "eval"
    dist = dist_state(cfg.target.device, cfg.train.timeout_minutes)
    # Every process reads a config's candidates from output_dir, which must then be shared by the nodes; rank 0 alone
    # writes the report, so an --out folder (or output_dir beside --drafts) may be local to its node.
    with run_lock(out if args.out else cfg.output_dir, dist, shared=not (args.out or args.drafts)):
        if args.out and not args.drafts:  # the config's candidates still come from output_dir: every node reads it
            check_shared_dir(cfg.output_dir, dist)
        candidates = resolve_candidates(args.drafts) if args.drafts else config_candidates(cfg)
        # A config's own candidates were trained and validated on its data section's prompts: eval refuses those.
        report = stage_eval(cfg, dist, candidates, out_dir=out, trained_on=None if args.drafts else cfg.data)
    print0(dist, f"report: {report} (+ report.md, report.html)")


def cmd_promote(args: argparse.Namespace) -> None:
    from eval.promote import promote, run_config

    report_path = Path(args.report)
    if not report_path.is_file():
        raise UserError(f"report not found: {report_path} (written by `specdistill eval` as <out>/report.json)")
    config = (run_config(report_path) or (None, None))[1]
    serving = Path(args.serving) if args.serving else _default_serving(report_path, config)
    target = (config or {}).get("target") or {}
    # The deployment's own target wins: a report made for another model must not be promoted into its config.
    expected = _serving_target(serving) or target.get("model")
    if args.export_dir:
        export_root = Path(args.export_dir)
    else:  # where `run` exports: <output_dir>/export/<name>
        export_root = (report_path.resolve().parent.parent if config else serving.parent) / "export"
    summary = promote(
        report_path,
        serving,
        dry_run=args.dry_run,
        force=args.force,
        expected_target=expected,
        export_root=export_root,
        trust_remote_code=bool(target.get("trust_remote_code")),
    )
    print(summary)


def _serving_target(serving: Path) -> str | None:
    import yaml

    try:
        data = yaml.safe_load(serving.read_text()) if serving.is_file() else None
    except (yaml.YAMLError, ValueError):  # not YAML, or not UTF-8
        return None  # promote() refuses the broken file with its own message
    return data.get("target") if isinstance(data, dict) else None


def _default_serving(report_path: Path, run_config: dict | None) -> Path:
    """The run's serving.path, else <output_dir>/serving.yaml."""
    if run_config is None:
        raise UserError(f"no run config next to {report_path} to find the serving config; pass --serving PATH")
    path = (run_config.get("serving") or {}).get("path")
    return Path(path) if path else report_path.resolve().parent.parent / "serving.yaml"


def cmd_export(args: argparse.Namespace) -> None:
    from eval.export import export_draft
    from eval.promote import load_report

    report = load_report(Path(args.report)) if args.report else None
    out = export_draft(Path(args.checkpoint), Path(args.out_dir), report=report, force=args.force)
    print(f"exported: {out}")


def _exported(folder: Path | None, rec: dict) -> str:
    """Where `run` exported the recommended draft, or why nothing was exported."""
    if folder is not None:
        return str(folder)
    if rec.get("draft"):  # recommended, not exported: a zero-training draft
        return f"none ({rec['draft']} is a zero-training draft: no weights to export)"
    return "none (no draft recommended)"


def cmd_run(args: argparse.Namespace) -> None:
    from specdistill.pipeline import run_all

    result = run_all(_stage_config(args), force=args.force)
    if "recommendation" not in result:
        return  # not rank 0
    rec = result["recommendation"]
    lines = [
        "",
        "== specdistill run: done in {:.1f} min ==".format(result["wall_s"] / 60),
        f"report:         {result['report']} (+ report.md, {result['html']})",
        f"exported draft: {_exported(result['exported'], rec)}",
        f"serving config: {result['serving']}  ({result['summary']})",
    ]
    if rec["enabled"]:
        m = rec["confirmation"]
        lines.append(
            f"promoted:       {rec['name']} at num_draft_tokens={rec['num_draft_tokens']}: acceptance_rate "
            f"{m['acceptance_rate']:.2f}, mean_accepted_length {m['mean_accepted_length']:.2f}, speedup "
            f"{m['speedup']:.2f}x (95% CI {m['speedup_ci'][0]:.2f}-{m['speedup_ci'][1]:.2f}, "
            "confirmation split)"
        )
    else:
        lines.append(f"not enabled:    {rec['reason']}")
    print("\n".join(lines))


def _check_local_model(spec: str | None) -> None:
    """A draft folder's files are checked before the target loads: a corrupt one fails at once, not after a load; so
    is a zero-training draft's spelling."""
    from specdec_runtime.loading import check_model_files
    from specdec_runtime.lookup import lookup_draft

    if spec and _is_lookup(spec):
        lookup_draft(spec)
    elif spec and Path(spec).expanduser().is_dir():
        check_model_files(Path(spec).expanduser())


def _is_lookup(spec: str) -> bool:
    """`ngram[:...]` / `suffix[:...]` names a zero-training draft, unless a folder of that name is here."""
    from specdec_runtime.lookup import is_lookup_spec

    return is_lookup_spec(spec) and not Path(spec).expanduser().exists()


def _load_draft(args: argparse.Namespace, tokenizer):
    """--draft: a zero-training draft (it proposes the target's own tokens), else a draft model whose vocabulary is
    checked against the target's (an EAGLE-3 head saved without a tokenizer uses the target's ids by construction)."""
    from specdec_runtime.loading import check_vocab_compatible, load_draft_model
    from specdec_runtime.lookup import lookup_draft

    if _is_lookup(args.draft):
        return lookup_draft(args.draft)
    draft, draft_tokenizer = load_draft_model(
        args.draft, dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code
    )
    if draft_tokenizer is not None:
        check_vocab_compatible(tokenizer, draft_tokenizer, draft.config.vocab_size)
    return draft


def chat_prompt_ids(tokenizer, user_message: str) -> list[int]:
    """The model's chat template around one user message, ready for the assistant's reply."""
    if not tokenizer.chat_template:
        raise UserError("this tokenizer has no chat template; pass --no-chat-template to feed the prompt as raw text")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": user_message}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return list(ids)


COMMANDS = {
    "config": cmd_config,
    "generate": cmd_generate,
    "bench": cmd_bench,
    "data": cmd_data,
    "distill": cmd_distill,
    "eval": cmd_eval,
    "promote": cmd_promote,
    "export": cmd_export,
    "run": cmd_run,
}


BUG_LINE = "specdistill: internal error (a bug): please report it with the traceback above and the command you ran"
DISK_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)  # the disk filled up or went read-only mid-stage


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _quiet_libraries()
    debug = bool(os.environ.get("SPECDISTILL_DEBUG"))
    try:
        COMMANDS[args.command](args)
    except UserError as e:  # raised where the input is read: the message names the problem and the fix
        if debug:
            raise
        print(f"specdistill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdistill: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            from specdistill.pipeline import describe_os_error

            print(f"specdistill: error: writing failed: {describe_os_error(e)}", file=sys.stderr)
            return 2
        traceback.print_exc()  # anything else is ours: the traceback is what a report needs
        print(BUG_LINE, file=sys.stderr)
        return 1
    return 0


def _quiet_libraries() -> None:
    """Loading-bar and advisory noise from transformers hides our own output; keep errors only."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
