"""Regenerate ``corpus.txt``, the tokenizer training text of the reference model.

Run once by hand (``python adapters/reference/data/make_corpus.py``); the output is committed so
the tokenizer never depends on this script, the Python version, or anything on the machine.
Everything here is original text built from small templates with a fixed ``random.Random`` seed.
"""

from __future__ import annotations

import random
from pathlib import Path

NAMES = ["Mara", "Tom", "Ines", "Kofi", "Lena", "Ravi", "Yuki", "Omar", "Ada", "Pablo", "Nora", "Jin"]
ITEMS = ["apples", "pencils", "marbles", "books", "stamps", "shells", "cookies", "coins", "tickets", "plums"]
PLACES = [
    "the harbour",
    "the old mill",
    "the library",
    "a quiet valley",
    "the market square",
    "the hill farm",
    "the train station",
    "a small workshop",
    "the river bank",
    "the school garden",
]
TIMES = [
    "In the morning",
    "Late in the evening",
    "Every spring",
    "After the storm",
    "On a grey Tuesday",
    "Before sunrise",
    "During the long winter",
    "At noon",
    "Once a year",
    "On the first warm day",
]
PEOPLE = [
    "the baker",
    "a young engineer",
    "the ferry captain",
    "an old teacher",
    "the night guard",
    "a travelling musician",
    "the gardener",
    "a curious child",
    "the clockmaker",
    "the village doctor",
]
ACTIONS = [
    "counted the boxes twice",
    "wrote a long letter",
    "fixed the broken gate",
    "planted a row of beans",
    "tuned the piano",
    "measured the water level",
    "painted the fence blue",
    "sorted the mail",
    "repaired a leaking roof",
    "mapped the narrow streets",
    "baked bread for the neighbours",
    "checked every lantern",
]
REASONS = [
    "because nobody else remembered how",
    "so that the work would be ready by Friday",
    "although the weather was poor",
    "while the others were still asleep",
    "since the instructions were unclear",
    "as the bell rang across the fields",
    "even though it took most of the day",
    "before the visitors arrived",
]
REFLECTIONS = [
    "Small habits, repeated with care, tend to matter more than grand plans.",
    "A careful record of what happened is worth more than a confident memory.",
    "Nobody noticed the change at first, and then everybody claimed to have expected it.",
    "The simplest explanation was also the least exciting one, which is often the case.",
    "Patience is easier when the next step is clear and the goal is close enough to see.",
    "Each answer raised two new questions, and that seemed like progress.",
    "The map was wrong in three places, but it was still better than no map at all.",
    "It is strange how a quiet room can make an old problem look new again.",
    "Good tools are the ones that disappear while you use them.",
    "They agreed to check the numbers again tomorrow, with fresh eyes and strong tea.",
    "Some lessons arrive slowly, like the tide, and leave just as quietly.",
    "The plan worked, mostly, and the parts that failed taught them something useful.",
]
OPS = ["add", "scale", "clip", "count", "merge", "split", "mean", "total", "window", "lookup"]


def prose(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(4, 7)):
        sentences.append(
            f"{rng.choice(TIMES)}, {rng.choice(PEOPLE)} went to {rng.choice(PLACES)} and "
            f"{rng.choice(ACTIONS)} {rng.choice(REASONS)}."
        )
        if rng.random() < 0.5:
            sentences.append(rng.choice(REFLECTIONS))
    return " ".join(sentences)


def word_problem(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    x, y = rng.randint(5, 90), rng.randint(2, 40)
    kind = rng.randrange(4)
    if kind == 0:
        return (
            f"Question: {a} has {x} {item}. {b} gives {a} {y} more {item}. How many {item} does {a} have now?\n"
            f"Answer: {x} + {y} = {x + y}. {a} has {x + y} {item}."
        )
    if kind == 1:
        x = max(x, y + 1)
        return (
            f"Question: {a} had {x} {item} and gave {y} of them to {b}. How many {item} are left?\n"
            f"Answer: {x} - {y} = {x - y}. There are {x - y} {item} left."
        )
    if kind == 2:
        n = rng.randint(2, 9)
        return (
            f"Question: {a} buys {n} bags with {y} {item} in each bag. How many {item} is that in total?\n"
            f"Answer: {n} * {y} = {n * y}. That is {n * y} {item}."
        )
    n = rng.randint(2, 6)
    return (
        f"Question: {a} shares {n * y} {item} equally among {n} friends. How many does each friend get?\n"
        f"Answer: {n * y} / {n} = {y}. Each friend gets {y} {item}."
    )


def code(rng: random.Random) -> str:
    op = rng.choice(OPS)
    var = rng.choice(["values", "items", "scores", "weights", "counts"])
    k = rng.randint(2, 9)
    bodies = [
        f"    result = []\n    for x in {var}:\n        if x > {k}:\n"
        f"            result.append(x * {k})\n    return result",
        f"    total = 0\n    for i, x in enumerate({var}):\n        total += x * (i + {k})\n    return total",
        f"    if not {var}:\n        return None\n    return sum({var}) / len({var})",
        f"    seen = {{}}\n    for x in {var}:\n        seen[x] = seen.get(x, 0) + 1\n    return seen",
        f"    return [x for x in {var} if x % {k} == 0]",
        f"    out = {var}[:]\n    out.sort()\n    return out[-{k}:]",
    ]
    body = rng.choice(bodies)
    doc = f'    """{op.capitalize()} the {var} with a step of {k}."""'
    text = f"def {op}_{var}({var}):\n{doc}\n{body}\n"
    if rng.random() < 0.3:
        text += (
            f"\n\nclass {op.capitalize()}Buffer:\n    def __init__(self, size={k}):\n        self.size = size\n"
            f"        self.data = []\n\n    def push(self, value):\n        self.data.append(value)\n"
            f"        if len(self.data) > self.size:\n            self.data.pop(0)\n"
        )
    if rng.random() < 0.3:
        text += f"\n\nprint({op}_{var}([{', '.join(str(rng.randint(0, 30)) for _ in range(5))}]))\n"
    return text


def build(target_bytes: int = 32_000, seed: int = 20240611) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < target_bytes:
        kind = rng.random()
        part = prose(rng) if kind < 0.45 else word_problem(rng) if kind < 0.75 else code(rng)
        parts.append(part)
        size += len(part.encode()) + 2
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    out = Path(__file__).with_name("corpus.txt")
    out.write_text(build(), encoding="utf-8")
    print(f"wrote {out} ({out.stat().st_size} bytes)")
