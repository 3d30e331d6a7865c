"""``python -m worker_ingress``: the same as the ``worker-ingress`` command."""

from worker_ingress._cli import main

if __name__ == "__main__":
    main()
