"""``python -m frontend_shim``: the same as the ``frontend-shim`` command."""

from frontend_shim._cli import main

if __name__ == "__main__":
    main()
