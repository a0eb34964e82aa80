"""A user's own chat GGUF: `make build-engines MODEL=... DRAFT=...` serves it with its own tokenizer.

The model is one the test writes itself (tests/unit/tiny_gguf.py). n-gram and draft_model work with
it, losslessly; the EAGLE drafters are refused with a clear error (the shipped head is SmolLM2's).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from build.make_draft_model import make_draft_gguf
from specgate.decoding.config import EngineConfig
from specgate.decoding.loading import load_target
from specgate.speculative import SpeculativeGenerator
from specgate.speculative.registry import build_drafters
from specgate.text.tokenizer import PromptTokenizer
from tests.conftest import ROOT
from tests.unit.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def built(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("user-model")
    model = write_tiny_gguf(gguf, tmp / "tiny-chat.gguf")
    draft = tmp / "tiny-chat-draft.gguf"
    make_draft_gguf(model, draft, 1)
    subprocess.run(
        [sys.executable, "-m", "build.build_engines", "--model", str(model), "--draft", str(draft), "--out-dir", str(tmp / "out"),
         "--max-context", "512"],
        cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
    )
    return tmp / "out"


def test_the_repository_serves_the_users_model(built: Path) -> None:
    spec = EngineConfig.load(built / "engines" / "cpu" / "spec_engine.json")
    assert spec.model.name == "tiny-chat.gguf" and spec.draft_model is not None and spec.eagle_head_dir is None
    gate = (built / "model_repository" / "spec_gate" / "config.pbtxt").read_text()
    pre = (built / "model_repository" / "preprocessing" / "config.pbtxt").read_text()
    tokenizer_dir = ROOT / "artifacts" / "models" / "tiny-chat"
    assert str(tokenizer_dir) in pre and json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert 'key: "end_id" value: { string_value: "2" }' in gate  # the GGUF's own EOS


def test_ngram_and_draft_model_are_lossless_and_eagle_is_refused(built: Path) -> None:
    cfg = EngineConfig.load(built / "engines" / "cpu" / "spec_engine.json")
    target = load_target(cfg, cfg.model, num_slots=1, tree_nodes=16)
    gen = SpeculativeGenerator(target, build_drafters(target, cfg))
    prompt = PromptTokenizer(ROOT / "artifacts" / "models" / "tiny-chat", 400).encode_prompt("Repeat: one two three one two three")
    logits, _ = target.prefill(0, prompt, features=False)
    plain = []
    for _ in range(24):
        plain.append(int(logits.argmax()))
        logits = target.forward([(0, [plain[-1]])])[0]
    target.release(0)
    for algorithm in ("ngram", "draft_model"):
        stream = gen.generate(prompt, 24, algorithm=algorithm, end_id=-1)
        assert [t for block in stream for t in block] == plain
        assert stream.stats.draft_tokens > 0
    for algorithm in ("eagle", "eagle2", "hybrid"):
        with pytest.raises(ValueError, match="needs an EAGLE head trained for this model"):
            gen.generate(prompt, 8, algorithm=algorithm)
