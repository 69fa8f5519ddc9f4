"""Regenerate this folder: a character-level tokenizer with a chat template and a ~100k-parameter
Llama config. No weights are stored: accel_train builds the model from config.json with
`model.random_init=true`, so the default run needs nothing from the network.

    python configs/model/tiny-llama/make_tiny.py
"""

import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast

HERE = Path(__file__).parent
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
CHARS = list(string.ascii_lowercase + string.digits + " +-=:.,?!'")
# user and assistant turns start with their special token; a system (or tool) turn has none, and is written as
# `system: CONTENT` in characters the vocabulary has, so that adding it changed no token id.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
    "{% else %}{{ m['role'] + ': ' + m['content'] }}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token per character
backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
backend.decoder = decoders.Fuse()
backend.add_special_tokens(SPECIALS)
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
    chat_template=CHAT_TEMPLATE,
)
tokenizer.save_pretrained(HERE)

LlamaConfig(
    vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
    pad_token_id=vocab["<pad>"], bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"],
    tie_word_embeddings=False,
    # Random frozen weights at the usual 0.02 give logits too small for a LoRA adapter to sharpen;
    # 0.2 lets the default run learn its task in seconds.
    initializer_range=0.2,
).save_pretrained(HERE)
