"""`python -m everstep_cli`: the `everstep` command line."""

from everstep_cli.cli import main

if __name__ == "__main__":
    main()
