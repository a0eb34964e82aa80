"""The draft-model drafter's books: what it catches up on (the prompt, plain steps) is reported apart
from what it drafts, so the engine prices nodes without it (cost_model/ledger.py)."""

from __future__ import annotations

import pytest
import torch

from specgate.decoding.llamacpp_target import LlamaCppTarget
from specgate.decoding.sampling import SamplingParams
from specgate.speculative.draft_model import STEP_FEED, DraftModelDrafter

NO_FEATURES = torch.empty(0)


@pytest.fixture(scope="module")
def drafter(gguf) -> DraftModelDrafter:  # noqa: ANN001
    # the target's own file as its draft: any GGUF with the target's vocabulary drafts
    draft = LlamaCppTarget(gguf, 512, num_slots=1, threads=2, exact=True)
    return DraftModelDrafter(draft, draft.info.vocab_size)


def test_a_catch_up_is_reported_apart_and_a_drafted_steps_feed_is_not(drafter: DraftModelDrafter) -> None:
    prompt = list(range(1000, 1300))
    drafter.begin(prompt, SamplingParams(), torch.Generator().manual_seed(0))
    tokens = [*prompt, 42]
    assert drafter.backlog(tokens, features=0) == len(tokens)  # the prompt, then the root

    tree = drafter.propose(tokens, NO_FEATURES, 3)
    assert drafter.catchup_ms > 0  # the draft prefilled the prompt

    for accepted in (3, 1, 0):  # all, some and none of a chain: the next step feeds 1-2 tokens
        drafter.accept(tree, list(range(accepted)))
        tokens += tree.tokens[:accepted].tolist() + [7]
        assert 1 <= drafter.backlog(tokens, features=0) <= STEP_FEED
        tree = drafter.propose(tokens, NO_FEATURES, 3)
        assert drafter.catchup_ms == 0.0

    drafter.accept(tree, [])
    tokens += [8, 9, 10, 11]  # the bonus token, then three plain steps the draft did not see
    assert drafter.backlog(tokens, features=0) == 4
    drafter.propose(tokens, NO_FEATURES, 3)
    assert drafter.catchup_ms > 0
