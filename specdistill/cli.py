"""The `specdistill` command line: composes configs and dispatches to the stages.

    specdistill config show configs/quickstart.yaml train.max_steps=20
    specdistill generate --target embedded:smollm2-135m-instruct "What is speculative decoding?"
    python -m specdistill ...                        # the same, as a module
    torchrun --nproc_per_node 2 -m specdistill ...   # multi-process stages (distill, data, eval)

User errors (bad config, missing file, unloadable model, vocabulary mismatch) print one line and exit with code 2;
set SPECDISTILL_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

EXAMPLES = {
    "config": "example: specdistill config show configs/quickstart.yaml train.max_steps=20 distill.objective=tv",
    "generate": 'example: specdistill generate --target embedded:smollm2-135m-instruct --max-new-tokens 64 '
                '"Explain speculative decoding in one sentence."',
}


class UserError(Exception):
    """An error caused by the user's input; printed as one line, exit code 2."""


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

    gen = sub.add_parser("generate", help="decode one prompt with the target (and a draft, if given)",
                         epilog=EXAMPLES["generate"])
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--no-chat-template", action="store_true", help="feed PROMPT as raw text")
    gen.add_argument("prompt", help="the user message")
    return p


def _add_model_args(p: argparse.ArgumentParser, draft: bool = True) -> None:
    p.add_argument("--target", default="embedded:smollm2-135m-instruct",
                   help="target model spec: HF id, local folder, .gguf file or embedded:smollm2-135m-instruct")
    if draft:
        p.add_argument("--draft", default=None, help="draft model spec; omit for target-only decoding")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--trust-remote-code", action="store_true")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-draft-tokens", type=int, default=4, help="gamma: tokens drafted per target verify step")
    p.add_argument("--draft-rule", default="greedy", choices=["greedy", "sample"],
                   help="greedy: draft proposes its argmax (vLLM default); sample: exact rejection sampling")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy decoding")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")


# ----------------------------------------------------------------------------------------------------------------


def cmd_config(args: argparse.Namespace) -> None:
    from specdistill.config import RootConfig, dump_yaml, field_docs, load_config

    cfg = load_config(args.config, args.overrides)
    if not args.docs:
        print(dump_yaml(cfg), end="")
        return
    for section in field_docs(RootConfig):
        value = getattr(cfg, section)
        docs = field_docs(type(value)) if hasattr(value, "__dataclass_fields__") else {section: ""}
        for key, doc in docs.items():
            name = f"{section}.{key}" if key != section else key
            print(f"{name}: {' '.join(doc.split())}")


def cmd_generate(args: argparse.Namespace) -> None:
    import torch

    from specdec_runtime.engine import SamplingParams, generate
    from specdec_runtime.loading import check_vocab_compatible, load_model

    target, tokenizer = load_model(args.target, dtype=args.dtype, device=args.device,
                                   trust_remote_code=args.trust_remote_code)
    draft = None
    if args.draft:
        draft, draft_tokenizer = load_model(args.draft, dtype=args.dtype, device=args.device,
                                            trust_remote_code=args.trust_remote_code)
        check_vocab_compatible(tokenizer, draft_tokenizer, draft.config.vocab_size)
    prompt = tokenizer.encode(args.prompt) if args.no_chat_template else chat_prompt_ids(tokenizer, args.prompt)
    generator = torch.Generator(device=target.device).manual_seed(args.seed)
    start = time.perf_counter()
    result = generate(target, draft, [prompt], num_draft_tokens=args.num_draft_tokens, draft_rule=args.draft_rule,
                      sampling=SamplingParams(args.temperature, args.top_k, args.top_p),
                      max_new_tokens=args.max_new_tokens, stop_token_ids=stop_ids(tokenizer), generator=generator)
    wall = time.perf_counter() - start
    print(tokenizer.decode(result.tokens[0], skip_special_tokens=True))
    stats = result.summary()
    parts = [f"new_tokens={stats['new_tokens']}", f"tokens_per_s={stats['new_tokens'] / wall:.1f}"]
    if draft is not None:
        parts = [f"acceptance_rate={stats['acceptance_rate']:.3f}",
                 f"mean_accepted_length={stats['mean_accepted_length']:.2f}"] + parts
    print("[" + " ".join(parts) + "]", file=sys.stderr)


def chat_prompt_ids(tokenizer, user_message: str) -> list[int]:
    """The model's chat template around one user message, ready for the assistant's reply."""
    if not tokenizer.chat_template:
        raise UserError("this tokenizer has no chat template; pass --no-chat-template to feed the prompt as raw text")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": user_message}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return list(ids)


def stop_ids(tokenizer) -> tuple[int, ...]:
    return (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()


COMMANDS = {"config": cmd_config, "generate": cmd_generate}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _quiet_libraries()
    try:
        COMMANDS[args.command](args)
    except (UserError, ValueError, FileNotFoundError) as e:
        if os.environ.get("SPECDISTILL_DEBUG"):
            raise
        print(f"specdistill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdistill: interrupted", file=sys.stderr)
        return 130
    return 0


def _quiet_libraries() -> None:
    """Loading-bar and advisory noise from transformers hides our own output; keep errors only."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
