"""LoRA adapters: PEFT's on-disk format, adapters resident on the device in slots, and the low-rank
products a mixed batch adds to the base model's projections (rows of different adapters and rows of
none in one forward)."""
