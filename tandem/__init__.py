"""tandem: disaggregated LLM serving and single-GPU large-model training over NATS.

Two layers live here: :mod:`tandem.client` (the library an application uses; below the services)
and :mod:`tandem.cli` (the ``tandem`` command; above everything). ``shared``, ``services`` and
``console`` are the checkout's top-level folders, linked in here so the checkout reads as the
installed package does."""



def __getattr__(name: str) -> str:
    # Looked up on first use, so importing any tandem module does not read package metadata.
    if name == "__version__":
        from tandem.shared.infra.version import VERSION

        return VERSION
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
