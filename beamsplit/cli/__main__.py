"""`python -m beamsplit.cli ...`: what the launcher and the tests start servers with."""

from __future__ import annotations

import sys

from beamsplit.cli import main

sys.exit(main())
