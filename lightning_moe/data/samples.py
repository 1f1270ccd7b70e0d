"""Synthetic rows in the exact schemas of public SFT and evaluation datasets.

The rows are plausible-looking English made from word lists and sentence templates, with a
realistic length spread (short and long answers, multi-turn conversations, system prompts). They
are meant for smoke tests, benchmarks and tiny CPU twins of recipes, where the schema and the
length distribution matter and the meaning does not. ``lightning-moe data samples --output DIR``
writes the files shipped in the repository's ``data/`` folder.

Schemas:
- allenai/tulu-3-sft-mixture: ``id``, ``messages`` (list of ``{role, content}``), ``source``.
- nvidia/OpenMathInstruct-2: ``problem``, ``generated_solution``, ``expected_answer``, ``problem_source``.
- Rowan/hellaswag: ``ind``, ``activity_label``, ``ctx_a``, ``ctx_b``, ``ctx``, ``endings`` (4),
  ``source_id``, ``split``, ``split_type``, ``label`` ("0".."3").
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterable
from typing import Any

from lightning_moe.data.indexed import build_indexed_dataset_from_jsonl
from lightning_moe.data.tokenizer import load_tokenizer, train_bpe_tokenizer

_NAMES = [
    "Alice", "Bruno", "Chen", "Dana", "Elif", "Farah", "Goran", "Hana", "Ivan", "Jun", "Kemal", "Lena",
    "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yara",
]
_NOUNS = [
    "garden", "river", "engine", "library", "market", "theory", "window", "bridge", "kitchen", "forest",
    "algorithm", "museum", "harbor", "recipe", "telescope", "village", "contract", "battery", "painting",
    "mountain", "server", "orchestra", "notebook", "island", "factory", "spreadsheet", "castle", "bicycle",
    "protein", "satellite", "festival", "compiler", "glacier", "violin", "desert", "network", "cathedral",
    "tomato", "volcano", "database", "lantern", "meadow", "rocket", "sculpture", "workshop", "archive",
    "company", "student", "teacher", "customer", "policy", "question", "answer", "problem", "solution",
    "city", "country", "language", "history", "science", "budget", "schedule", "report", "design",
]
_ADJECTIVES = [
    "quiet", "ancient", "efficient", "bright", "fragile", "modern", "remote", "careful", "complex",
    "simple", "colorful", "hidden", "famous", "narrow", "generous", "rapid", "gentle", "robust", "curious",
    "practical", "elegant", "heavy", "local", "global", "digital", "seasonal", "formal", "strange",
    "reliable", "noisy", "precise", "creative", "early", "late", "useful", "tiny", "enormous", "green",
]
_VERBS = [
    "explains", "builds", "describes", "improves", "measures", "protects", "compares", "reveals",
    "organizes", "supports", "changes", "connects", "follows", "reduces", "creates", "tests", "shapes",
    "guides", "balances", "examines", "collects", "predicts", "simplifies", "celebrates", "repairs",
]
_ADVERBS = [
    "quickly", "carefully", "slowly", "often", "rarely", "usually", "quietly", "clearly", "gradually",
    "suddenly", "eventually", "directly", "mostly", "barely", "happily", "deliberately",
]
_CONNECTORS = [
    "However,", "In addition,", "For example,", "As a result,", "Meanwhile,", "In practice,", "Overall,",
    "On the other hand,", "First,", "Finally,", "Interestingly,", "Because of this,", "Still,",
]
_TOPICS = [
    "climate science", "medieval trade", "machine learning", "urban planning", "marine biology",
    "personal finance", "classical music", "software testing", "space exploration", "nutrition",
    "renewable energy", "ancient languages", "project management", "photography", "chess strategy",
]
_TASKS = [
    "Write a short story about", "Explain in simple terms", "Summarize the main ideas of",
    "Give me three tips for", "What are the pros and cons of", "Describe the history of",
    "Draft an email about", "Compare two approaches to", "Write a poem about", "How do I get started with",
    "List the key facts about", "Translate this idea into plain English:",
]
_SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in as few words as possible.",
    "You are an expert tutor who explains every step.",
    "You are a friendly assistant that always answers politely and checks its work.",
    "You are a careful assistant. If you are unsure, say so.",
]
_TULU_SOURCES = [
    "ai2-adapt-dev/oasst1_converted", "ai2-adapt-dev/flan_v2_converted", "ai2-adapt-dev/tulu_hard_coded_repeated_10",
    "allenai/tulu-3-sft-personas-math", "ai2-adapt-dev/personahub_code_v2_34999", "ai2-adapt-dev/no_robots_converted",
    "ai2-adapt-dev/evol_codealpaca_heval_decontaminated", "ai2-adapt-dev/numinamath_tir_math_decontaminated",
    "ai2-adapt-dev/coconot_converted", "ai2-adapt-dev/wildchat_gpt4_converted",
]
_ACTIVITIES = [
    "Removing ice from car", "Baking cookies", "Playing violin", "Washing dishes", "Riding a bike",
    "Painting a fence", "Brushing teeth", "Walking the dog", "Making a sandwich", "Doing crunches",
    "Planting a tree", "Ironing clothes", "Rock climbing", "Kayaking", "Cleaning windows", "Tying a tie",
]
_PEOPLE = ["A man", "A woman", "A young boy", "A girl", "Two people", "A chef", "An athlete", "A teenager"]
_ACTIONS = [
    "is standing in front of a {n}", "walks toward the {n}", "picks up a {a} {n}", "is talking to the camera",
    "holds a {n} in one hand", "kneels next to the {n}", "waves at a {a} crowd", "opens the door of the {n}",
]
_ENDING_VERBS = [
    "puts the {n} down and smiles", "starts cleaning the {n} with a cloth", "jumps over the {a} {n}",
    "throws the {n} into the water", "continues to work on the {n}", "turns around and walks away",
    "begins to laugh at the {a} {n}", "shows the finished {n} to the camera", "falls asleep on the {n}",
    "sprays water onto the {n}", "adds more paint to the {n}", "rides away from the {a} {n}",
]


_SYLLABLES = [
    "ka", "lo", "mir", "dan", "vel", "tor", "sha", "qui", "ren", "bel", "os", "tra", "zim", "pha", "gud",
    "nor", "lys", "ek", "wan", "dro", "fe", "sul", "an", "bri", "co", "mek", "tal", "xu", "yor", "vin",
]


def _pseudo_word(rng: random.Random) -> str:
    """An invented proper noun (place, product, species) so the vocabulary is not tiny."""
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize()


def _sentence(rng: random.Random) -> str:
    """One sentence of 6-20 words from a random template."""
    n1, n2 = rng.choice(_NOUNS), rng.choice(_NOUNS)
    a1, a2 = rng.choice(_ADJECTIVES), rng.choice(_ADJECTIVES)
    form = rng.randrange(8)
    if form == 0:
        s = f"The {a1} {n1} {rng.choice(_VERBS)} the {n2} {rng.choice(_ADVERBS)}."
    elif form == 1:
        s = f"{rng.choice(_NAMES)} {rng.choice(_VERBS)} a {a1} {n1} near the {a2} {n2}."
    elif form == 2:
        s = (f"{rng.choice(_CONNECTORS)} every {n1} {rng.choice(_VERBS)} its own {a2} {n2}, "
             f"which {rng.choice(_VERBS)} the {rng.choice(_NOUNS)}.")
    elif form == 3:
        s = f"In {rng.randint(1800, 2024)}, the {n1} was {rng.randint(2, 990)} meters from the {a1} {n2}."
    elif form == 4:
        s = (f"Many people think that a {a1} {n1} {rng.choice(_ADVERBS)} {rng.choice(_VERBS)} "
             f"the {n2}, but this is not always true.")
    elif form == 5:
        s = f"A {a1} {n1} and a {a2} {n2} are {rng.choice(_ADVERBS)} part of {rng.choice(_TOPICS)}."
    elif form == 6:
        s = (f"The {n1} of {_pseudo_word(rng)} {rng.choice(_VERBS)} {rng.randint(3, 9000)} "
             f"{n2}s every year, according to {rng.choice(_NAMES)} {_pseudo_word(rng)}.")
    else:
        s = f"{_pseudo_word(rng)} is a {a1} {n1} that {rng.choice(_VERBS)} the {a2} {n2} of {_pseudo_word(rng)}."
    return s


def _paragraph(rng: random.Random, num_sentences: int) -> str:
    return " ".join(_sentence(rng) for _ in range(max(1, num_sentences)))


def _text_of_words(rng: random.Random, num_words: int) -> str:
    """Paragraphs (and sometimes a bulleted list) totalling about ``num_words`` words."""
    parts: list[str] = []
    words = 0
    while words < num_words:
        if rng.random() < 0.15:
            items = [f"- {rng.choice(_ADJECTIVES).capitalize()} {rng.choice(_NOUNS)}: {_sentence(rng)}"
                     for _ in range(rng.randint(2, 5))]
            block = "\n".join(items)
        else:
            block = _paragraph(rng, rng.randint(2, 6))
        parts.append(block)
        words += len(block.split())
    return "\n\n".join(parts)


def _lognormal_words(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(math.exp(rng.gauss(math.log(median), sigma))))))


def generate_tulu3(num_rows: int, seed: int = 0) -> list[dict[str, Any]]:
    """Rows shaped like allenai/tulu-3-sft-mixture: ``{"id", "messages", "source"}``.

    About a quarter of the rows have a system prompt and a third are multi-turn; assistant answers
    have a log-normal length (median ~80 words, tail to ~2300 words).
    """
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        source = rng.choice(_TULU_SOURCES)
        messages: list[dict[str, str]] = []
        if rng.random() < 0.25:
            messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
        num_turns = 1 if rng.random() < 0.65 else rng.randint(2, 4)
        for _ in range(num_turns):
            task = f"{rng.choice(_TASKS)} {rng.choice(_TOPICS)}"
            if rng.random() < 0.4:
                task += ". " + _paragraph(rng, rng.randint(1, 4))
            else:
                task += "?" if task.split()[0] in ("What", "How") else "."
            messages.append({"role": "user", "content": task})
            words = _lognormal_words(rng, 80 / num_turns**0.5, 1.2, 3, 2300)
            answer = _text_of_words(rng, words) if words > 12 else " ".join(_sentence(rng).split()[:words])
            messages.append({"role": "assistant", "content": answer})
        rows.append({"id": f"{source.split('/')[-1]}_{i}", "messages": messages, "source": source})
    return rows


def _math_problem(rng: random.Random) -> tuple[str, str, str]:
    """A (problem, step-by-step solution ending in \\boxed{}, answer) triple."""
    kind = rng.randrange(4)
    if kind == 0:
        a, x, b = rng.randint(2, 12), rng.randint(-20, 40), rng.randint(1, 60)
        c = a * x + b
        problem = f"Solve for $x$: ${a}x + {b} = {c}$."
        steps = [f"Subtract {b} from both sides: ${a}x = {c} - {b} = {c - b}$.",
                 f"Divide both sides by {a}: $x = \\frac{{{c - b}}}{{{a}}} = {x}$."]
        answer = str(x)
    elif kind == 1:
        name, item = rng.choice(_NAMES), rng.choice(_NOUNS)
        n, price = rng.randint(2, 15), rng.randint(2, 30)
        paid = n * price + rng.randint(0, 50)
        problem = (f"{name} buys {n} {item}s that cost ${price} each and pays with ${paid}. "
                   f"How much change does {name} receive?")
        steps = [f"The {item}s cost {n} \\times {price} = {n * price} dollars in total.",
                 f"The change is {paid} - {n * price} = {paid - n * price} dollars."]
        answer = str(paid - n * price)
    elif kind == 2:
        w, h = rng.randint(2, 40), rng.randint(2, 40)
        problem = f"A rectangle has width {w} and height {h}. What is its area plus its perimeter?"
        steps = [f"The area is ${w} \\cdot {h} = {w * h}$.", f"The perimeter is $2({w} + {h}) = {2 * (w + h)}$.",
                 f"Their sum is ${w * h} + {2 * (w + h)} = {w * h + 2 * (w + h)}$."]
        answer = str(w * h + 2 * (w + h))
    else:
        n = rng.randint(3, 30)
        problem = f"What is the sum of the first {n} positive integers?"
        steps = ["The sum $1 + 2 + \\dots + n$ equals $\\frac{n(n+1)}{2}$.",
                 f"With $n = {n}$ this is $\\frac{{{n} \\cdot {n + 1}}}{{2}} = {n * (n + 1) // 2}$."]
        answer = str(n * (n + 1) // 2)
    # Long-tail solutions: some solutions re-check their work at length, like real model outputs.
    extra = _lognormal_words(rng, 20, 1.2, 0, 900)
    if extra > 25:
        steps.insert(1, "Let us reason carefully. " + _text_of_words(rng, extra))
    solution = " ".join(steps) + f" The answer is $\\boxed{{{answer}}}$."
    return problem, solution, answer


def generate_openmathinstruct2(num_rows: int, seed: int = 0) -> list[dict[str, Any]]:
    """Rows shaped like nvidia/OpenMathInstruct-2 (all fields are strings)."""
    rng = random.Random(seed)
    sources = ["augmented_math", "augmented_gsm8k", "math", "gsm8k"]
    rows = []
    for _ in range(num_rows):
        problem, solution, answer = _math_problem(rng)
        rows.append({"problem": problem, "generated_solution": solution, "expected_answer": answer,
                     "problem_source": rng.choice(sources)})
    return rows


def generate_hellaswag(num_rows: int, seed: int = 0, split: str = "validation") -> list[dict[str, Any]]:
    """Rows shaped like Rowan/hellaswag; ``ctx == ctx_a + " " + ctx_b`` as in the real data."""
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        activity = rng.choice(_ACTIVITIES)
        n, a = rng.choice(_NOUNS), rng.choice(_ADJECTIVES)
        ctx_a = f"{rng.choice(_PEOPLE)} {rng.choice(_ACTIONS).format(n=n, a=a)}."
        if rng.random() < 0.5:
            ctx_a += " " + _sentence(rng)
        ctx_b = rng.choice(["he", "she", "they", "then, the person", "the camera pans and the person", ""])
        endings = []
        for _ in range(4):
            e = rng.choice(_ENDING_VERBS).format(n=rng.choice(_NOUNS), a=rng.choice(_ADJECTIVES))
            if rng.random() < 0.3:
                e += " while " + rng.choice(_ADVERBS) + " " + rng.choice(_VERBS) + " the " + rng.choice(_NOUNS)
            endings.append(e + ".")
        ctx = f"{ctx_a} {ctx_b}" if ctx_b else ctx_a
        split_type = rng.choice(["indomain", "zeroshot"])
        rows.append({
            "ind": i * 7 + rng.randint(0, 6), "activity_label": activity, "ctx_a": ctx_a, "ctx_b": ctx_b,
            "ctx": ctx, "endings": endings, "source_id": f"activitynet~v_{rng.getrandbits(40):010x}",
            "split": split, "split_type": split_type, "label": str(rng.randrange(4)),
        })
    return rows


def generate_pretrain_text(num_rows: int, seed: int = 0) -> list[dict[str, str]]:
    """Documents ``{"text": ...}`` of 20-1500 words for building an indexed pretraining sample."""
    rng = random.Random(seed)
    return [{"text": _text_of_words(rng, _lognormal_words(rng, 150, 1.0, 20, 1500))} for _ in range(num_rows)]


def write_jsonl(path: str, rows: Iterable[dict[str, Any]]) -> None:
    """Write rows as JSON lines (through a temporary file, renamed when complete)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def chat_texts(rows: Iterable[dict[str, Any]]) -> Iterable[str]:
    """All message contents of Tulu-3-style rows (for training a tokenizer)."""
    for row in rows:
        for m in row["messages"]:
            yield m["content"]


