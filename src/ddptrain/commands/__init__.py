"""The subcommands of `ddptrain`: one module each, a plain typed function that the CLI, tests and the Python API call."""
