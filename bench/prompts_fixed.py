"""A small fixed prompt set for decode-speed benchmarks (long, open-ended answers)."""

DECODE_PROMPTS = [
    "Write a detailed story about a robot who learns to paint.",
    "Explain how a refrigerator works, step by step.",
    "Describe a day in the life of a medieval blacksmith.",
    "Write a long letter to a friend about your trip to the mountains.",
    "Explain the water cycle to a curious child, with examples.",
    "Write an essay about why people enjoy music.",
]
