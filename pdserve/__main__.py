"""``python -m pdserve`` runs the command line interface."""

from pdserve.app.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
