"""Prompt sets for tests: varied topics, lengths and scripts (never from public benchmark sets)."""

GREEDY_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a ten-year-old.",
    "List three uses for a paperclip.",
    "Translate 'good morning' into Spanish and German.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What is 17 times 23? Show your work.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Describe a cat to someone who has never seen one.",
    "What are the primary colors?",
    "Write a short limerick about a programmer.",
    "How do airplanes stay in the air?",
    "Name five countries in Africa.",
    "What does HTTP stand for?",
    "Write a SQL query that counts rows in a table named users.",
    "Give two tips for better sleep.",
    "What is photosynthesis?",
    "Tell me a fun fact about octopuses.",
]

UNICODE_PROMPTS = [
    "Réponds en français : quelle est la couleur du ciel ? 🌤️",
    "Write three emoji that describe the ocean 🌊 and explain each.",
    "日本の首都はどこですか？",
    "Привет! Как дела?",
]
