"""``python -m pb_tensor [demo|bench|doctor]``."""

from pb_tensor.cli import main

raise SystemExit(main())
