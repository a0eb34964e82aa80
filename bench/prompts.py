"""The project's own benchmark prompts: 800 in four categories, built offline and deterministically.

- code: functions and methods from the Python standard library's own source (`inspect.getsource`),
  each with one of a few instructions (explain, add type hints, write a docstring, review).
- summarization: passages of the reference documentation that ships with Python
  (`pydoc_data.topics`) and long stdlib module docstrings, to summarize or to extract from.
- chat: everyday requests from templates crossed with topic lists.
- reasoning: arithmetic and word problems from templates, numbers drawn with a fixed seed.

Nothing comes from public benchmark sets (MT-bench, Spec-Bench) or from ShareGPT, so none of it
overlaps the EAGLE head's training data. The code and documentation passages depend on the running
Python's standard library: the set is fixed for one Python version (3.11 here), not across versions.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import random
import string
import textwrap
from dataclasses import dataclass
from functools import cache

CATEGORIES = ("code", "summarization", "chat", "reasoning")
PER_CATEGORY = 200
MAX_CHARS = 2000  # ~600 tokens at worst (code runs ~3 characters per token)
_MAX_BODY = 1500  # the quoted code or passage; the rest is the instruction


@dataclass(frozen=True)
class BenchPrompt:
    category: str
    text: str


def load_prompts(category: str | None = None, limit_per_category: int | None = None) -> list[BenchPrompt]:
    """All prompts of `category` (every category when None), the first `limit_per_category` of each.

    Each category's list is ordered so that any prefix spreads over its sources and templates.
    """
    if category is not None and category not in CATEGORIES:
        raise ValueError(f"unknown category {category!r}; choose one of {CATEGORIES}")
    out: list[BenchPrompt] = []
    for cat in CATEGORIES if category is None else (category,):
        texts = _BUILDERS[cat]()
        out += [BenchPrompt(cat, t) for t in texts[:limit_per_category]]
    return out


def _spread(items: list[str], n: int) -> list[str]:
    """n items taken evenly across `items` (sorted input -> a deterministic, varied subset)."""
    if len(items) < n:
        raise RuntimeError(f"only {len(items)} candidates for {n} prompts")
    return [items[i * len(items) // n] for i in range(n)]


def _interleave(items: list[str], n: int) -> list[str]:
    """Order a spread so that a prefix already covers the whole range (stride, not contiguous)."""
    chosen = _spread(items, n)
    stride = 7  # coprime with 200: visits every index once
    return [chosen[(i * stride) % n] for i in range(n)]


# -- code ------------------------------------------------------------------------------------
_CODE_MODULES = (
    "argparse", "base64", "bisect", "calendar", "colorsys", "configparser", "csv", "dataclasses",
    "difflib", "email.utils", "fnmatch", "fractions", "ftplib", "functools", "glob", "gzip", "heapq",
    "html", "http.cookies", "ipaddress", "json.decoder", "json.encoder", "mimetypes", "ntpath",
    "optparse", "pathlib", "pickle", "posixpath", "pprint", "quopri", "random", "shlex", "shutil",
    "statistics", "string", "tarfile", "textwrap", "tokenize", "urllib.parse", "uuid", "zipfile",
)
_CODE_TASKS = (
    "Explain what this Python function does, step by step:",
    "Add type hints to this Python function and return the full updated code:",
    "Write a docstring for this Python function:",
    "Review this Python function: point out possible bugs or edge cases and suggest improvements:",
)


@cache
def _code() -> list[str]:
    sources: set[str] = set()
    for name in _CODE_MODULES:
        mod = importlib.import_module(name)
        for obj in _functions(mod):
            try:
                src = textwrap.dedent(inspect.getsource(obj))
            except (OSError, TypeError):
                continue
            if 200 <= len(src) <= _MAX_BODY:
                sources.add(src)
    chosen = _interleave(sorted(sources), PER_CATEGORY)
    return [f"{_CODE_TASKS[i % len(_CODE_TASKS)]}\n\n```python\n{src}```" for i, src in enumerate(chosen)]


def _functions(mod: object) -> list[object]:
    """Module-level functions and methods of module-level classes, defined in `mod` itself."""
    found = []
    for _, obj in inspect.getmembers(mod):
        if getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isfunction(obj):
            found.append(obj)
        elif inspect.isclass(obj):
            found += [m for _, m in inspect.getmembers(obj, inspect.isfunction) if m.__module__ == mod.__name__]
    return found


# -- summarization / extraction --------------------------------------------------------------
_DOC_TASKS = (
    "Summarize the following text in three sentences:",
    "Extract all function, statement and keyword names mentioned in the following text, as a list:",
    "Summarize the following documentation for a beginner in one short paragraph:",
    "List the key facts stated in the following text as bullet points:",
)


@cache
def _summarization() -> list[str]:
    import pydoc_data.topics

    docs = list(pydoc_data.topics.topics.values())
    docs += [importlib.import_module(m).__doc__ or "" for m in _CODE_MODULES]
    passages = sorted({p for doc in docs for p in _passages(doc)})
    chosen = _interleave(passages, PER_CATEGORY)
    return [f"{_DOC_TASKS[i % len(_DOC_TASKS)]}\n\n{p}" for i, p in enumerate(chosen)]


def _passages(doc: str, lo: int = 500) -> list[str]:
    """Whole paragraphs packed into passages of lo.._MAX_BODY characters (shorter rest dropped)."""
    out: list[str] = []
    cur = ""
    for para in doc.split("\n\n"):
        para = para.strip()
        if not para or len(para) > _MAX_BODY:
            continue
        if len(cur) + len(para) + 2 > _MAX_BODY:
            if len(cur) >= lo:
                out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    if len(cur) >= lo:
        out.append(cur)
    return out


# -- conversational chat ---------------------------------------------------------------------
_CHAT_TEMPLATES = (
    "Can you give me some practical tips for {activity} when I only have {time} a week?",
    "I'm planning {event} with my {person}. What should I keep in mind?",
    "How would you explain {concept} to my {person}, who has never heard of it?",
    "Write a short, friendly message to my {person} about {event}.",
    "I have {food_a} and {food_b} at home. What could I cook for dinner tonight?",
    "I want to get better at {activity}. Can you suggest a simple plan for {time} a week?",
    "My {person} and I disagree about {concept}. Can you help us see both sides?",
    "What are some good questions to ask my {person} before {event}?",
)
_TOPICS = {
    "activity": (
        "running", "learning to cook", "public speaking", "gardening on a balcony", "saving money",
        "learning a new language", "drawing", "sleeping better", "playing chess", "keeping a journal",
    ),
    "event": (
        "a birthday party for ten people", "a weekend camping trip", "moving to a new city",
        "a job interview", "a family reunion", "a road trip with my kids", "my first marathon",
        "a small wedding", "starting a vegetable garden", "hosting a board game night",
    ),
    "concept": (
        "compound interest", "how vaccines work", "why the sky is blue", "how a budget works",
        "what inflation is", "how recycling works", "why we have seasons", "how a credit score works",
        "what a healthy diet looks like", "how electric cars work",
    ),
    "time": ("one hour", "two hours", "thirty minutes", "three evenings", "a weekend morning"),
    "person": ("neighbour", "landlord", "manager", "sister", "old friend", "coach", "teacher", "roommate"),
    "food_a": ("rice", "eggs", "spinach", "chickpeas", "potatoes", "pasta", "tofu", "carrots"),
    "food_b": ("tomatoes", "cheese", "onions", "lentils", "mushrooms", "peppers", "yogurt", "beans"),
}


@cache
def _chat() -> list[str]:
    """Round-robin over the templates; each template's filled-in variants shuffled with a fixed seed."""
    rng = random.Random(20240603)
    variants = []
    for template in _CHAT_TEMPLATES:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f]
        filled = [template.format(**dict(zip(fields, vals))) for vals in itertools.product(*(_TOPICS[f] for f in fields))]
        rng.shuffle(filled)
        variants.append(filled)
    n = len(variants)
    return [variants[i % n][i // n] for i in range(PER_CATEGORY)]


# -- reasoning / math ------------------------------------------------------------------------
def _problem(kind: int, rng: random.Random) -> str:
    r = rng.randint
    if kind == 0:
        a, b, c = r(12, 90), r(3, 9), r(2, 15)
        return f"A shop has {a} boxes with {b} apples each. It sells {c} boxes. How many apples are left? Explain your reasoning."
    if kind == 1:
        v1, v2, d = r(40, 90), r(40, 90), r(100, 600)
        return (
            f"Two trains leave stations {d} km apart at the same time and travel towards each other at "
            f"{v1} km/h and {v2} km/h. After how many hours do they meet? Show your work."
        )
    if kind == 2:
        p, x = r(5, 45), r(80, 900)
        return f"What is {p}% of {x}? Then increase the result by {p}% and give the final number step by step."
    if kind == 3:
        a, x, b = r(2, 12), r(-20, 30), r(-50, 50)
        return f"Solve for x: {a}x + {b} = {a * x + b}. Explain each step."
    if kind == 4:
        age, diff, years = r(5, 30), r(20, 40), r(2, 15)
        return (
            f"A parent is {diff} years older than their child. In {years} years the child will be "
            f"{age + years}. How old is the parent now? Reason step by step."
        )
    if kind == 5:
        start, step = r(1, 20), r(2, 9)
        seq = ", ".join(str(start + step * i) for i in range(5))
        return f"What are the next three numbers in the sequence {seq}, and what is the 20th term? Explain."
    if kind == 6:
        w, h, cost = r(3, 15), r(3, 15), r(8, 40)
        return (
            f"A room is {w} m by {h} m. Flooring costs ${cost} per square metre plus 10% waste. "
            "How much does the flooring cost in total? Work it out step by step."
        )
    n, k = r(3, 9), r(10, 60)
    return (
        f"{n} friends share a bill of ${k * n + r(1, n - 1)} and want to split it as evenly as possible in "
        "whole dollars. How much does each person pay? Explain."
    )


@cache
def _reasoning() -> list[str]:
    rng = random.Random(7)
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < PER_CATEGORY:
        text = _problem(len(out) % 8, rng)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


_BUILDERS = {"code": _code, "summarization": _summarization, "chat": _chat, "reasoning": _reasoning}
