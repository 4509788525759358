"""``python3 cascwrap.py on|off bench ...``: the CLI with a head-major store's prefill split per lane (on, as before
session 29) or in one paged launch (off, the default since)."""

import sys

from sparse_serve import paged_attention

paged_attention.HEAD_MAJOR_CASCADE = sys.argv.pop(1) == "on"

from sparse_serve.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
