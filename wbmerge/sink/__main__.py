"""`python -m wbmerge.sink` is `wbmerge sink serve`."""

from ..cli import main

main(["sink", "serve", *__import__("sys").argv[1:]])
