"""What several tasks share, each named for what it is (tasks/ import these, never each other):

    responses.py     responses to train on: SFT rows tokenized with labels on the answers, collated, counted
    pairs.py         preference pairs: formats, prompt-first fitting, collation, inspect
    prompts.py       prompts to generate from: rendered with the generation prompt, cut to a budget, collated
    completions.py   completions sampled per prompt with seeded noise, single- or multi-turn
    logprobs.py      log-probs of trained tokens: per sequence, and per completion token with its entropy in chunks
    reference.py     the reference model: the adapter disabled, a frozen adapter, or a frozen copy
    rewards.py       reward functions (built-in, the user's, a reward model), checked and weighted; no torch
    reward_model.py  a trained reward model scoring completions as task reward trained it
    tools.py         tool calling and environments of multi-turn rollouts; no torch at import

Seeded sampling itself (row_seed, SeededSampler) and every generate() call's settings are in generation.py.
"""
