"""Tools for GRPO's multi-turn rollouts (grpo.tools: [configs/tools/arithmetic.py:add, ...]): plain functions with
type hints and a Google-style docstring, which transformers turns into the JSON schema the chat template shows the
model. A call's return value (or the error that ended it, or a time-out after grpo.tool_timeout_s) comes back to the
model as a tool turn; the reward functions see every turn as `trajectories`."""


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b
