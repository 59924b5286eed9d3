"""`python -m runtime.plot`: the public command; the code is runtime.observe.plot."""

import sys

from runtime.observe.plot import main

if __name__ == "__main__":
    sys.exit(main())
