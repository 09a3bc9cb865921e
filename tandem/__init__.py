"""tandem: disaggregated LLM serving and single-GPU large-model training over NATS."""
__version__ = "0.1.0"