def write_sample_files(output_dir: str, seed: int = 0, vocab_size: int = 4096) -> dict[str, str]:
    """Write the shipped sample files, the tokenizer trained on them and the indexed pretraining sample.

    Returns the paths written, by name. The files are what the repository's ``data/`` folder holds.
    """
    os.makedirs(output_dir, exist_ok=True)
    tulu = generate_tulu3(300, seed)
    math_rows = generate_openmathinstruct2(200, seed + 1)
    hella = generate_hellaswag(200, seed + 2)
    pretrain = generate_pretrain_text(200, seed + 3)
    paths = {
        "tulu3": os.path.join(output_dir, "tulu3_sample.jsonl"),
        "openmathinstruct2": os.path.join(output_dir, "openmathinstruct2_sample.jsonl"),
        "hellaswag": os.path.join(output_dir, "hellaswag_sample.jsonl"),
        "pretrain": os.path.join(output_dir, "pretrain_sample.jsonl"),
    }
    write_jsonl(paths["tulu3"], tulu)
    write_jsonl(paths["openmathinstruct2"], math_rows)
    write_jsonl(paths["hellaswag"], hella)
    write_jsonl(paths["pretrain"], pretrain)

    def corpus() -> Iterable[str]:
        yield from chat_texts(tulu)
        for r in math_rows:
            yield r["problem"]
            yield r["generated_solution"]
        for r in hella:
            yield r["ctx"]
            yield from r["endings"]
        for r in pretrain:
            yield r["text"]

    paths["tokenizer"] = os.path.join(output_dir, "tokenizer")
    train_bpe_tokenizer(corpus(), paths["tokenizer"], vocab_size=vocab_size)
    prefix = os.path.join(output_dir, "pretrain_sample_text_document")
    build_indexed_dataset_from_jsonl(paths["pretrain"], load_tokenizer(paths["tokenizer"]), prefix,
                                     json_key="text", append_eod=True)
    paths["pretrain_indexed"] = prefix
    return paths
