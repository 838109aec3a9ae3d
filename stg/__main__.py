"""`python -m stg`: the same as the `stg` command."""

from stg.cli import run

if __name__ == "__main__":
    run()
