"""``python -m cli``: the same as ``rocketkv-mt``."""
import sys

from cli.main import main

sys.exit(main())
