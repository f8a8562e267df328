"""`python -m featcache.cli ARGS`: the `featcache` command."""

from . import main

main()
