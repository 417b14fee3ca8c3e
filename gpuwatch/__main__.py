"""`python -m gpuwatch` runs the CLI."""

from gpuwatch.cli.main import cli

if __name__ == "__main__":
    cli()
