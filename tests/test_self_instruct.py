"""Self-instruct (distill/self_instruct.py): the teacher's replies cleaned, deduplicated and turned into prompts."""

import re

import pytest

from distill.self_instruct import clean_generated_prompt, self_instruct_prompts


def test_clean_generated_prompt():
    reply = 'Sure! Here is a question:\n\n**Question:** "How do plants make food?"\n\nAnswer: by photosynthesis.'
    assert clean_generated_prompt(reply) == "How do plants make food?"
    assert clean_generated_prompt("1. Task - Write a haiku about rain.") == "Write a haiku about rain."
    assert (
        clean_generated_prompt("User-friendly apps: what makes them good?")
        == "User-friendly apps: what makes them good?"
    )
    assert clean_generated_prompt("Q: Why is the sea salty?\nA: Salt from rocks.") == "Why is the sea salty?"
    assert clean_generated_prompt("Hi?") is None and clean_generated_prompt("  ") is None
    assert clean_generated_prompt("x" * 401) is None


def test_self_instruct_dedups_and_cleans():
    # The one place a fake generator is fine: the real teacher is plugged in by the data stage.
    script = iter(
        [
            "Question: How do I sort a list in Python?",
            "how do I sort a  LIST in python",  # exact duplicate after normalisation
            "How do I sort a list in Python quickly?",  # near duplicate: Jaccard 8/9 >= 0.8
            "",  # empty
            "Ok",  # too short
            '"What is the capital of Peru?"',
            "Sure, here you go: Write a haiku about autumn leaves.",
            "What is the capital city of Peru?",  # Jaccard 6/7 >= 0.8
            "Explain photosynthesis in two sentences.",
            "Name three healthy breakfast ideas.",
        ]
        + [f"Spare question number {i} about nothing?" for i in range(20)]
    )
    batches = []

    def generate_fn(requests):
        batches.append(requests)
        return [next(script) for _ in requests]

    records = self_instruct_prompts(generate_fn, n=5, seed=0, batch_size=4)
    assert [r.messages[0]["content"] for r in records] == [
        "How do I sort a list in Python?",
        "What is the capital of Peru?",
        "Write a haiku about autumn leaves.",
        "Explain photosynthesis in two sentences.",
        "Name three healthy breakfast ideas.",
    ]
    assert len({r.id for r in records}) == 5 and all(r.messages[0]["role"] == "user" for r in records)
    assert [len(b) for b in batches] == [4, 4, 4]
    request = batches[0][0]
    assert len(request) == 1 and request[0]["role"] == "user"
    assert re.fullmatch(
        r"Write one new, specific question or task .+ about .+\. Reply with the question only\.", request[0]["content"]
    )
    assert all(
        r.category
        in {
            "writing",
            "coding",
            "math",
            "reasoning",
            "qa",
            "summarization",
            "translation",
            "extraction",
            "roleplay",
            "general",
        }
        for r in records
    )


def test_self_instruct_stops_after_max_attempts():
    calls = []

    def generate_fn(requests):
        calls.append(len(requests))
        return ["What is the same question every time?"] * len(requests)

    with pytest.warns(UserWarning, match="1 unique prompts of 10 requested after 40 teacher requests"):
        records = self_instruct_prompts(generate_fn, n=10, batch_size=16)
    assert len(records) == 1 and sum(calls) == 40 and calls == [16, 16, 8]


def test_self_instruct_requests_are_deterministic_in_seed():
    def draw(seed):
        seen = []

        def generate_fn(requests):
            seen.extend(r[0]["content"] for r in requests)
            return [f"Unique question number {len(seen) + i}?" for i in range(len(requests))]

        records = self_instruct_prompts(generate_fn, n=8, seed=seed, batch_size=8)
        return seen, [r.category for r in records]

    assert draw(1) == draw(1)
    assert draw(1)[0] != draw(2)[0]
    assert len(set(draw(1)[0])) > 1  # topics and angles vary across one batch
