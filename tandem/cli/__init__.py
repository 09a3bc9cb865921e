"""The ``tandem`` command: the layer above everything else. It starts services (``up``,
``serve``), runs benchmarks, bundles, trains, and talks to a running system through
:mod:`tandem.client`. Nothing below it (client, services, console, shared) imports it."""
