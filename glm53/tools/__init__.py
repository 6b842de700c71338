"""Command-line tools that work on checkpoint files (`python -m glm53.tools.<tool> --help`)."""
