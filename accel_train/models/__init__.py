"""Models: where weights come from (sources.py: folders, GGUF files, the hub, trained runs), how a model and its
tokenizer are built with LoRA (build.py), the loss computed from its output head in chunks (loss.py), generation
built in one place (generation.py), a LoRA adapter merged into its base (merge.py), and the model card (card.py)."""
