"""The planner: ``service.py`` (on the bus), ``policy.py`` (the formulas), ``window.py`` (the load it reads)."""
