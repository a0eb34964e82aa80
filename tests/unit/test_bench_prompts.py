"""The benchmark prompt set: sizes, determinism, no duplicates, bounded length, category filters."""

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bench.prompts import CATEGORIES, MAX_CHARS, PER_CATEGORY, BenchPrompt, load_prompts

ROOT = Path(__file__).resolve().parents[2]


def test_800_prompts_200_per_category_unique_and_bounded() -> None:
    prompts = load_prompts()
    assert Counter(p.category for p in prompts) == {c: PER_CATEGORY for c in CATEGORIES}
    assert len(prompts) == 800
    assert len({p.text for p in prompts}) == len(prompts)
    assert all(20 <= len(p.text) <= MAX_CHARS for p in prompts)


def _digest(prompts: list[BenchPrompt]) -> str:
    return hashlib.sha256(json.dumps([(p.category, p.text) for p in prompts]).encode()).hexdigest()


@pytest.mark.parametrize("hash_seed", ["1", "2"])
def test_deterministic_across_processes(hash_seed: str) -> None:
    """Fresh interpreters with different string-hash seeds (set order) build the same list."""
    code = "from bench.prompts import load_prompts; from tests.unit.test_bench_prompts import _digest; print(_digest(load_prompts()))"
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == _digest(load_prompts())


def test_category_and_limit() -> None:
    assert load_prompts("reasoning", 3) == load_prompts("reasoning")[:3]
    some = load_prompts(limit_per_category=5)
    assert [p.category for p in some] == [c for c in CATEGORIES for _ in range(5)]
    assert all(isinstance(p, BenchPrompt) for p in some)
    with pytest.raises(ValueError):
        load_prompts("poetry")
