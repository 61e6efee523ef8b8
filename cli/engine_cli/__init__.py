"""The `engine` command line."""
