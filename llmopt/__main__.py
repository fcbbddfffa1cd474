"""`python -m llmopt ...` is the `llmopt` command."""

from llmopt.cli.app import main

main()
