"""`python -m hla_tvm`: the `hla-tvm` command line."""
import sys

from .cli import main

sys.exit(main())
