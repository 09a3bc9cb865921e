"""Llama-family models: what a spec names, the decoder, loading weights, and the parity oracle.

Import from the module that defines each name; this package imports nothing itself, so that
``meta`` (the only module the router needs) loads without torch.

- ``config``: ``ModelConfig`` (``.tiny()``, ``.from_hf_dict()``, ``.to_hf_dict()``), ``ModelLoadError``.
- ``meta``: ``load_model_meta(spec, data_dir) -> ModelMeta`` (config, tokenizer, name, where the
  weights are; no torch), the preset shapes of ``random:<preset>``.
- ``llama``: ``LlamaForCausalLM``: ``forward(input_ids, positions, kv_cache, meta) -> hidden [T, H]``,
  ``compute_logits(hidden) -> float32 logits``.
- ``loader``: ``load_model(spec, device, dtype, data_dir) -> LoadedModel``, ``save_hf_checkpoint``,
  ``build_random_model``; ``presets``: random weights of a preset shape on the device.
- ``reference``: ``reference_logits(model, ids)``, ``reference_generate(model, prompt_ids, max_new_tokens)``.
"""
