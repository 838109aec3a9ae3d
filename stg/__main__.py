"""`python -m stg`: the same as the `stg` command."""

from stg.cli import main

if __name__ == "__main__":
    main()
