"""Self-instruct: the teacher writes the training prompts, for users who bring none (`data.prompts: self_instruct`).

    records = self_instruct_prompts(generate_fn, n=200, seed=0)   # generate_fn: chats -> one reply each

This module has no model code: the data stage (distill/data.py) samples the teacher inside `generate_fn`, writes the
records once with `save_prompts` and every rank and resumed run reads that file back.
"""

import random
import re
import warnings
from collections.abc import Callable, Sequence

from distill.prompts import PromptRecord

SELF_INSTRUCT_TOPICS = (
    ("writing", "writing a short poem"),
    ("writing", "writing a polite email"),
    ("writing", "writing a short story"),
    ("writing", "writing a product description"),
    ("writing", "editing a paragraph to make it clearer"),
    ("coding", "Python functions"),
    ("coding", "Python lists and dictionaries"),
    ("coding", "SQL queries"),
    ("coding", "JavaScript in web pages"),
    ("coding", "fixing a bug in a short program"),
    ("coding", "using git"),
    ("math", "percentages and discounts"),
    ("math", "fractions and decimals"),
    ("math", "simple algebra equations"),
    ("math", "areas and perimeters of shapes"),
    ("math", "probability with dice or coins"),
    ("reasoning", "logic puzzles"),
    ("reasoning", "planning a schedule"),
    ("reasoning", "comparing two options and choosing one"),
    ("qa", "the solar system"),
    ("qa", "the human body"),
    ("qa", "world geography"),
    ("qa", "world history"),
    ("qa", "animals and their habitats"),
    ("qa", "weather and climate"),
    ("qa", "how everyday technology works"),
    ("qa", "personal finance and budgeting"),
    ("qa", "healthy eating"),
    ("qa", "physical exercise"),
    ("qa", "learning a new language"),
    ("summarization", "summarizing a short news story that you include in the request"),
    ("summarization", "summarizing a short paragraph about science that you include in the request"),
    ("translation", "translating a short sentence between English and French or Spanish"),
    ("extraction", "pulling dates, names or numbers out of a short text that you include in the request"),
    ("roleplay", "pretending to be a tour guide, a chef or a teacher"),
    ("roleplay", "acting as a customer support agent"),
    ("general", "cooking and recipes"),
    ("general", "travel planning"),
    ("general", "gardening"),
    ("general", "study tips for students"),
    ("general", "job interviews"),
    ("general", "home repairs"),
)
_ANGLES = (
    "",
    " for a beginner",
    " in everyday life",
    " that needs a short answer",
    " that asks for an example",
    " for someone at work",
)
_PREAMBLE = re.compile(r"^(sure|certainly|okay|ok|of course|here('s| is| are))\b.*:\s*$", re.IGNORECASE)
# Leading labels and one-line preambles: "1. **Question:** ...", "Sure! Here's one: ...".
_PREFIXES = (
    re.compile(r"^(\d+[.)]|[-*•])\s+"),
    re.compile(
        r"^\**\s*(new\s+)?(question|task|prompt|user|q|request|instruction)\s*\d*\s*\**\s*(:|[-–](?=\s))\s*\**\s*",
        re.IGNORECASE,
    ),
    re.compile(r"^(sure|certainly|of course|okay|here('s| is| are))\b[^:]{0,60}:\s+", re.IGNORECASE),
)
_STOP = re.compile(r"^\s*\**\s*(answer|a|assistant|response)\s*\**\s*:", re.IGNORECASE)
_QUOTES = ('""', "''", "“”", "‘’", "``", "**")


def self_instruct_prompts(
    generate_fn: Callable[[list[list[dict]]], list[str]],
    n: int,
    seed: int = 0,
    *,
    batch_size: int = 16,
    max_attempts: int | None = None,
    topics: Sequence[tuple[str, str]] = SELF_INSTRUCT_TOPICS,
    min_chars: int = 12,
    max_chars: int = 400,
) -> list[PromptRecord]:
    """Have the teacher write `n` unique user prompts, for users who bring none.

    `generate_fn` takes a batch of chat message lists and returns one reply each (the caller samples the teacher
    with temperature > 0; this module has no model code). Topics are (category, topic) pairs; each request asks
    for one question about a random topic and angle. Replies are cleaned, then deduplicated exactly
    (case / whitespace) and approximately (token-set Jaccard >= 0.8). Stops after `max_attempts` requests
    (default 4 n) and returns what it has with a warning.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(seed)
    max_attempts = 4 * n if max_attempts is None else max_attempts
    kept: list[PromptRecord] = []
    seen_norm: set[str] = set()
    seen_tokens: list[set[str]] = []
    attempts = 0
    while len(kept) < n and attempts < max_attempts:
        picks = [(rng.choice(topics), rng.choice(_ANGLES)) for _ in range(min(batch_size, max_attempts - attempts))]
        requests = [[{"role": "user", "content": _self_instruct_request(topic, angle)}] for (_, topic), angle in picks]
        replies = generate_fn(requests)
        if len(replies) != len(requests):
            raise ValueError(f"generate_fn returned {len(replies)} replies for {len(requests)} requests")
        attempts += len(requests)
        for ((category, _), _), reply in zip(picks, replies):
            text = clean_generated_prompt(reply, min_chars, max_chars)
            if text is None or _is_duplicate(text, seen_norm, seen_tokens):
                continue
            kept.append(
                PromptRecord(
                    id=f"self_instruct-{len(kept):05d}", messages=[{"role": "user", "content": text}], category=category
                )
            )
            if len(kept) == n:
                break
    if len(kept) < n:
        warnings.warn(
            f"self_instruct_prompts: {len(kept)} unique prompts of {n} requested after {attempts} "
            "teacher requests; returning those",
            stacklevel=2,
        )
    return kept


def _self_instruct_request(topic: str, angle: str) -> str:
    return (
        f"Write one new, specific question or task a user might ask an AI assistant about {topic}{angle}. "
        "Reply with the question only."
    )


def clean_generated_prompt(text: str, min_chars: int = 12, max_chars: int = 400) -> str | None:
    """The question inside a teacher reply: drop preambles, 'Question:' labels, quotes and any self-answer.

    Returns None when nothing of `min_chars`..`max_chars` characters is left.
    """
    lines = [ln.strip() for ln in text.strip().splitlines()]
    while lines and (not lines[0] or _PREAMBLE.match(lines[0])):
        lines.pop(0)
    body = []
    for ln in lines:  # first paragraph only: the model often answers its own question after a blank line
        if not ln or _STOP.match(ln):
            break
        body.append(ln)
    out = " ".join(body)
    while (stripped := _strip_prefix(out)) != out:
        out = stripped
    while len(out) >= 2 and out[0] + out[-1] in _QUOTES:
        out = out[1:-1].strip()
    return out if min_chars <= len(out) <= max_chars else None


def _strip_prefix(text: str) -> str:
    for pattern in _PREFIXES:
        text = pattern.sub("", text, count=1).strip()
    return text


def _is_duplicate(text: str, seen_norm: set[str], seen_tokens: list[set[str]]) -> bool:
    norm = " ".join(text.lower().split()).rstrip(" ?.!")
    tokens = set(re.findall(r"[a-z0-9']+", norm))
    # O(n) scan per prompt; self-instruct sets are hundreds to a few thousand prompts.
    if norm in seen_norm or any(len(tokens & t) >= 0.8 * len(tokens | t) for t in seen_tokens):
        return True
    seen_norm.add(norm)
    seen_tokens.append(tokens)
    return False
