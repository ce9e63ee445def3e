"""`python -m minillm.cli`, the same as `minillm` and `python -m minillm`."""

from minillm.cli import main

main()
