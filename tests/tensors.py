"""What the chunked losses may hold: the largest tensors of the vocabulary's width an op makes (test_grpo.py,
test_distill.py)."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LargestTensors(TorchDispatchMode):
    """The most elements of a tensor with `vocab` as its last dimension that each op (by name) made, forward and
    backward, but for the output head's weight transposed, (`hidden`, `vocab`)."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.vocab, self.hidden, self.sizes = vocab, hidden, defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab
                    and t.shape != (self.hidden, self.vocab)):
                name = func.overloadpacket.__name__
                self.sizes[name] = max(self.sizes[name], t.numel())
        return out
