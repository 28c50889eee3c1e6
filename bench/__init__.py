"""postrl's benchmarks: scripts run from the repository's root as ``python -m bench.<name>``
(bench/README.md), importing each other as ``bench.<name>``. Not part of the package that
installs (pyproject.toml ships ``postrl*`` only)."""
