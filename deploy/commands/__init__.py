"""The ``hybridflow`` subcommands, one module each; ``deploy/cli.py`` dispatches to them."""
