"""``python -m tandem ...`` is the ``tandem`` command (see tandem.cli.main)."""

import sys

from tandem.cli.main import main

sys.exit(main())
