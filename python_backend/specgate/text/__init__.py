"""Text side of serving: tokenizer + chat template (preprocessing), incremental detokenizer (spec_gate)."""
