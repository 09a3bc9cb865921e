"""The services, one package each (``router``, ``prefill``, ``decode``, ``kvstore``, ``planner``,
``trainer``), and ``common`` for what they share. A service never imports a peer service."""
