"""Text: tokenizers (byte-level for the built-in models, Hugging Face ``tokenizer.json`` otherwise). No torch."""
