"""Command-line interface: a click group whose subcommands are imported lazily."""
