"""tandem: disaggregated LLM serving and single-GPU large-model training over NATS.

Two layers live here: :mod:`tandem.client` (the library an application uses; below the services)
and :mod:`tandem.cli` (the ``tandem`` command; above everything). ``shared``, ``services`` and
``console`` are the checkout's top-level folders, linked in here so the checkout reads as the
installed package does."""

from tandem.shared.infra.version import VERSION as __version__

__all__ = ["__version__"]
