"""``python -m tandem ...`` is the ``tandem`` command (see tandem.cli)."""

import sys

from tandem.cli import main

sys.exit(main())
